"""The tokenized data set stored flat: a few arrays for all records, not an array pair per record.

Record k's token ids are `ids[bounds[k]:bounds[k+1]]` and its target flags the same slice of `flags`.
Ids take the smallest dtype that holds the vocabulary (uint16 up to 65,536 ids, else int32): about 3
bytes a token and 8 a record, where a list of two int64 arrays per record took ~1 KB for 100 tokens
(numpy's ~100-byte header per array, 8-byte ids), twice over once shifted into rows: 8 GB for the 2M
short records of one Parquet row group. Flat arrays also stay shared with forked DataLoader workers,
where a list of small arrays is copied page by page as their reference counts change.

`Rows` are record indices into that store (or into its `Blocks`: a long raw-text document cut into rows, none of its
tokens dropped), one record a row or several packed, made into the
(input_ids, labels) int64 pair of a training row when one is read; `Rows.positions(r)` gives a packed row's
position ids, restarting at 0 at each record, from the record bounds alone.
"""

from __future__ import annotations

import array
import operator
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from jobspec.errors import ConfigError

IGNORE = -100  # label of positions without loss (torch cross_entropy's ignore_index)
Row = tuple[np.ndarray, np.ndarray]  # (input_ids, labels): int64 arrays of the same length


class Streams:
    """Token ids and target flags of many records, flat; `streams[k]` is record k as (int64 ids, flags)."""

    def __init__(self, ids: np.ndarray, flags: np.ndarray, bounds: np.ndarray, trainable: np.ndarray):
        self.ids, self.flags, self.bounds = ids, flags, bounds
        self.trainable = trainable  # per record: >= 2 tokens and a target after the first (something to learn)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.bounds)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @overload
    def __getitem__(self, k: int) -> tuple[np.ndarray, np.ndarray]: ...
    @overload
    def __getitem__(self, k: slice) -> Streams: ...
    def __getitem__(self, k: int | slice) -> tuple[np.ndarray, np.ndarray] | Streams:
        if isinstance(k, slice):
            keep = np.zeros(len(self), dtype=bool)
            keep[k] = True
            return self.select(keep)
        a, b = _span(self.bounds, k, len(self))
        return self.ids[a:b].astype(np.int64), self.flags[a:b]

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return (self[k] for k in range(len(self)))

    def joined(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Records `ks` end to end: (int64 ids, flags)."""
        bounds = self.bounds
        if ks[-1] - ks[0] == len(ks) - 1:  # consecutive records: one span of the store
            span = slice(bounds[ks[0]], bounds[ks[-1] + 1])
            return self.ids[span].astype(np.int64), self.flags[span]
        ids = np.concatenate([self.ids[bounds[k] : bounds[k + 1]] for k in ks]).astype(np.int64)
        return ids, np.concatenate([self.flags[bounds[k] : bounds[k + 1]] for k in ks])

    def select(self, keep: np.ndarray) -> Streams:
        """The records where `keep` (one bool per record) is true, in their order."""
        if keep.all():
            return self
        tokens = np.repeat(keep, self.lengths)  # one bool per token
        bounds = np.concatenate(([0], np.cumsum(self.lengths[keep]))).astype(np.int64)
        return Streams(self.ids[tokens], self.flags[tokens], bounds, self.trainable[keep])


class StreamsBuilder:
    """Collects records one at a time into `Streams`.

    Records wait in a short list (PENDING_TOKENS), are checked against the id dtype together, then copied
    into chunks of CHUNK_TOKENS allocated whole: above glibc's mmap threshold (32 MiB at most), so a chunk
    freed while `build` joins them goes back to the system at once, and its unused tail is never resident.
    """

    PENDING_TOKENS = 1 << 20  # ~10 MB of per-record int64 arrays
    CHUNK_TOKENS = 1 << 26  # 128 MiB of uint16 ids, 64 MiB of flags

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []  # (ids, flags), the last one filling
        self._fill = 0  # tokens in the last chunk
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_tokens = 0
        self._lengths = array.array("q")
        self._trainable = bytearray()

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, ids: np.ndarray, flags: np.ndarray) -> None:
        self._pending.append((ids, flags))
        self._lengths.append(len(ids))
        self._trainable.append(len(ids) >= 2 and bool(flags[1:].any()))
        self._pending_tokens += len(ids)
        if self._pending_tokens >= self.PENDING_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        ids = np.concatenate([i for i, _ in self._pending])
        flags = np.concatenate([f for _, f in self._pending])
        self._pending, self._pending_tokens = [], 0
        info = np.iinfo(self.dtype)
        if ids.size and (ids.min() < info.min or ids.max() > info.max):  # a tokenizer past its own vocabulary
            bad = int(ids.max()) if ids.max() > info.max else int(ids.min())
            raise ConfigError(f"the tokenizer gave token id {bad}, outside its vocabulary of {self.vocab_size}")
        if not self._chunks or self._fill + len(ids) > len(self._chunks[-1][0]):
            self._seal()
            size = max(self.CHUNK_TOKENS, len(ids))
            self._chunks.append((np.empty(size, self.dtype), np.empty(size, bool)))
        chunk_ids, chunk_flags = self._chunks[-1]
        chunk_ids[self._fill : self._fill + len(ids)] = ids
        chunk_flags[self._fill : self._fill + len(ids)] = flags
        self._fill += len(ids)

    def _seal(self) -> None:
        """The last chunk cut to what it holds (a view: the untouched tail costs no memory)."""
        if self._chunks:
            ids, flags = self._chunks[-1]
            self._chunks[-1] = (ids[: self._fill], flags[: self._fill])
        self._fill = 0

    def build(self) -> Streams:
        self._flush()
        self._seal()
        id_chunks, flag_chunks = [i for i, _ in self._chunks], [f for _, f in self._chunks]
        self._chunks = []  # `_join` holds the only references: each chunk is freed once copied
        ids, flags = _join(id_chunks, self.dtype), _join(flag_chunks, np.dtype(bool))
        lengths = np.array(self._lengths, dtype=np.int64)
        bounds = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        return Streams(ids, flags, bounds, np.array(self._trainable, dtype=bool))


class Blocks:
    """Records of `Streams` cut into blocks of at most max_seq_len + 1 tokens: a raw-text document (`data.format:
    text`, kept whole in the store) longer than a row is trained on block by block, none of its tokens dropped.

    Block b is the store's tokens [starts[b], ends[b]) with its first context[b] tokens read but not scored (their
    target flags cleared): a block after a document's first begins `overlap` tokens before its first new target, plus
    the token read to predict that target (`block_spans`). Each target of the document is scored in exactly one block.
    Indices, not copies: the store (memory-mapped from the cache) is shared; a block costs three int64.
    """

    def __init__(self, streams: Streams, records: np.ndarray, max_seq_len: int, overlap: int):
        self.streams = streams
        lengths = streams.lengths[records]
        doc, start, end, self.context = block_spans(lengths, max_seq_len, overlap)
        base = streams.bounds[records][doc]
        self.starts, self.ends = base + start, base + end
        self.record = records[doc]  # the store's record each block comes from
        self.trainable = np.ones(len(doc), dtype=bool)  # every block scores at least one target of a kept record

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        a, _ = _span(np.arange(len(self) + 1), b, len(self))
        return self.joined(np.array([a]))

    def joined(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Blocks `ks` end to end: (int64 ids, flags), each block's context tokens not targets."""
        ids, flags = [], []
        for k in ks.tolist():
            a, c = int(self.starts[k]), int(self.context[k])
            ids.append(self.streams.ids[a : self.ends[k]])
            f = self.streams.flags[a : self.ends[k]]
            if c:
                f = f.copy()
                f[:c] = False
            flags.append(f)
        return np.concatenate(ids).astype(np.int64), np.concatenate(flags)


