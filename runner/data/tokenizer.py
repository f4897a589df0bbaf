"""Tokenizers: a byte-level one for the presets (nothing to download) and transformers' for `model.path`.

Both render a chat (a list of {role, content}) as segments `(token ids, is_target)`; the loss is
taken on target segments only (the assistant's replies, their tool calls and their end-of-turn token), so
prompt tokens get label -100 downstream. Prompt/response records are a two-message chat (user, assistant). A
tool-calling chat (runner/data/tools.py `ToolChat`) carries its tools, which the chat template renders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from jobspec.errors import ConfigError
from runner.data.tools import tool_call_text, tools_text

log = logging.getLogger("jobspec.runner")
Segment = tuple[list[int], bool]  # (token ids, is_target)
TokenArrays = tuple[np.ndarray, np.ndarray]  # a rendered chat: (int64 token ids, bool target flags)
Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | "tool", "content": str, "tool_calls": [...]}


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    pad_id: int
    eos_id: int
    max_token_chars: int  # the most characters of text one token covers (the data's clipping rule)

    def render(self, messages: Sequence[Message]) -> list[Segment]: ...

    def render_texts(self, texts: Sequence[str]) -> list[TokenArrays]: ...


def _document(ids: Sequence[int] | np.ndarray, bos: int | None, eos: int) -> TokenArrays:
    """A raw document's tokens for continued pretraining: `bos` first unless there (None: the tokenizer adds its own,
    if any), `eos` last unless there, every token a target (the first never is one: nothing comes before it)."""
    out = np.asarray(ids, dtype=np.int64)  # arrays, not lists: a document is kept whole (up to MAX_RECORD_BYTES)
    if bos is not None and (not len(out) or out[0] != bos):
        out = np.concatenate(([bos], out))
    if not len(out) or out[-1] != eos:
        out = np.concatenate((out, [eos]))
    return out, np.ones(len(out), dtype=bool)


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; specials follow. No merges, no vocabulary file.

    Chat template (one special token per role, so no text can fake a turn):
        <bos> [<system> tools: JSON] {<system>|<user>|<tool> content-bytes}... <assistant> reply-bytes <eos> ...
    Targets: each assistant reply's bytes (its tool calls after its content, each `<tool_call>JSON</tool_call>`)
    and its <eos>; everything else is prompt.
    """

    PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, TOOL = range(256, 263)
    ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
    name = "bytes"
    VERSION = 2  # raise when the ids this class gives change: the cached tokenized data is keyed by it
    vocab_size = 263  # every preset's vocabulary (>= 512) holds it; the rows above stay unused
    pad_id = PAD
    eos_id = EOS
    max_token_chars = 1  # a token is one byte, at most one character

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    # Special tokens as text, in id order (256...), for the exported Hugging Face tokenizer.
    SPECIAL_TEXT = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
    CHAT_TEMPLATE = (
        "{{ bos_token }}{% if tools %}<|system|>tools: {{ tools | tojson }}{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}"
        "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
        "{{ eos_token }}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )

    def render(self, messages: Sequence[Message]) -> list[Segment]:
        segments: list[Segment] = [([self.BOS], False)]
        for role, text in _turns(messages, self.ROLES):
            if role == "assistant":
                segments += [([self.ASSISTANT], False), ([*self.encode(text), self.EOS], True)]
            else:
                segments.append(([self.ROLES[role], *self.encode(text)], False))
        return segments

    def render_ids(self, messages: Sequence[Message]) -> TokenArrays:
        """`render`'s ids and flags as two arrays, built from the chat's UTF-8 bytes at once (numpy's
        repeat and frombuffer), not a Python int per byte: ~20 numpy calls a chat whatever its length.

        Pieces in order: <bos>, then per message its role token, its content bytes, and for a reply <eos>.
        """
        turns = _turns(messages, self.ROLES)
        roles = [role for role, _ in turns]
        blob = [text.encode("utf-8") for _, text in turns]
        n = len(turns)
        reply = np.array([r == "assistant" for r in roles], dtype=bool)
        fill = np.empty(3 * n + 1, dtype=np.int64)  # token of each piece; -1: the content bytes go there
        fill[0], fill[1::3], fill[2::3], fill[3::3] = self.BOS, [self.ROLES[r] for r in roles], -1, self.EOS
        sizes = np.empty(3 * n + 1, dtype=np.int64)
        sizes[0], sizes[1::3], sizes[2::3], sizes[3::3] = 1, 1, [len(b) for b in blob], reply
        target = np.zeros(3 * n + 1, dtype=bool)
        target[2::3], target[3::3] = reply, reply  # a reply's bytes and its <eos>
        ids = np.repeat(fill, sizes)
        ids[np.repeat(fill < 0, sizes)] = np.frombuffer(b"".join(blob), dtype=np.uint8)
        return ids, np.repeat(target, sizes)

    def render_batch(self, chats: Sequence[Sequence[Message]]) -> list[TokenArrays]:
        return [self.render_ids(m) for m in chats]

    def generation_prompt(self, prompt: str | Sequence[Message]) -> list[int]:
        """The ids a completion is sampled after (GRPO): a text prompt as raw text after <bos> (TRL: no template for
        a text prompt), a chat rendered, then the assistant's role token (the generation prompt)."""
        if isinstance(prompt, str):
            return [self.BOS, *self.encode(prompt)]
        return [*self.render_ids(prompt)[0].tolist(), self.ASSISTANT]

    def render_texts(self, texts: Sequence[str]) -> list[TokenArrays]:
        """Raw documents (`data.format: text`): <bos> bytes <eos>, every token a target."""
        return [_document(np.frombuffer(t.encode("utf-8"), np.uint8), self.BOS, self.EOS) for t in texts]

    def cache_identity(self) -> dict[str, str]:
        """What decides this tokenizer's output, for the tokenized-data cache key (runner/data/cache.py)."""
        return {"tokenizer": f"{self.name} v{self.VERSION}", "vocab_size": str(self.vocab_size),
                "chat_template": self.CHAT_TEMPLATE}  # fmt: skip

    def to_hf(self) -> object:
        """The same tokenizer as a transformers `PreTrainedTokenizerFast` (what an export ships).

        A byte-level BPE with no merges over GPT-2's byte-to-character table gives id b to byte b; the
        specials are added tokens 256-261 and the chat template renders exactly `render`'s ids (checked in
        tests/runner/output/test_export.py). Text that spells a special token (`<|user|>`) is that token in the
        exported tokenizer but plain bytes here; the training data never relies on the difference.
        """
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as RawTokenizer
        from transformers import PreTrainedTokenizerFast

        chars = _byte_chars()
        raw = RawTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.SPECIAL_TEXT])
        pad, bos, eos = self.SPECIAL_TEXT[:3]
        hf = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=pad, bos_token=bos, eos_token=eos)
        hf.chat_template = self.CHAT_TEMPLATE
        return hf


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


