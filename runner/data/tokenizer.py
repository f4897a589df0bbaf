"""Tokenizers: a byte-level one for the presets (nothing to download) and transformers' for `model.path`.

Both render a chat (a list of {role, content}) as segments `(token ids, is_target)`; the loss is
taken on target segments only (the assistant's replies and their end-of-turn token), so prompt
tokens get label -100 downstream. Prompt/response records are a two-message chat (user, assistant).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from jobspec.errors import ConfigError

log = logging.getLogger("jobspec.runner")
Segment = tuple[list[int], bool]  # (token ids, is_target)
Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    pad_id: int
    eos_id: int

    def render(self, messages: Sequence[Message]) -> list[Segment]: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; specials follow. No merges, no vocabulary file.

    Chat template (one special token per role, so no text can fake a turn):
        <bos> {<system>|<user> content-bytes}... <assistant> reply-bytes <eos> ...
    Targets: each assistant reply's bytes and its <eos>; everything else is prompt.
    """

    PAD, BOS, EOS, SYSTEM, USER, ASSISTANT = range(256, 262)
    ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
    name = "bytes"
    vocab_size = 262  # every preset's vocabulary (>= 512) holds it; the rows above stay unused
    pad_id = PAD
    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    # Special tokens as text, in id order (256...), for the exported Hugging Face tokenizer.
    SPECIAL_TEXT = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")
    CHAT_TEMPLATE = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "<|assistant|>{{ m['content'] }}{{ eos_token }}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )

    def render(self, messages: Sequence[Message]) -> list[Segment]:
        segments: list[Segment] = [([self.BOS], False)]
        for m in messages:
            role = _role(m, self.ROLES)
            if role == "assistant":
                segments += [([self.ASSISTANT], False), ([*self.encode(m["content"]), self.EOS], True)]
            else:
                segments.append(([self.ROLES[role], *self.encode(m["content"])], False))
        return segments


    def to_hf(self) -> object:
        """The same tokenizer as a transformers `PreTrainedTokenizerFast` (what an export ships).

        A byte-level BPE with no merges over GPT-2's byte-to-character table gives id b to byte b; the
        specials are added tokens 256-261 and the chat template renders exactly `render`'s ids (checked in
        tests/runner/test_export.py). Text that spells a special token (`<|user|>`) is that token in the
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

    With a template, each assistant reply is found by rendering the chat up to it twice (with and
    without the reply) and diffing the text, so any template works without offsets. Without one,
    a plain template: `role: content\\n` per message, the reply after `assistant: `, then EOS.
    """

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
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False)) if text else []  # type: ignore[attr-defined]

    def _chat(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return str(
            self.tok.apply_chat_template(  # type: ignore[attr-defined]
                list(messages), tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def render(self, messages: Sequence[Message]) -> list[Segment]:
        if not self.has_template:
            return self._render_plain(messages)
        segments: list[Segment] = []
        done = ""  # the text already turned into segments
        for i, m in enumerate(messages):
            if _role(m, ByteTokenizer.ROLES) != "assistant":
                continue
            prompt, full = self._chat(messages[:i], True), self._chat(messages[: i + 1], False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise ConfigError(f"tokenizer {self.name}: chat template is not incremental; use prompt/response data")
            segments += [(self.encode(prompt[len(done) :]), False), (self.encode(full[len(prompt) :]), True)]
            done = full
        segments.append((self.encode(self._chat(messages, False)[len(done) :]), False))
        return segments

    def _render_plain(self, messages: Sequence[Message]) -> list[Segment]:
        bos = getattr(self.tok, "bos_token_id", None)
        segments: list[Segment] = [([int(bos)], False)] if bos is not None else []
        for m in messages:
            role = _role(m, ByteTokenizer.ROLES)
            if role == "assistant":
                segments += [(self.encode("assistant: "), False), ([*self.encode(m["content"]), self.eos_id], True)]
            else:
                segments.append((self.encode(f"{role}: {m['content']}\n"), False))
        return segments


def _role(message: Message, known: dict[str, int]) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in known or not isinstance(message.get("content"), str):
        raise ValueError(f"each message needs a role in {sorted(known)} and a string content, got {message!r:.80}")
    return str(role)


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
    log.info("tokenizer %s: %d ids, chat template %s", path, out.vocab_size, "yes" if out.has_template else "no")
    return out