def block_spans(lengths: np.ndarray, max_seq_len: int, overlap: int) -> tuple[np.ndarray, ...]:
    """(record, start, end, context) of each block of records of `lengths` tokens (int64 arrays, one entry a block):
    block j of a record holds its tokens [start, end), at most max_seq_len + 1, the first `context` not scored.

    A row of n tokens scores n - 1 targets (its first token is only read). A record of up to max_seq_len + 1 tokens is
    one block. A longer one: block 0 is tokens [0, L + 1) (targets 1..L, L = max_seq_len); block j >= 1 scores the
    next L - overlap targets [a, b) and starts at a - 1 - overlap: `overlap` tokens of context, then the token that
    predicts a (context = overlap + 1). Every target 1..n-1 is scored once (what perplexity with a stride does)."""
    n = np.asarray(lengths, dtype=np.int64)
    step = max_seq_len - overlap  # new targets per block after the first
    if step < 1:
        raise ValueError(f"overlap {overlap} leaves no new token in a block of {max_seq_len}")
    count = 1 + np.maximum(0, -(-(n - max_seq_len - 1) // step))  # blocks per record
    record = np.repeat(np.arange(len(n)), count)
    j = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)  # block number within its record
    first = max_seq_len + 1 + (j - 1) * step  # the first new target of block j >= 1
    start = np.where(j == 0, 0, first - 1 - overlap)
    end = np.minimum(n[record], np.where(j == 0, max_seq_len + 1, first + step))
    context = np.where(j == 0, 0, overlap + 1)
    return record, start, end, context


def record_blocks(ids: np.ndarray, flags: np.ndarray, max_seq_len: int, overlap: int) -> list[Row]:
    """One record's (ids, flags) as `Blocks` cuts it: itself when it fits a row, else each block's tokens with its
    context not scored (`block_spans`)."""
    if len(ids) <= max_seq_len + 1:
        return [(ids, flags)]
    out = []
    for _, a, b, c in zip(*block_spans(np.array([len(ids)]), max_seq_len, overlap), strict=True):
        f = flags[a:b].copy()
        f[:c] = False
        out.append((ids[a:b], f))
    return out


def _join(chunks: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The chunks end to end, each freed once copied: the data held once plus a chunk, not twice over."""
    out = np.empty(sum(len(c) for c in chunks), dtype=dtype)
    start = 0
    chunks.reverse()
    while chunks:
        chunk = chunks.pop()
        out[start : start + len(chunk)] = chunk
        start += len(chunk)
        del chunk
    return out


class Rows(Sequence[Row]):
    """Training rows over `Streams`: row r joins the records `records[groups[r]:groups[r+1]]` (one record, or
    several packed). Indices, not copies: the train and eval rows and the kept records share one store.

    A row of n tokens gives n - 1 positions: position t reads token t and is scored on token t+1 when that
    token is a target (nanoGPT's x/y). A slice gives a list of rows, as a list would.
    """

    def __init__(self, streams: Streams | Blocks, records: np.ndarray, groups: np.ndarray):
        self.streams, self.records, self.groups = streams, records, groups

    @property
    def lengths(self) -> np.ndarray:
        """Positions per row (tokens - 1)."""
        if not len(self):
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(self.streams.lengths[self.records], self.groups[:-1]) - 1

    def __len__(self) -> int:
        return len(self.groups) - 1

    @overload
    def __getitem__(self, r: int) -> Row: ...
    @overload
    def __getitem__(self, r: slice) -> list[Row]: ...
    def __getitem__(self, r: int | slice) -> Row | list[Row]:
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        g0, g1 = _span(self.groups, r, len(self))
        ks = self.records[g0:g1]
        ids, flags = self.streams.joined(ks)
        return training_row(ids, flags, self.streams.lengths[ks])

    @property
    def packed(self) -> bool:
        """Whether some row holds several records (its positions then restart at each: `positions`)."""
        return len(self.records) > len(self)

    def record_lengths(self, r: int) -> np.ndarray:
        """Tokens of each record of row r, in order."""
        g0, g1 = _span(self.groups, r, len(self))
        return self.streams.lengths[self.records[g0:g1]]

    def positions(self, r: int) -> np.ndarray:
        """Row r's position ids (int64, one per position of `self[r]`): 0 at the first token of each record, so
        that each record of a packed row is numbered as when it is alone (runner/model/packing.py)."""
        lengths = self.record_lengths(r)
        return record_positions(lengths, int(lengths.sum()) - 1)

    def __iter__(self) -> Iterator[Row]:
        return (self[r] for r in range(len(self)))


def training_row(ids: np.ndarray, flags: np.ndarray, lengths: np.ndarray) -> Row:
    """(input_ids, labels) of a row of records of `lengths` tokens laid end to end (int64 `ids`, their target
    `flags`): position t reads token t and is scored on token t+1 when that is a target; no loss across a
    boundary: a record's first token is never a target of the one before."""
    if len(lengths) > 1:
        flags = flags.copy()
        flags[np.cumsum(lengths[:-1])] = False
    return ids[:-1], np.where(flags[1:], ids[1:], IGNORE)


def record_positions(lengths: np.ndarray, width: int) -> np.ndarray:
    """Position ids of `width` positions over records of `lengths` tokens laid end to end: each record counts
    from 0; positions past the records (right padding) go on counting from the last one, so they form no
    record of their own and the real tokens before them, causal, never see them. Vectorised: no loop per token."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    spans = lengths.astype(np.int64).copy()  # the positions each record covers within `width`
    spans[-1] = width - starts[-1]
    return np.arange(width, dtype=np.int64) - np.repeat(starts, np.maximum(spans, 0))[:width]


def pack_groups(lengths: np.ndarray, max_seq_len: int) -> np.ndarray:
    """Greedy first-fit in order: records (of `lengths` tokens) joined into rows of up to max_seq_len + 1
    tokens, a record that would overflow a row starting the next one; the index where each row starts."""
    cuts, used = [0], 0
    for k, n in enumerate(lengths.tolist()):
        if used and used + n > max_seq_len + 1:
            cuts.append(k)
            used = 0
        used += n
    if len(lengths):
        cuts.append(len(lengths))
    return np.asarray(cuts, dtype=np.int64)


def _span(bounds: np.ndarray, k: int, n: int) -> tuple[int, int]:
    k = operator.index(k)
    if k < 0:
        k += n
    if not 0 <= k < n:
        raise IndexError(f"index {k} out of range for {n}")
    return int(bounds[k]), int(bounds[k + 1])
