"""SFT data: records -> token rows with prompt-masked labels, and the order steps consume them.

Records come from JSONL, JSON, Parquet, a `datasets` directory or a hub id (`runner.data.records`) and are
`{prompt, response}` or `{messages: [{role, content}]}` (field names from the spec; `format: auto`
decides per source from the first record). Each record becomes one row of at most
`max_seq_len` positions: `input_ids` and `labels` already shifted by one (labels[t] is the token
after input_ids[t], nanoGPT's x/y), -100 where there is no loss (prompt, padding). Longer records
are truncated; records left without any target token are dropped (and counted in the log). Text that
truncation would drop is clipped before tokenizing (`clip_texts`): a 200 MB record costs its first
(max_seq_len + 2) x `tokenizer.max_token_chars` characters of tokenizing, not gigabytes of token lists.
The rows are stored flat (runner/data/tokens.py): ~3 bytes a token, not two int64 arrays a record.

Packing (`data.packing: true`): whole records are concatenated in file order into rows of up to
`max_seq_len + 1` tokens; a record that would overflow starts the next row. Masks are kept per record
and every record starts with a non-target token (BOS or its first prompt token), so no loss crosses a
boundary; attention does cross it (no block-diagonal mask), as in nanoGPT and HF's ConstantLengthDataset.

Order: `DataOrder.step_samples(step)` is a pure function of (seed, epoch, step), so a resumed run, or
a step redone at a smaller micro-batch after an OOM, sees exactly the same samples.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec, JobSpec
from runner.data.cache import cache_root
from runner.data.records import EVAL_SPLITS, TRAIN_SPLITS, read_records
from runner.data.tokenizer import Message, Segment, Tokenizer
from runner.data.tokens import IGNORE, Rows, Streams, StreamsBuilder, pack_groups
from runner.data.tokens import Row as Row  # (input_ids, labels), imported from here by the tests

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


def detect_format(record: dict, spec: DataSpec, where: str) -> str:
    if spec.format != "auto":
        return spec.format
    if record.get(spec.messages_field) is not None:
        return "messages"
    if record.get(spec.prompt_field) is not None and record.get(spec.response_field) is not None:
        return "prompt_response"
    raise ConfigError(
        f"{where}: cannot tell the record format: no {spec.messages_field!r} list and no "
        f"{spec.prompt_field!r}/{spec.response_field!r} pair; set data.format and the data.*_field names"
    )


def to_messages(record: dict, fmt: str, spec: DataSpec) -> list[Message]:
    if fmt == "messages":
        messages = as_message_list(record.get(spec.messages_field))
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{spec.messages_field!r} must be a non-empty list of {{role, content}}")
        return messages
    prompt, response = record.get(spec.prompt_field), record.get(spec.response_field)
    for name, value in ((spec.prompt_field, prompt), (spec.response_field, response)):
        if not isinstance(value, str):
            got = "missing" if value is None else f"of type {type(value).__name__}"
            raise ValueError(
                f"{name!r} is {got}: {spec.prompt_field!r} and {spec.response_field!r} must both be strings"
            )
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def as_message_list(value: object) -> object:
    """A dict of equal-length lists ({role: [...], content: [...]}, how `datasets` stores a Sequence
    of dicts) as the list of dicts it stands for; anything else unchanged."""
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
        lengths = {len(v) for v in value.values()}
        if len(lengths) == 1:
            return [dict(zip(value, row, strict=True)) for row in zip(*value.values(), strict=True)]
    return value


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
    return out, longest, max(0, len(messages) - max_messages)


def check_text(messages: list[Message]) -> None:
    """ValueError for a content the tokenizers cannot encode: a lone UTF-16 surrogate, which JSON can
    escape (\\ud800) but UTF-8 cannot hold (transformers' tokenizers fail on it with a TypeError)."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str) and not content.isascii():
            try:
                content.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(
                    f"message {i}: a lone UTF-16 surrogate ({content[err.start]!r} at character {err.start}) in "
                    "its text; write the character itself, or its full \\ud83d\\ude00-style pair"
                ) from None


def flatten(segments: Sequence[Segment], limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and target flags of a rendered chat, truncated to `limit` tokens."""
    ids = np.fromiter(itertools.islice(itertools.chain.from_iterable(s for s, _ in segments), limit), np.int64)
    flags = np.repeat(np.array([t for _, t in segments], dtype=bool), [len(s) for s, _ in segments])[:limit]
    return ids, flags


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
) -> Streams:
    """Every record of `source` as (token ids, target flags), truncated to max_seq_len + 1 tokens; `cache_dir`: where
    the tokenized records are cached for every rank and restart (runner/data/cache.py), None: not cached."""
    fmt, out = None, StreamsBuilder(tokenizer.vocab_size)
    reach = spec.max_seq_len + 2  # tokens (and so messages) past what a row keeps, with one to spare
    chars = reach * tokenizer.max_token_chars
    clipped, longest, dropped = 0, 0, 0
    for where, record in read_records(source, spec, field, splits):
        fmt = fmt or detect_format(record, spec, str(where))
        try:
            messages, cut, beyond = clip_texts(to_messages(record, fmt, spec), chars, reach)
            check_text(messages)
            segments = tokenizer.render(messages)
        except ValueError as err:
            raise ConfigError(f"{where}: {err} (format {fmt})") from None
        if cut or beyond:
            clipped, longest, dropped = clipped + 1, max(longest, cut), max(dropped, beyond)
        out.add(*flatten(segments, spec.max_seq_len + 1))
    if not len(out):
        raise ConfigError(f"{field} {source}: no records (expected prompt/response or messages records)")
    if clipped:
        log.info(
            "data %s: %d record(s) clipped before tokenizing to what max_seq_len %d can reach: texts to %d characters "
            "(longest %d), chats to %d messages (at most %d dropped); %d characters a token at most",
            source, clipped, spec.max_seq_len, chars, longest, reach, dropped, tokenizer.max_token_chars,
        )  # fmt: skip
    log.info("data %s: %d records, format %s", source, len(out), fmt)
    return out.build()


class SFTData:
    """Tokenized train and eval rows, held in memory; `collate` builds a micro-batch from row ids."""

    def __init__(self, train: Rows, eval_rows: Rows, pad_id: int, max_seq_len: int):
        self.train, self.eval, self.pad_id, self.max_seq_len = train, eval_rows, pad_id, max_seq_len

    @property
    def longest(self) -> int:
        return int(self.train.lengths.max()) if len(self.train) else 0

    def collate(self, ids: Sequence[int], split: str = "train") -> Batch:
        rows = [(self.train if split == "train" else self.eval)[i] for i in ids]
        width = max(len(x) for x, _ in rows)
        width = min(-(-width // PAD_MULTIPLE) * PAD_MULTIPLE, self.max_seq_len)
        x = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        y = np.full((len(rows), width), IGNORE, dtype=np.int64)
        for r, (xi, yi) in enumerate(rows):
            x[r, : len(xi)], y[r, : len(yi)] = xi, yi
        tokens = sum(len(xi) for xi, _ in rows)
        return Batch(torch.from_numpy(x), torch.from_numpy(y), int((y != IGNORE).sum()), tokens, tuple(ids))


def _rows(streams: Streams, which: np.ndarray, spec: DataSpec, what: str) -> Rows:
    """Rows of the records `which` (indices, in order) that have a target within max_seq_len."""
    kept = which[streams.trainable[which]]
    if len(kept) < len(which):
        log.info(
            "%s: dropped %d of %d records with no response token within max_seq_len %d",
            what,
            len(which) - len(kept),
            len(which),
            spec.max_seq_len,
        )
    if not spec.packing:
        return Rows(streams, kept, np.arange(len(kept) + 1))
    rows = pack(streams, spec.max_seq_len, kept)
    log.info("%s: packed %d records into %d rows of <= %d tokens", what, len(kept), len(rows), spec.max_seq_len)
    return rows


def load_data(spec: JobSpec, tokenizer: Tokenizer) -> SFTData:
    """Train rows and eval rows (from `data.eval_path`, or `eval_fraction` of the file held out by seed)."""
    d, cache = spec.data, cache_root(spec)
    data = encode_file(d.path or BUNDLED, d, tokenizer, cache_dir=cache)
    if d.eval_path:  # a DatasetDict gives its validation (else test) split here
        held_out = encode_file(d.eval_path, d, tokenizer, "data.eval_path", EVAL_SPLITS, cache_dir=cache)
        train, held = np.arange(len(data)), np.arange(len(held_out))
    else:  # the held-out records are a seeded random subset, the same on every rank and every restart
        n_eval = int(len(data) * d.eval_fraction)
        is_held = np.zeros(len(data), dtype=bool)
        is_held[np.random.default_rng([spec.training.seed, 0x5EED]).permutation(len(data))[:n_eval]] = True
        held_out, train, held = data, np.flatnonzero(~is_held), np.flatnonzero(is_held)
    train_rows = _rows(data, train, d, "train")  # indices into one store: the eval rows copy nothing
    return SFTData(train_rows, _rows(held_out, held, d, "eval"), tokenizer.pad_id, d.max_seq_len)


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


def rank_slice(ids: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a step's ids (global_batch divides evenly over ranks)."""
    per_rank = len(ids) // world_size
    return list(ids[rank * per_rank : (rank + 1) * per_rank])


def micro_batches(ids: Sequence[int], micro_batch: int) -> list[list[int]]:
    """`ids` cut in order into chunks of `micro_batch` (the last may be shorter if it does not divide)."""
    return [list(ids[i : i + micro_batch]) for i in range(0, len(ids), micro_batch)]


def total_steps(spec: JobSpec, order: DataOrder) -> int:
    """`training.steps`, or `epochs` (default 1) x steps per epoch, rounded up."""
    if spec.training.steps is not None:
        return spec.training.steps
    return max(1, int(np.ceil((spec.training.epochs or 1.0) * order.steps_per_epoch)))