class HFTokenizer:
    """A transformers tokenizer from a local directory; its chat template when it has one.

    The targets of a templated chat are found in one of three ways, the first that applies:

    1. `generation`: the template marks the reply tokens with `{% generation %}` blocks. transformers'
       `apply_chat_template(..., return_assistant_tokens_mask=True)` renders and tokenizes the chat
       once and masks every token overlapping a block: the template's author decides what is trained.
    2. `markers`: no generation blocks (transformers' mask is then all zeros, with a warning, so this
       piece is ours). One rendering with each reply wrapped in private-use marker characters says
       where every reply's content lies in the plain rendering; the first reply's own prompt and full
       renderings say what the template writes before a reply (the generation prompt) and after it
       (its end of turn, e.g. `<|im_end|>\n`). Target = content + end of turn,
       the same text as path 3; the chat is tokenized once with offsets and a token is a target when
       it overlaps that text (transformers' rule for generation blocks). Checked on every chat: the
       marked rendering less its markers is the plain one, and every reply sits between the
       generation prompt and the end of turn; a template that trims or rewrites content, or renders
       a turn differently by position, fails a check and takes path 3.
    3. `prefixes`: each reply found by rendering the chat up to it twice (with and without the reply)
       and diffing the text. Any incremental template works without offsets, but it renders O(turns)
       times per chat, O(turns^2) in all: kept only for the chats 1 and 2 cannot take (or a slow
       tokenizer, which has no offsets).

    Paths 1 and 2 tokenize the whole rendering, as `apply_chat_template` does at inference; path 3
    tokenizes each piece apart. Where the template's special tokens separate the turns (every common
    template) both give the same ids; a merge across a prompt/reply boundary would differ.
    Without a template: `role: content\n` per message, the reply after `assistant: `, then EOS.

    A tool-calling chat (runner/data/tools.py) is rendered with its tools (`apply_chat_template(tools=...)`) on every
    path; a reply that calls a tool takes path 1 or 3 (the markers of path 2 would cover its content, not the calls
    the template writes after it). A template that does not render tools or tool calls fails such a chat: the model
    would learn calls to functions it was never shown.
    """

    VERSION = 2  # raise when the ids or targets `render` gives change (the cached tokenized data is keyed by it)

    def __init__(self, tokenizer: object, path: str):
        self.tok = tokenizer
        self.name = path
        self.vocab_size = len(tokenizer)  # type: ignore[arg-type]
        eos = getattr(tokenizer, "eos_token_id", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        if eos is None:
            raise ConfigError(f"model.path {path!r}: the tokenizer has no eos_token (needed to end replies)")
        self.eos_id = int(eos)
        self.pad_id = int(pad if pad is not None else eos)  # padded positions are never targets
        self.max_token_chars = _longest_token(tokenizer)
        template = self.template = _template_text(tokenizer)  # read once: every tool chat checks it (`_check_tools`)
        self.has_template = bool(template)
        fast = bool(getattr(tokenizer, "is_fast", False))  # offsets come from the Rust tokenizer only
        self.mask_from = "prefixes" if not fast else "generation" if GENERATION_TAG.search(template) else "markers"
        self._told: set[str] = set()  # log lines already written (once per tokenizer, not per record)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False)) if text else []  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))  # type: ignore[attr-defined]

    def generation_prompt(self, prompt: str | Sequence[Message]) -> list[int]:
        """The ids a completion is sampled after (GRPO), as TRL's GRPOTrainer makes them: a text prompt tokenized as it
        is, with the tokenizer's own special tokens (no template); a chat through the template with its generation
        prompt (without a template: `role: content` lines, then `assistant: `)."""
        if isinstance(prompt, str):
            return list(self.tok.encode(prompt))  # type: ignore[attr-defined]
        if not self.has_template:
            segments = self._render_plain([*prompt, {"role": "assistant", "content": ""}])
            return [t for ids, target in segments if not target for t in ids]
        return self.encode(self._chat(prompt, True))

    def _chat(self, messages: Sequence[Message], generation_prompt: bool, tools: Any = None) -> str:
        if not messages:
            return ""
        return str(
            self.tok.apply_chat_template(  # type: ignore[attr-defined]
                list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def render(self, messages: Sequence[Message]) -> list[Segment]:
        roles = [_role(m, ByteTokenizer.ROLES) for m in messages]  # a bad message fails on every path
        if not self.has_template:
            return self._render_plain(messages)
        tools, calls = self._check_tools(messages)
        if self.mask_from == "generation":
            return self._render_generation(messages, tools)
        if self.mask_from == "markers" and not calls:
            segments = self._render_marked(messages, roles)
            if segments is not None:
                return segments
        return self._render_by_prefixes(messages)

    def _check_tools(self, messages: Sequence[Message]) -> tuple[Any, bool]:
        """The chat's tools and whether a reply calls one (runner/data/tools.py); ConfigError when the template
        leaves out what the chat holds (it never mentions `tools`, or `tool_calls`)."""
        tools, calls = _tool_parts(messages)
        for needed, word in ((tools, "tools"), (calls, "tool_calls")):
            if needed and word not in self.template:
                raise ConfigError(
                    f"model.path {self.name!r}: its chat template does not render {word}, and the data holds them: "
                    "the model would learn tool calls it is never shown as it will be at inference. Use a model whose "
                    "template renders tools (Llama 3.1+, Qwen 2.5+, Mistral, Hermes), or data without tools"
                )
        return tools, calls

    def _render_generation(self, messages: Sequence[Message], tools: Any = None) -> list[Segment]:
        out = self.tok.apply_chat_template(  # type: ignore[attr-defined]
            list(messages), tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), out["assistant_masks"]
        if "eos" not in self._told and any(mask):
            self._told.add("eos")
            if not any(t == self.eos_id for t, m in zip(ids, mask, strict=True) if m):
                log.warning(
                    "tokenizer %s: the chat template's {%% generation %%} blocks leave out the eos token (id %d); "
                    "the model is not trained to end its replies", self.name, self.eos_id,
                )  # fmt: skip
        return _runs(ids, [bool(m) for m in mask])

    def _render_marked(self, messages: Sequence[Message], roles: list[str]) -> list[Segment] | None:
        """Path 2 of the class docstring; None when a check fails (the caller takes path 3)."""
        marked = self._marked_spans(messages, roles)
        if marked is None:
            return None
        enc = self.tok(marked[0], add_special_tokens=False, return_offsets_mapping=True)  # type: ignore[operator]
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        return _runs(ids, _overlap_flags(offsets, marked[1]).tolist())

    def _marked_spans(self, messages: Sequence[Message], roles: list[str]) -> tuple[str, list[tuple[int, int]]] | None:
        """The chat's plain rendering and the target (start, end) characters of each reply in it; None when a
        check of path 2 fails."""
        replies = [i for i, r in enumerate(roles) if r == "assistant"]
        tools = getattr(messages, "tools", None)
        text = self._chat(messages, False, tools)
        spans: list[tuple[int, int]] = []  # target (start, end) characters of each reply in `text`
        if replies:
            if any(OPEN in m["content"] or CLOSE in m["content"] for m in messages):
                return self._fallback("a message holds the marker characters U+E000/U+E001")
            marked = [{**m, "content": OPEN + m["content"] + CLOSE} if r == "assistant" else m
                      for m, r in zip(messages, roles, strict=True)]  # fmt: skip
            content = _unmark(self._chat(marked, False, tools), len(replies))
            if content is None or content[0] != text:
                return self._fallback("the template changes the text of a reply (trims or rewrites it)")
            first = replies[0]
            base = self._chat(messages[:first], False, tools)
            prompt = self._chat(messages[:first], True, tools)
            full = self._chat(messages[: first + 1], False, tools)
            reply = messages[first]["content"]
            if not (prompt.startswith(base) and full.startswith(prompt) and text.startswith(full)):
                return self._fallback("the template is not incremental")
            if not full[len(prompt) :].startswith(reply):
                return self._fallback("the template writes more than the generation prompt before a reply")
            opener, closer = prompt[len(base) :], full[len(prompt) + len(reply) :]
            for start, end in content[1]:
                if text[start - len(opener) : start] != opener or text[end : end + len(closer)] != closer:
                    return self._fallback("the template renders a reply differently by its place in the chat")
                spans.append((start, end + len(closer)))
        return text, spans

    def render_ids(self, messages: Sequence[Message]) -> TokenArrays:
        """`render`'s ids and flags as two arrays."""
        return self.render_batch([messages])[0]

    def render_texts(self, texts: Sequence[str]) -> list[TokenArrays]:
        """Raw documents (`data.format: text`), tokenized in one call with the tokenizer's own special tokens (a
        BOS where the model takes one), then EOS unless it ends with one; every token a target."""
        if not texts:
            return []
        enc = self.tok(list(texts), add_special_tokens=True)["input_ids"]  # type: ignore[operator]
        return [_document(ids, None, self.eos_id) for ids in enc]

    def render_batch(self, chats: Sequence[Sequence[Message]]) -> list[TokenArrays]:
        """`render_ids` of each chat, the same ids and flags: on path 2 the renderings of all the chats are
        tokenized in one call (the Rust tokenizer spreads a batch over the cores) and each token's target flag
        comes from its offsets by a vectorized search; the other paths render chat by chat."""
        out: list[TokenArrays | None] = [None] * len(chats)
        texts: list[str] = []
        where: list[tuple[int, list[tuple[int, int]]]] = []  # (chat index, target spans) of each text
        for k, messages in enumerate(chats):
            roles = [_role(m, ByteTokenizer.ROLES) for m in messages]
            marked = None
            if self.has_template and self.mask_from == "markers" and not self._check_tools(messages)[1]:
                marked = self._marked_spans(messages, roles)
            if marked is None:
                out[k] = segment_arrays(self.render(messages))
            else:
                texts.append(marked[0])
                where.append((k, marked[1]))
        if texts:
            enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=True)  # type: ignore[operator]
            for (k, spans), ids, offsets in zip(where, enc["input_ids"], enc["offset_mapping"], strict=True):
                out[k] = np.asarray(ids, dtype=np.int64), _overlap_flags(offsets, spans)
        return out  # type: ignore[return-value]  # every chat took one of the two branches

    def cache_identity(self) -> dict[str, str]:
        """What decides this tokenizer's output, for the tokenized-data cache key (runner/data/cache.py): the
        Rust tokenizer's whole serialized state (vocabulary, merges, normalizer, added tokens), the chat
        template, the special tokens and the class, hashed; not the directory's name."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer: its state is its files
            raise TypeError(f"tokenizer {self.name}: a slow tokenizer, no serialized state to key a cache by")
        specials = {k: str(v) for k, v in sorted(getattr(self.tok, "special_tokens_map", {}).items())}
        state = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()
        return {"tokenizer": f"{type(self.tok).__name__} sha256:{state}", "vocab_size": str(self.vocab_size),
                "chat_template": _template_text(self.tok), "special_tokens": json.dumps(specials, sort_keys=True),
                "mask_from": self.mask_from, "render": f"v{self.VERSION}"}  # fmt: skip

    def _fallback(self, why: str) -> None:
        if why not in self._told:
            self._told.add(why)
            log.info("tokenizer %s: %s; such chats find their replies by re-rendering (slower)", self.name, why)
        return None

    def _render_by_prefixes(self, messages: Sequence[Message]) -> list[Segment]:
        """Path 3 of the class docstring: two renderings per reply."""
        segments: list[Segment] = []
        done = ""  # the text already turned into segments
        tools = getattr(messages, "tools", None)
        for i, m in enumerate(messages):
            if _role(m, ByteTokenizer.ROLES) != "assistant":
                continue
            prompt, full = self._chat(messages[:i], True, tools), self._chat(messages[: i + 1], False, tools)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise ConfigError(f"tokenizer {self.name}: chat template is not incremental; use prompt/response data")
            segments += [(self.encode(prompt[len(done) :]), False), (self.encode(full[len(prompt) :]), True)]
            done = full
        segments.append((self.encode(self._chat(messages, False, tools)[len(done) :]), False))
        return segments

    def _render_plain(self, messages: Sequence[Message]) -> list[Segment]:
        bos = getattr(self.tok, "bos_token_id", None)
        segments: list[Segment] = [([int(bos)], False)] if bos is not None else []
        for role, text in _turns(messages, ByteTokenizer.ROLES):
            if role == "assistant":
                segments += [(self.encode("assistant: "), False), ([*self.encode(text), self.eos_id], True)]
            else:
                segments.append((self.encode(f"{role}: {text}\n"), False))
        return segments


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test for the tag
OPEN, CLOSE = "\ue000", "\ue001"  # private-use characters around each reply in the marked rendering


def _longest_token(tokenizer: object) -> int:
    """Characters of the longest vocabulary entry: at least the text any token stands for (byte-level BPE
    writes one character a byte, SentencePiece's "▁" is the space it replaces, "<0x0A>" one byte)."""
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=1)  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError, TypeError):  # no vocabulary to read: more than any common token
        return 256


def _template_text(tokenizer: object) -> str:
    """The tokenizer's default chat template ("" without one; a dict of named templates gives its default)."""
    try:
        return str(tokenizer.get_chat_template() or "")  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # no template (transformers raises ValueError)
        return ""


def _unmark(marked: str, count: int) -> tuple[str, list[tuple[int, int]]] | None:
    """The text without markers and each marked (start, end) in it; None unless `count` ordered pairs."""
    pieces, spans, pos, removed = [], [], 0, 0
    for _ in range(count):
        start = marked.find(OPEN, pos)
        end = marked.find(CLOSE, start + 1) if start >= 0 else -1
        if end < 0 or OPEN in marked[start + 1 : end]:
            return None
        pieces += [marked[pos:start], marked[start + 1 : end]]
        spans.append((start - removed, end - removed - 1))
        pos, removed = end + 1, removed + 2
    rest = marked[pos:]
    if OPEN in rest or CLOSE in rest or CLOSE in "".join(pieces):
        return None
    return "".join(pieces) + rest, spans


def _overlap_flags(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per token: do its (start, end) characters overlap a span (spans in order)? The first span ending after the
    token's start (a binary search) holds the token when it starts before the token ends."""
    if not spans:
        return np.zeros(len(offsets), dtype=bool)
    edges = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = np.asarray(spans, dtype=np.int64).T
    k = np.searchsorted(ends, edges[:, 0], side="right")
    inside = k < len(spans)
    return inside & (edges[:, 1] > starts[np.minimum(k, len(spans) - 1)])


def segment_arrays(segments: Sequence[Segment]) -> TokenArrays:
    """Segments as (int64 ids, bool flags)."""
    ids = np.fromiter((t for s, _ in segments for t in s), dtype=np.int64)
    return ids, np.repeat(np.array([t for _, t in segments], dtype=bool), [len(s) for s, _ in segments])


def _runs(ids: Sequence[int], flags: Sequence[bool]) -> list[Segment]:
    """Token ids cut into segments of equal target flag."""
    segments: list[Segment] = []
    for i, (t, f) in enumerate(zip(ids, flags, strict=True)):
        if i and f == segments[-1][1]:
            segments[-1][0].append(int(t))
        else:
            segments.append(([int(t)], f))
    return segments


def _role(message: Message, known: dict[str, int]) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in known or not isinstance(message.get("content"), str):
        raise ValueError(f"each message needs a role in {sorted(known)} and a string content, got {message!r:.80}")
    return str(role)


def _turns(messages: Sequence[Message], known: dict[str, int]) -> list[tuple[str, str]]:
    """(role, text) of each turn as the byte and template-less renderings write it: the chat's tools first, as a
    system turn, and a reply's tool calls after its content."""
    tools = getattr(messages, "tools", None)
    turns = [("system", tools_text(tools))] if tools else []
    for m in messages:
        role = _role(m, known)
        calls = m.get("tool_calls") if role == "assistant" else None
        turns.append((role, m["content"] + "".join(tool_call_text(c) for c in calls or ())))
    return turns


def _tool_parts(messages: Sequence[Message]) -> tuple[Any, bool]:
    """The chat's tools (None: none) and whether a reply calls one."""
    calls = any(isinstance(m, dict) and m.get("tool_calls") for m in messages)
    return getattr(messages, "tools", None), calls


def load_tokenizer(path: str | None, model_vocab: int) -> Tokenizer:
    """The byte tokenizer for presets (`path` None), else `AutoTokenizer.from_pretrained(path)`."""
    if path is None:
        tok = ByteTokenizer()
        if tok.vocab_size > model_vocab:
            raise ConfigError(f"the byte tokenizer needs {tok.vocab_size} ids but the model has {model_vocab}")
        return tok
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path {path!r}: cannot load its tokenizer ({err})") from err
    out = HFTokenizer(hf, path)
    template = f"yes, reply masks from {out.mask_from}" if out.has_template else "no"
    log.info("tokenizer %s: %d ids, chat template %s", path, out.vocab_size, template)
    return out
