"""SFT data: records -> token rows with prompt-masked labels, and the order steps consume them.

Records come from JSONL, JSON, Parquet, a `datasets` directory or a hub id (`runner.data.records`) and are
`{prompt, response}` or `{messages: [{role, content}]}` (field names from the spec; `format: auto`
decides per source from the first record). Each record becomes one row of at most
`max_seq_len` positions: `input_ids` and `labels` already shifted by one (labels[t] is the token
after input_ids[t], nanoGPT's x/y), -100 where there is no loss (prompt, padding). Longer chats
are truncated; records left without any target token are dropped (and counted in the log). Text that
truncation would drop is clipped before tokenizing (`clip_texts`): a 200 MB record costs its first
(max_seq_len + 2) x `tokenizer.max_token_chars` characters of tokenizing, not gigabytes of token lists.
A raw-text document (`format: text`) is never truncated: it is stored whole and, when longer than a row, cut into
blocks of max_seq_len + 1 tokens when loaded, consecutive blocks sharing `data.text_overlap` tokens of context that
only the first scores (`text_blocks`): every token of the document is a target exactly once. Train and eval are
split by document before that, so no document has blocks on both sides.
The rows are stored flat (runner/data/tokens.py): ~3 bytes a token, not two int64 arrays a record.

Packing (`data.packing: true`): whole records are concatenated in file order into rows of up to
`max_seq_len + 1` tokens; a record that would overflow starts the next row. Masks are kept per record
and a record's first token is never a target (`Rows`), so no loss crosses a boundary. A packed batch carries
position ids that restart at 0 at each record (`Batch.position_ids`); with them the model confines attention
to each record (a block-diagonal causal mask, or varlen flash-attention: runner/model/packing.py), so every
record's logits are those it has alone. Packing stays on only where a startup check shows this holds.

Order: `DataOrder.step_samples(step)` is a pure function of (seed, epoch, step), so a resumed run, or
a step redone at a smaller micro-batch after an OOM, sees exactly the same samples. Several sources
(`data.sources`) are encoded and packed each on its own (no row joins two sources), their rows end to end in
one id space, mixed by weight by `MixedOrder` (runner/data/mix.py); one source keeps `DataOrder`.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec, JobSpec
from runner.data.cache import CacheKey, cache_key, cached_streams, usable_root
from runner.data.mix import ConcatRows, MixedOrder, source_names
from runner.data.pairs import CHOSEN, REJECTED, check_objective, pair_chats
from runner.data.prepare import CHUNK_RECORDS, Chat, ChunkRenderer, render_chunk
from runner.data.records import EVAL_SPLITS, TRAIN_SPLITS, as_message_list, read_records
from runner.data.tokenizer import Message, Segment, Tokenizer, segment_arrays
from runner.data.tokens import IGNORE, Blocks, Rows, Streams, StreamsBuilder, pack_groups, record_positions
from runner.data.tokens import Row as Row  # (input_ids, labels), imported from here by the tests
from runner.data.tools import TOOLS_FIELD, ToolChat, with_tools

log = logging.getLogger("jobspec.runner")
BUNDLED = Path(__file__).with_name("sft_synthetic.jsonl")
PAD_MULTIPLE = 8  # pad each micro-batch to a multiple of 8 positions (tensor-core friendly shapes)


@dataclass(frozen=True)
class Batch:
    """One micro-batch, padded on the right to its longest row (rounded up to PAD_MULTIPLE)."""

    input_ids: torch.Tensor  # (B, T) int64
    labels: torch.Tensor  # (B, T) int64, IGNORE where no loss
    targets: int  # positions with a loss
    tokens: int  # real (non-padding) positions
    sample_ids: tuple[int, ...]
    # (B, T) int64, restarting at 0 at each record of a packed row (padding goes on counting from the last one);
    # None for rows of one record each: the model numbers them itself, exactly as without packing
    position_ids: torch.Tensor | None = None
    # a preference batch: its rows are the B chosen then the B rejected chats of B pairs (runner/data/preference.py)
    pairs: bool = False
    # (B, 2) float64: a DPO batch's reference log-probs (chosen, rejected) per pair; None: none (SFT, SimPO, ORPO)
    reference: torch.Tensor | None = None
    # (B, T) int64: every next token of a preference batch's B chosen chats, prompt included, IGNORE at padding
    # (ORPO's NLL term, as TRL's ORPOTrainer scores it); None: an SFT batch
    chosen_labels: torch.Tensor | None = None


def detect_format(record: dict, spec: DataSpec, where: str) -> str:
    if spec.format != "auto":
        return spec.format
    if record.get(CHOSEN) is not None and record.get(REJECTED) is not None:
        return "preference"
    if record.get(spec.messages_field) is not None:
        return "messages"
    if record.get(spec.prompt_field) is not None and record.get(spec.response_field) is not None:
        return "prompt_response"
    if record.get(spec.text_field) is not None:
        return "text"
    raise ConfigError(
        f"{where}: cannot tell the record format: no {spec.messages_field!r} list, no "
        f"{spec.prompt_field!r}/{spec.response_field!r} pair and no {spec.text_field!r} text; set data.format and "
        "the data.*_field names"
    )


def to_messages(record: dict, fmt: str, spec: DataSpec) -> list[Message]:
    if fmt == "messages":
        messages = as_message_list(record.get(spec.messages_field))
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{spec.messages_field!r} must be a non-empty list of {{role, content}}")
        return with_tools(messages, record)  # a tool-calling chat: runner/data/tools.py
    prompt, response = record.get(spec.prompt_field), record.get(spec.response_field)
    for name, value in ((spec.prompt_field, prompt), (spec.response_field, response)):
        if not isinstance(value, str):
            got = "missing" if value is None else f"of type {type(value).__name__}"
            raise ValueError(
                f"{name!r} is {got}: {spec.prompt_field!r} and {spec.response_field!r} must both be strings"
            )
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def clip_texts(messages: list[Message], chars: int, max_messages: int) -> tuple[list[Message], int, int]:
    """The first `max_messages` messages, their contents cut once `chars` characters of content came before;
    with the length of the longest content cut and the number of messages dropped (0, 0: nothing was).

    Tokens come out in message order, none covers more than `tokenizer.max_token_chars` characters and
    every message renders at least one (its role's marker), so with `chars` = (max_seq_len + 2) x that
    many characters and `max_messages` = max_seq_len + 2 what is cut lies past the max_seq_len + 1 tokens
    a row keeps: truncated anyway. (A normalizer that deletes text, such as T5's whitespace folding, or a
    template that renders a message as nothing could let a row keep a little more of the uncut record.)
    The record itself is left as it is.
    """
    out, left, longest = [], chars, 0
    for m in messages[:max_messages]:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            if len(content) > left:
                m, longest = {**m, "content": content[:left]}, max(longest, len(content))
            left = max(0, left - len(content))
        out.append(m)
    kept = messages.like(out) if isinstance(messages, ToolChat) else out  # a tool chat keeps its tools
    return kept, longest, max(0, len(messages) - max_messages)


def check_text(messages: list[Message]) -> None:
    """ValueError for a content the tokenizers cannot encode: a lone UTF-16 surrogate, which JSON can
    escape (\\ud800) but UTF-8 cannot hold (transformers' tokenizers fail on it with a TypeError)."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            check_string(content, f"message {i}")
        if isinstance(m, dict) and m.get("tool_calls"):  # normalized by runner/data/tools.py: JSON-able
            check_string(json.dumps(m["tool_calls"], ensure_ascii=False), f"message {i} tool_calls")
    if getattr(messages, "tools", None):
        check_string(json.dumps(messages.tools, ensure_ascii=False), repr(TOOLS_FIELD))  # type: ignore[attr-defined]


def check_string(content: str, what: str) -> None:
    """`check_text` for one string (`what` names it in the error)."""
    if not content.isascii():
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"{what}: a lone UTF-16 surrogate ({content[err.start]!r} at character {err.start}) in "
                "its text; write the character itself, or its full \\ud83d\\ude00-style pair"
            ) from None


def record_text(record: dict, spec: DataSpec) -> str:
    """A text record's document, whole (a document longer than a row is cut into blocks when loaded, none of its
    tokens dropped: runner/data/tokens.py `Blocks`); ValueError naming the field when it is not a string."""
    text = record.get(spec.text_field)
    if not isinstance(text, str):
        got = "missing" if text is None else f"of type {type(text).__name__}"
        raise ValueError(f"{spec.text_field!r} is {got}: a text record's {spec.text_field!r} must be a string")
    check_string(text, repr(spec.text_field))
    return text


def flatten(segments: Sequence[Segment], limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and target flags of a rendered chat, truncated to `limit` tokens."""
    ids, flags = segment_arrays(segments)
    return ids[:limit], flags[:limit]


def record_chat(record: dict, fmt: str, spec: DataSpec, chars: int, reach: int,
                where: object) -> tuple[Chat, int, int]:  # fmt: skip
    """A record as the chat the tokenizer renders, clipped to what a row can reach (`clip_texts`) and checked
    (`check_text`); a bad one is a ConfigError at `where` (file:line or row)."""
    check_objective(fmt, False, where)
    return record_chats(record, fmt, spec, chars, reach, where)[0]


def record_chats(record: dict, fmt: str, spec: DataSpec, chars: int, reach: int,
                 where: object) -> list[tuple[Chat, int, int]]:  # fmt: skip
    """`record_chat` for every chat of a record: one, or a preference pair's chosen then rejected chat
    (runner/data/pairs.py); a text record's document is a string (rendered as raw text: runner/data/prepare.py)."""
    try:
        if fmt == "text":
            return [(record_text(record, spec), 0, 0)]
        if fmt == "preference":
            chats = [with_tools(chat, record) for chat in pair_chats(record, spec)]
        else:
            chats = [to_messages(record, fmt, spec)]
        out = [clip_texts(chat, chars, reach) for chat in chats]
        for messages, _, _ in out:
            check_text(messages)
    except ValueError as err:
        raise ConfigError(f"{where}: {err} (format {fmt})") from None
    return out


def pack(streams: Streams, max_seq_len: int, records: np.ndarray | None = None) -> Rows:
    """Greedy first-fit in order: rows of up to max_seq_len + 1 tokens (see the module docstring)."""
    records = np.arange(len(streams)) if records is None else records
    return Rows(streams, records, pack_groups(streams.lengths[records], max_seq_len))


def encode_file(
    source: str | Path,
    spec: DataSpec,
    tokenizer: Tokenizer,
    field: str = "data.path",
    splits: Sequence[str] = TRAIN_SPLITS,
    *,
    cache_dir: Path | None = None,
    pairs: bool = False,
) -> Streams:
    """Every record of `source` as (token ids, target flags), truncated to max_seq_len + 1 tokens; `cache_dir`: where
    the tokenized records are cached for every rank and restart (runner/data/cache.py), None: not cached. `pairs`:
    the source must hold preference pairs, each two records (chosen, rejected: runner/data/pairs.py); else none."""
    return encode_keyed(source, spec, tokenizer, field, splits, cache_dir=cache_dir, pairs=pairs)[0]


def encode_keyed(source: str | Path, spec: DataSpec, tokenizer: Tokenizer, field: str = "data.path",
                 splits: Sequence[str] = TRAIN_SPLITS, *, cache_dir: Path | None = None,
                 pairs: bool = False) -> tuple[Streams, CacheKey | None]:  # fmt: skip
    """`encode_file`, with the cache key of its entry (None: not cached), which what is derived from these records
    and cached beside them (DPO's reference log-probs) extends."""
    key = None if cache_dir is None else cache_key(source, spec, tokenizer, field, splits, stamps=Path(cache_dir),
                                                    pairs=pairs)
    if key is None:  # the reason is logged
        return _tokenize(source, spec, tokenizer, field, splits, pairs), None
    build = partial(_tokenize, source, spec, tokenizer, field, splits, pairs)
    return cached_streams(Path(cache_dir), key, build), key


def _tokenize(source: str | Path, spec: DataSpec, tokenizer: Tokenizer, field: str, splits: Sequence[str],
              pairs: bool = False) -> Streams:  # fmt: skip
    """`encode_file` without the cache: the records read and checked here, rendered in chunks of CHUNK_RECORDS
    (runner/data/prepare.py: over worker processes once the source shows itself large), joined in file order."""
    fmt, out = None, StreamsBuilder(tokenizer.vocab_size)
    reach = spec.max_seq_len + 2  # tokens (and so messages) past what a row keeps, with one to spare
    chars = reach * tokenizer.max_token_chars
    clipped, longest, dropped = 0, 0, 0
    chats: list[Chat] = []
    places: list[object] = []  # where each chat of the chunk is, for an error
    with ChunkRenderer(tokenizer, spec.max_seq_len + 1) as renderer:

        def collect(drain: bool = False) -> None:
            for tag, chunk in renderer.ready(drain):
                if isinstance(chunk, ValueError):
                    _locate(tag, tokenizer, chunk, fmt)
                ids, flags, lengths = chunk
                for a, b in itertools.pairwise(np.concatenate(([0], np.cumsum(lengths))).tolist()):
                    out.add(ids[a:b], flags[a:b])

        for where, record in read_records(source, spec, field, splits):
            fmt = fmt or detect_format(record, spec, str(where))
            check_objective(fmt, pairs, where)
            for messages, cut, beyond in record_chats(record, fmt, spec, chars, reach, where):
                if cut or beyond:
                    clipped, longest, dropped = clipped + 1, max(longest, cut), max(dropped, beyond)
                chats.append(messages)
                places.append(where)
            if len(chats) >= CHUNK_RECORDS:
                renderer.put(chats, (places, chats))
                chats, places = [], []
                collect()
        if chats:
            renderer.put(chats, (places, chats))
        collect(drain=True)
    if not len(out):
        raise ConfigError(f"{field} {source}: no records (expected prompt/response, messages or text records)")
    if clipped:
        log.info(
            "data %s: %d record(s) clipped before tokenizing to what max_seq_len %d can reach: texts to %d characters "
            "(longest %d), chats to %d messages (at most %d dropped); %d characters a token at most",
            source, clipped, spec.max_seq_len, chars, longest, reach, dropped, tokenizer.max_token_chars,
        )  # fmt: skip
    log.info("data %s: %d records, format %s", source, len(out), fmt)
    return out.build()


def _locate(tag: object, tokenizer: Tokenizer, err: ValueError, fmt: str | None) -> NoReturn:
    """The ConfigError for a chunk the tokenizer refused, naming the first record it refuses alone."""
    places, chats = tag  # type: ignore[misc]  # as `_tokenize` put them
    for where, messages in zip(places, chats, strict=True):
        try:
            render_chunk(tokenizer, [messages], 1)
        except ValueError as one:
            raise ConfigError(f"{where}: {one} (format {fmt})") from None
    raise ConfigError(f"{places[0]} and the {len(places) - 1} records after it: {err} (format {fmt})") from None


def pad_rows(rows: Sequence[Row], pad_id: int, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of a micro-batch: the rows padded on the right to the longest, rounded up to
    PAD_MULTIPLE (at most max_seq_len), with `pad_id` and IGNORE."""
    width = min(-(-max(len(x) for x, _ in rows) // PAD_MULTIPLE) * PAD_MULTIPLE, max_seq_len)
    x = np.full((len(rows), width), pad_id, dtype=np.int64)
    y = np.full((len(rows), width), IGNORE, dtype=np.int64)
    for r, (xi, yi) in enumerate(rows):
        x[r, : len(xi)], y[r, : len(yi)] = xi, yi
    return x, y


def make_batch(x: np.ndarray, y: np.ndarray, rows: Sequence[Row], ids: Sequence[int],
               positions: torch.Tensor | None) -> Batch:  # fmt: skip
    tokens = sum(len(xi) for xi, _ in rows)
    return Batch(torch.from_numpy(x), torch.from_numpy(y), int((y != IGNORE).sum()), tokens, tuple(ids), positions)


class SFTData:
    """Tokenized train and eval rows, held in memory; `collate` builds a micro-batch from row ids."""

    def __init__(self, train: Rows | ConcatRows, eval_rows: Rows | ConcatRows, pad_id: int, max_seq_len: int,
                 sources: Sequence[str] = ("data",)):  # fmt: skip
        self.train, self.eval, self.pad_id, self.max_seq_len = train, eval_rows, pad_id, max_seq_len
        self.sources = tuple(sources)  # the training sources' names, in spec order
        # Train ids of source s: [offsets[s], offsets[s+1]) (ConcatRows); one source owns them all.
        self.offsets: np.ndarray = getattr(train, "offsets", np.array([0, len(train)], dtype=np.int64))

    def eval_order(self) -> list[int]:
        """The eval row ids in the order evaluation takes them (`training.eval_batches` micro-batches from the front
        of each rank's share): held out of several sources, one row of each source in turn, so that a small eval
        budget measures every source, not the first one only; otherwise in their order."""
        offsets = getattr(self.eval, "offsets", None)
        if offsets is None or len(offsets) <= 2:
            return list(range(len(self.eval)))
        sizes = np.diff(offsets)
        turn = np.concatenate([np.arange(n) for n in sizes])  # each row's place within its source
        source = np.repeat(np.arange(len(sizes)), sizes)
        return (offsets[source] + turn)[np.lexsort((source, turn))].tolist()

    def source_counts(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """How many of the train row `ids` come from each source."""
        src = np.searchsorted(self.offsets, np.asarray(ids, dtype=np.int64), side="right") - 1
        return np.bincount(src, minlength=len(self.sources))

    @property
    def longest(self) -> int:
        return int(self.train.lengths.max()) if len(self.train) else 0

    def collate(self, ids: Sequence[int], split: str = "train") -> Batch:
        rows = [(self.train if split == "train" else self.eval)[i] for i in ids]
        x, y = pad_rows(rows, self.pad_id, self.max_seq_len)
        positions = self._positions(ids, split, x.shape[1])
        return make_batch(x, y, rows, ids, positions)

    def _positions(self, ids: Sequence[int], split: str, width: int) -> torch.Tensor | None:
        """(B, width) position ids of packed rows (`Rows.positions`, padding counted on); None when no row of
        `split` holds several records (the model then numbers each row itself, as without packing)."""
        rows = self.train if split == "train" else self.eval
        if not rows.packed:  # Rows, or ConcatRows of several sources (runner/data/mix.py)
            return None
        out = np.empty((len(ids), width), dtype=np.int64)
        for r, i in enumerate(ids):
            part, k = rows.locate(i) if hasattr(rows, "locate") else (rows, i)
            out[r] = record_positions(part.record_lengths(k), width)
        return torch.from_numpy(out)


def _rows(streams: Streams, which: np.ndarray, spec: DataSpec, what: str) -> Rows:
    """Rows of the records `which` (indices, in order) that have a target within max_seq_len; raw-text documents
    longer than a row (only they are stored longer) cut into blocks first (`text_blocks`)."""
    kept = which[streams.trainable[which]]
    if len(kept) < len(which):
        log.info(
            "%s: dropped %d of %d records with no response token within max_seq_len %d",
            what,
            len(which) - len(kept),
            len(which),
            spec.max_seq_len,
        )
    store: Streams | Blocks = text_blocks(streams, kept, spec, what)
    if store is not streams:
        kept = np.arange(len(store))
    if not spec.packing:
        return Rows(store, kept, np.arange(len(kept) + 1))
    rows = Rows(store, kept, pack_groups(store.lengths[kept], spec.max_seq_len))
    log.info("%s: packed %d records into %d rows of <= %d tokens", what, len(kept), len(rows), spec.max_seq_len)
    return rows


def text_blocks(streams: Streams, kept: np.ndarray, spec: DataSpec, what: str) -> Streams | Blocks:
    """`streams` itself when every record of `kept` fits a row; else `kept` cut into blocks of max_seq_len + 1 tokens
    at most, consecutive blocks sharing `data.text_overlap` tokens of context (runner/data/tokens.py `Blocks`). Only
    raw-text documents are stored longer than a row (chats are truncated when tokenized)."""
    lengths = streams.lengths[kept]
    if not len(kept) or int(lengths.max()) <= spec.max_seq_len + 1:
        return streams
    blocks = Blocks(streams, kept, spec.max_seq_len, spec.text_overlap)
    log.info(
        "%s: %d of %d documents longer than max_seq_len %d cut into blocks (%d tokens of overlap): %d blocks, every "
        "token trained on", what, int((lengths > spec.max_seq_len + 1).sum()), len(kept), spec.max_seq_len,
        spec.text_overlap, len(blocks),
    )  # fmt: skip
    return blocks


def load_data(spec: JobSpec, tokenizer: Tokenizer) -> SFTData:
    """Train rows of every source (`data.sources`, or `data.path` as one) and eval rows: `data.eval_path`, or
    `eval_fraction` of each source held out by seed."""
    d, cache = spec.data, usable_root(spec)
    sources, several = d.train_sources(str(BUNDLED)), d.sources is not None and len(d.sources) > 1
    names, fraction = source_names(sources), 0.0 if d.eval_path else d.eval_fraction
    train_parts, eval_parts = [], []
    for i, (source, name) in enumerate(zip(sources, names, strict=True)):
        field = "data.path" if d.sources is None else f"data.sources[{i}].path"
        fmt = d if source.format is None else d.model_copy(update={"format": source.format})
        data = encode_file(source.path, fmt, tokenizer, field, cache_dir=cache)
        # One source keeps the seed it always had: the same rows held out as before sources existed.
        train, held = _split(len(data), fraction, [spec.training.seed, 0x5EED, *([i] if several else [])])
        what = f" {name}" if several else ""
        train_parts.append(_rows(data, train, d, f"train{what}"))  # indices into one store: the eval rows copy nothing
        if not d.eval_path:
            eval_parts.append(_rows(data, held, d, f"eval{what}"))
        if several and not len(train_parts[-1]):
            raise ConfigError(f"{field} {source.path}: no training rows left (every record held out or dropped)")
    if d.eval_path:  # a DatasetDict gives its validation (else test) split here
        held_out = encode_file(d.eval_path, d, tokenizer, "data.eval_path", EVAL_SPLITS, cache_dir=cache)
        eval_parts = [_rows(held_out, np.arange(len(held_out)), d, "eval")]
    if not several:
        return SFTData(train_parts[0], eval_parts[0], tokenizer.pad_id, d.max_seq_len, names)
    train_rows, eval_rows = ConcatRows(train_parts), ConcatRows(eval_parts) if len(eval_parts) > 1 else eval_parts[0]
    weights = np.array([s.weight for s in sources]) / sum(s.weight for s in sources)
    log.info("data: %d sources mixed by weight: %s", len(sources), ", ".join(
        f"{n} {w:.1%} ({len(p):,} rows)" for n, w, p in zip(names, weights, train_parts, strict=True)))  # fmt: skip
    return SFTData(train_rows, eval_rows, tokenizer.pad_id, d.max_seq_len, names)


def _split(n: int, fraction: float, seed: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) record indices: `fraction` of the n records held out, a seeded random subset, the same
    on every rank and every restart."""
    is_held = np.zeros(n, dtype=bool)
    if int(n * fraction):
        is_held[np.random.default_rng(seed).permutation(n)[: int(n * fraction)]] = True
    return np.flatnonzero(~is_held), np.flatnonzero(is_held)


class DataOrder:
    """Which rows optimizer step `step` consumes: a pure function of (seed, epoch, step).

    Epoch e is a permutation of all rows drawn by numpy's PCG64 seeded with (seed, e); step s takes
    the slice [p*G, (p+1)*G) of it, p = s mod steps_per_epoch, G = global_batch. An epoch's last
    partial batch is dropped, so every step sees exactly G rows.
    """

    def __init__(self, num_rows: int, global_batch: int, seed: int):
        if num_rows < global_batch:
            raise ConfigError(
                f"training.global_batch {global_batch} is larger than the {num_rows} training rows; "
                "lower it or add data"
            )
        self.num_rows, self.global_batch, self.seed = num_rows, global_batch, seed
        self.steps_per_epoch = num_rows // global_batch
        self._perm: tuple[int, np.ndarray] | None = None  # (epoch, permutation) of the last epoch used

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def step_samples(self, step: int) -> list[int]:
        """The global_batch row ids of optimizer step `step` (0-based), in rank order."""
        epoch = self.epoch(step)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_rows))
        p = step % self.steps_per_epoch
        return self._perm[1][p * self.global_batch : (p + 1) * self.global_batch].tolist()

    def step_counts(self, step: int) -> np.ndarray:
        """Samples of each source in step `step`: one source, all of them (`MixedOrder.step_counts`)."""
        return np.array([self.global_batch], dtype=np.int64)


class RepeatedOrder:
    """An order whose every step is trained `times` steps in a row: GRPO's `num_iterations` (TRL's RepeatSampler, a
    batch of prompts sampled once and optimized on `times` times). Step s takes step s // times of `order`; an epoch
    is `times` times as many steps."""

    def __init__(self, order: DataOrder, times: int):
        self.order, self.times = order, times
        self.num_rows, self.global_batch = order.num_rows, order.global_batch
        self.steps_per_epoch = order.steps_per_epoch * times

    def epoch(self, step: int) -> int:
        return self.order.epoch(step // self.times)

    def step_samples(self, step: int) -> list[int]:
        return self.order.step_samples(step // self.times)

    def step_counts(self, step: int) -> np.ndarray:
        return self.order.step_counts(step // self.times)


def rank_slice(ids: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a step's ids (global_batch divides evenly over ranks)."""
    per_rank = len(ids) // world_size
    return list(ids[rank * per_rank : (rank + 1) * per_rank])


def micro_batches(ids: Sequence[int], micro_batch: int) -> list[list[int]]:
    """`ids` cut in order into chunks of `micro_batch` (the last may be shorter if it does not divide)."""
    return [list(ids[i : i + micro_batch]) for i in range(0, len(ids), micro_batch)]


def data_order(spec: JobSpec, data: SFTData) -> DataOrder | MixedOrder:
    """The order steps consume the train rows: `DataOrder` for one source (the ids it always gave), `MixedOrder`
    for several, drawn by `data.sources[i].weight`."""
    t, sizes = spec.training, np.diff(data.offsets).tolist()
    if len(sizes) == 1:
        return DataOrder(sizes[0], t.global_batch, t.seed)
    weights = [s.weight for s in spec.data.train_sources(str(BUNDLED))]
    return MixedOrder(sizes, weights, t.global_batch, t.seed)


def total_steps(spec: JobSpec, order: DataOrder | MixedOrder | RepeatedOrder) -> int:
    """`training.steps`, or `epochs` (default 1) x steps per epoch, rounded up; with several sources an epoch
    is the sum of all sources' training rows (each source's own passes follow its weight)."""
    if spec.training.steps is not None:
        return spec.training.steps
    return max(1, int(np.ceil((spec.training.epochs or 1.0) * order.steps_per_epoch)))
