"""Streaming (`data.streaming: true`): records read in order and tokenized as the steps need them.

For sets too large to prepare up front. Each source (`data.path`, or each of `data.sources`: a local file or
directory, or a hub id through `datasets.load_dataset(..., streaming=True)`) is read in order, window by window
(`data.shuffle_buffer` records, default SHUFFLE_BUFFER): the records of window w are taken in the order of a
permutation seeded with (seed, source, pass, w), so the stream is a pure function of the seed and the position;
then tokenized (the render/clip/flatten path of `encode_file`, runner/data/dataset.py), the records without a target
dropped, and, with `data.packing`, packed greedily in order as `pack_groups` packs (a row keeps its records' lengths
for per-record position ids). A source read to its end starts its next pass (the next seed); a pass ends its last
packed row. Several sources interleave by weight exactly as prepared ones do (`MixedOrder.draws`, runner/data/mix.py):
slot n draws source s's c-th sample.

Steps: step s takes the stream's samples (slots) [s*G, (s+1)*G), G = global_batch; their ids are the slot numbers,
each rank collates its rank slice. A thread of this process reads and tokenizes at most AHEAD_STEPS steps ahead of
the loop (a bounded queue); the loop keeps the last KEEP_STEPS steps it asked for, so an OOM redo of a step at a
smaller micro-batch sees the same samples. Memory is flat in the data size: a window of records, a few steps of
rows. One process per rank reads the whole stream (a row's place depends on every record before it), keeping only
its share.

Resume by position: where each source stands at step k (its samples drawn before slot k*G) is a pure function of k.
So as not to tokenize again what was trained before a restart, rank 0 appends a position index per source to
`<cache root>/stream/<key>.jsonl` (key: the source's path, size and mtime, the tokenizer, the tokenizing and packing
settings and the seed): every INDEX_EVERY samples, where that sample's first record lies (pass, window, place in
the window) and, for .jsonl files, the byte offset and line of the window's start. A restart seeks to the last entry
at or before its sample (a .jsonl by offset; other sources by reading and dropping records, never tokenizing them),
reads that window and tokenizes from there: less than INDEX_EVERY samples again. The index is checked as it is used
(the row found there has the length and the token digest written, and the entry names its own index): a stale,
damaged or foreign one, or one that leads the reader anywhere it cannot read, is logged and the stream replayed from
the start, never a stop. The cache root is shared: the index is appended through jobspec.shared_dir (never through a
link), read within MAX_INDEX_BYTES with every number bounded, and, with JOBSPEC_CHECKPOINT_KEY set, each entry is
signed (jobspec/shared_dir/signing.py) and an unsigned one ignored.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobspec import shared_dir
from jobspec.errors import ConfigError
from jobspec.shared_dir import signing
from jobspec.spec.models import DataSpec, JobSpec
from jobspec.untrusted import json_loads, read_bounded
from runner.data.cache import tokenizer_identity, usable_root
from runner.data.dataset import (
    BUNDLED,
    Batch,
    SFTData,
    _locate,
    _rows,
    detect_format,
    encode_file,
    make_batch,
    pad_rows,
    record_chat,
)
from runner.data.mix import MixedOrder, source_names
from runner.data.prepare import CHUNK_RECORDS, render_chunk
from runner.data.records import (
    EVAL_SPLITS,
    TRAIN_SPLITS,
    Location,
    read_hub_stream,
    read_jsonl_at,
    read_records,
    source_kind,
)
from runner.data.tokenizer import Message, Tokenizer
from runner.data.tokens import Row, record_blocks, record_positions, training_row

log = logging.getLogger("jobspec.runner")
SHUFFLE_BUFFER = 1024  # records shuffled together by default (a window held in memory as parsed records)
INDEX_EVERY = 256  # samples of a source between two entries of its position index
AHEAD_STEPS = 4  # steps the reader thread tokenizes ahead of the loop
KEEP_STEPS = 3  # steps the loop may ask again (an OOM redo asks the current one)
HEAD_SAMPLES = 8  # samples of each source whose tokens fingerprint the data (runner/checkpoint/lineage.py)
INDEX_VERSION = 3  # 3: the digest binds the sample number and its place (an index of 2 is simply not used)
MAX_INDEX_BYTES = 256 << 20  # ~3M entries: a billion samples at INDEX_EVERY
MAX_POSITION = 1 << 53  # any sample, pass, window, byte offset or line a real stream reaches
_WINDOW = 0x57494E  # generator tag: "WIN"


_Read = tuple[Location, dict, int | None, int | None]  # (where, record, offset and line after it: .jsonl only)


@dataclass(frozen=True)
class Sample:
    """One training row of a stream: its tokens, target flags, and the token count of each record in it."""

    ids: np.ndarray  # int64
    flags: np.ndarray  # bool
    lengths: np.ndarray  # int64, one per record, summing to len(ids)

    def row(self) -> Row:
        """(input_ids, labels) as `Rows.__getitem__` makes them: no loss across a record boundary."""
        return training_row(self.ids, self.flags, self.lengths)


@dataclass(frozen=True)
class Position:
    """Where a sample's first record lies: pass `epoch`, window `window` (records [w*B, (w+1)*B) of the pass), place
    `place` in the window's shuffled order; `offset`/`line`: the window's first record in a .jsonl (None: elsewhere)."""

    sample: int
    epoch: int
    window: int
    place: int
    offset: int | None
    line: int | None
    tokens: int = -1  # the sample's token count (the index's check), -1 unknown
    digest: str = ""  # the sample's token ids' digest (`token_digest`: the index's check)
    block: int = 0  # the block of the record the sample starts at (a raw-text document longer than a row: `Blocks`)

    def entry(self) -> dict[str, Any]:
        block = {"b": self.block} if self.block else {}  # left out at 0: an entry as before blocks existed
        return {"c": self.sample, "e": self.epoch, "w": self.window, "q": self.place, "off": self.offset,
                "line": self.line, "n": self.tokens, "h": self.digest, **block}  # fmt: skip

    @staticmethod
    def parse(entry: object) -> Position | None:
        """The position an index entry holds; None for anything but an entry of this version within bounds."""
        if not isinstance(entry, dict):
            return None
        ints = [entry.get(k) for k in ("c", "e", "w", "q", "n")]
        opt = [entry.get(k) for k in ("off", "line")]
        digest, block = entry.get("h"), entry.get("b", 0)
        if not all(_bounded(v) for v in [*ints, block]) or not all(v is None or _bounded(v) for v in opt):
            return None
        if not isinstance(digest, str) or len(digest) != 16 or not all(ch in "0123456789abcdef" for ch in digest):
            return None
        c, e, w, q, n = ints
        return Position(c, e, w, q, opt[0], opt[1], n, digest, block)  # type: ignore[arg-type]


def _bounded(value: object) -> bool:
    return type(value) is int and 0 <= value < MAX_POSITION


def token_digest(ids: np.ndarray, pos: Position) -> str:
    """16 hex digits of the sha256 of the entry's sample number and place and the sample's token ids (as int64): what
    an index entry says its sample holds, bound to which sample it says that is. An entry copied from another (sample
    0's place and digest under another sample number) then fails the check instead of resuming the stream at the
    wrong sample; an entry forged with a digest computed anew is what JOBSPEC_CHECKPOINT_KEY's signature is for."""
    where = np.array([pos.sample, pos.epoch, pos.window, pos.place, -1 if pos.offset is None else pos.offset,
                      -1 if pos.line is None else pos.line, *([pos.block] if pos.block else [])],
                     dtype=np.int64)  # fmt: skip
    data = where.tobytes() + np.ascontiguousarray(ids, dtype=np.int64).tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


START = Position(0, 0, 0, 0, 0, 0)


class PositionIndex:
    """A source's position entries (module docstring) in one JSON-lines file; written by one rank, read by all.
    Untrusted: a regular file read within MAX_INDEX_BYTES, lines that do not parse skipped."""

    def __init__(self, path: Path | None, write: bool):
        self.path, self.write = path, write and path is not None
        self.last = -1  # highest sample written or read

    def best(self, sample: int) -> Position | None:
        """The last entry at or before `sample`, None when there is none (or no index)."""
        if self.path is None or not os.path.lexists(self.path):
            return None
        try:
            text = read_bounded(self.path, MAX_INDEX_BYTES, what="stream position index", follow=False)
        except (ConfigError, OSError) as err:
            log.warning("data stream: position index %s not usable (%s): reading from the start", self.path, err)
            return None
        found, secret, foreign = None, signing.key(), 0
        for line in text.splitlines():
            try:
                record = json_loads(line, max_depth=2)
            except ValueError:  # a torn last line, junk, or nesting no entry has
                continue
            if not isinstance(record, dict) or record.get("i") != self.path.stem or (
                    secret is not None and signing.problem(record, secret, self.path.name)):  # fmt: skip
                foreign += 1  # another index's entry, or (a key set) one not signed with it
                continue
            pos = Position.parse(record)
            if pos is not None:
                self.last = max(self.last, pos.sample)
                if pos.sample <= sample and (found is None or pos.sample > found.sample):
                    found = pos
        if foreign:
            log.warning("data stream: position index %s: %d entries not its own (another index's, or unsigned) "
                        "ignored", self.path, foreign)  # fmt: skip
        return found

    def add(self, pos: Position) -> None:
        if not self.write or pos.sample <= self.last:
            return
        self.last = pos.sample
        assert self.path is not None
        record = {**pos.entry(), "i": self.path.stem}
        secret = signing.key()
        record = signing.sign(record, secret) if secret is not None else record
        try:
            shared_dir.directory(self.path.parent)  # `stream` under the cache root: never a link
            with shared_dir.open_append(self.path) as f:  # never through a link planted at the name
                f.write(json.dumps(record) + "\n")
        except OSError as err:  # an index only saves time: never a reason to stop
            log.warning("data stream: cannot write the position index %s (%s); a restart reads from the start",
                        self.path, err)  # fmt: skip
            self.write = False


class SourceStream:
    """The samples of one source, in stream order, from any sample on (`samples(start)`)."""

    def __init__(self, source: str, field: str, spec: DataSpec, tokenizer: Tokenizer, seed: int, number: int,
                 index: PositionIndex):  # fmt: skip
        self.source, self.field, self.spec, self.tokenizer = source, field, spec, tokenizer
        self.seed, self.number, self.index = seed, number, index
        self.kind = source_kind(source, field)
        buffer = SHUFFLE_BUFFER if spec.shuffle_buffer is None else spec.shuffle_buffer
        self.shuffled = buffer > 1
        self.window = buffer if self.shuffled else CHUNK_RECORDS  # records read (and, shuffled, permuted) together
        self.limit = spec.max_seq_len + 1
        self.reach = spec.max_seq_len + 2
        self.chars = self.reach * tokenizer.max_token_chars
        self.fmt: str | None = None
        self.dropped = 0  # records without a target, this pass

    # --- reading --------------------------------------------------------------------------------------------

    def _records(self, offset: int | None, line: int | None, skip: int) -> Iterator[_Read]:
        """(where, record, offset, line of the record after it) from the record `skip` records past (offset, line)."""
        if self.kind == "jsonl" and offset is not None and line is not None:
            records, f = read_jsonl_at(Path(self.source), self.field, offset, line)
            for where, record in itertools.islice(records, skip, None):
                yield where, record, f.tell(), where.line
            return
        reader = read_hub_stream(self.source, self.field, TRAIN_SPLITS) if self.kind == "hub" else read_records(
            self.source, self.spec, self.field, TRAIN_SPLITS)  # fmt: skip
        for where, record in itertools.islice(reader, skip, None):  # skipped records are parsed, never tokenized
            yield where, record, None, None

    def _windows(self, start: Position) -> Iterator[tuple[int, int, list[int], list, int | None, int | None]]:
        """(pass, window, order, records, offset, line) of every window from `start`'s on, passes without end;
        `order`: the window's record indices in shuffled order (the caller starts at `start.place` in the first)."""
        epoch, window, offset, line = start.epoch, start.window, start.offset, start.line
        skip = 0 if offset is not None else window * self.window  # no offset: count records from the pass's start
        while True:
            it = self._records(offset if offset is not None else (0 if self.kind == "jsonl" else None),
                               line if line is not None else (0 if self.kind == "jsonl" else None), skip)  # fmt: skip
            got_any = False
            while True:
                w_offset, w_line = offset, line
                chunk = list(itertools.islice(it, self.window))
                if not chunk:
                    break
                got_any = True
                offset, line = chunk[-1][2], chunk[-1][3]
                yield epoch, window, self._order(epoch, window, len(chunk)), chunk, w_offset, w_line
                window += 1
            if not got_any and window == 0:
                raise ConfigError(f"{self.field} {self.source}: no records (expected prompt/response or messages)")
            epoch, window, skip = epoch + 1, 0, 0
            offset, line = (0, 0) if self.kind == "jsonl" else (None, None)

    def _order(self, epoch: int, window: int, n: int) -> list[int]:
        if not self.shuffled:
            return list(range(n))
        rng = np.random.default_rng([self.seed, _WINDOW, self.number, epoch, window])
        return rng.permutation(n).tolist()

    # --- tokenizing -----------------------------------------------------------------------------------------

    def _encoded(self, start: Position) -> Iterator[tuple[Position, np.ndarray, np.ndarray]]:
        """(position, ids, flags) of each record with a target, in stream order, from `start`'s record (and block) on,
        a raw-text document longer than a row as its blocks (`record_blocks`); a record whose pass ends gets ids of
        length 0 after it (a marker: the packer closes its row)."""
        first, whole, kept = True, start.window == 0 and start.place == 0, 0  # whole: the pass read from its start
        skip = start.block  # blocks of the first record already trained before `start`
        for epoch, window, order, chunk, w_offset, w_line in self._windows(start):
            if window == 0 and not first:
                if whole and not kept:  # a whole pass without a record to train on: no pass ever has one
                    raise ConfigError(f"{self.field} {self.source}: no record has a response token within max_seq_len "
                                      f"{self.spec.max_seq_len}; raise it or check the data.*_field names")  # fmt: skip
                whole, kept = True, 0
                yield Position(-1, epoch, 0, 0, None, None), np.zeros(0, np.int64), np.zeros(0, bool)
                if self.dropped:
                    log.info("data %s: pass %d: %d records without a response token within max_seq_len %d dropped",
                             self.source, epoch - 1, self.dropped, self.spec.max_seq_len)  # fmt: skip
                self.dropped = 0
            places = range(start.place if first else 0, len(order))
            first = False
            for a in range(places.start, len(order), CHUNK_RECORDS):
                part = list(range(a, min(a + CHUNK_RECORDS, len(order))))
                chats, wheres = [], []
                for q in part:
                    where, record = chunk[order[q]][0], chunk[order[q]][1]
                    chats.append(self._messages(where, record))
                    wheres.append(where)
                try:
                    ids, flags, lengths = render_chunk(self.tokenizer, chats, self.limit)
                except ValueError as err:
                    _locate((wheres, chats), self.tokenizer, err, self.fmt)
                bounds = np.concatenate(([0], np.cumsum(lengths))).tolist()
                for q, (x, y) in zip(part, itertools.pairwise(bounds), strict=True):
                    rid, rflags = ids[x:y], flags[x:y]
                    skipped, skip = skip, 0
                    if len(rid) < 2 or not rflags[1:].any():
                        self.dropped += 1
                        continue
                    kept += 1
                    cut = record_blocks(rid, rflags, self.spec.max_seq_len, self.spec.text_overlap)
                    for j, (bid, bflags) in enumerate(cut[skipped:], skipped):
                        yield Position(-1, epoch, window, q, w_offset, w_line, block=j), bid, bflags

    def _messages(self, where: Location, record: dict) -> list[Message]:
        self.fmt = self.fmt or detect_format(record, self.spec, str(where))
        return record_chat(record, self.fmt, self.spec, self.chars, self.reach, where)[0]

    def _rows(self, start: Position) -> Iterator[tuple[Position, Sample]]:
        """(position of its first record, sample) in order from `start`, sample numbers counted from start.sample."""
        n, pending, used, head = start.sample, [], 0, None
        for pos, ids, flags in self._encoded(start):
            end = not len(ids)  # a pass ended: its last row closes
            if pending and (end or (self.spec.packing and used + len(ids) > self.limit) or not self.spec.packing):
                yield _with(head, n), _sample(pending)
                n, pending, used = n + 1, [], 0
            if end:
                continue
            if not pending:
                head = pos
            pending.append((ids, flags))
            used += len(ids)
            if not self.spec.packing:
                yield _with(head, n), _sample(pending)
                n, pending, used = n + 1, [], 0

    def samples(self, start: int) -> Iterator[Sample]:
        """Samples `start`, `start + 1`, ... (passes without end), from the position index's nearest entry."""
        rows = None
        pos = self.index.best(start) if start > 0 else None
        if pos is not None and pos.sample > 0 and (pos.offset is not None) == (self.kind == "jsonl"):
            rows = self._rows(pos)
            try:
                first = next(rows)
                found = f"{len(first[1].ids)} tokens, digest {token_digest(first[1].ids, pos)}"
            except (ConfigError, ValueError, OSError, StopIteration) as err:  # an entry that leads nowhere readable
                first, found = None, f"unreadable there: {str(err)[:300]}"
            if first is not None and len(first[1].ids) == pos.tokens and token_digest(first[1].ids, pos) == pos.digest:
                log.info("data %s: stream resumed at sample %d from the index entry of sample %d (pass %d, window %d)",
                         self.source, start, pos.sample, pos.epoch, pos.window)  # fmt: skip
                rows = itertools.chain([first], rows)
            else:
                log.warning("data %s: the stream position index %s does not match the data (sample %d: %s; the "
                            "index says %d tokens, digest %s); replaying the stream from the start", self.source,
                            self.index.path, pos.sample, found, pos.tokens, pos.digest)  # fmt: skip
                rows = None
        if rows is None:
            rows = self._rows(START if self.kind == "jsonl" else Position(0, 0, 0, 0, None, None))
        for where, sample in rows:
            if where.sample % INDEX_EVERY == 0:
                self.index.add(Position(where.sample, where.epoch, where.window, where.place, where.offset,
                                        where.line, len(sample.ids), token_digest(sample.ids, where),
                                        where.block))  # fmt: skip
            if where.sample >= start:
                yield sample


def _with(pos: Position | None, sample: int) -> Position:
    assert pos is not None
    return Position(sample, pos.epoch, pos.window, pos.place, pos.offset, pos.line, block=pos.block)


def _sample(records: list[tuple[np.ndarray, np.ndarray]]) -> Sample:
    lengths = np.array([len(i) for i, _ in records], dtype=np.int64)
    if len(records) == 1:
        return Sample(records[0][0].astype(np.int64, copy=False), records[0][1], lengths)
    ids = np.concatenate([i for i, _ in records]).astype(np.int64, copy=False)
    return Sample(ids, np.concatenate([f for _, f in records]), lengths)


class StreamOrder:
    """Step s's sample ids: the stream's slots [s*G, (s+1)*G) (the `DataOrder` interface)."""

    def __init__(self, global_batch: int, mix: MixedOrder | None):
        self.global_batch, self.mix = global_batch, mix
        self._weights = None if mix is None else mix.p.tolist()
        self.steps_per_epoch = 1 << 62  # a stream has no epochs of known length: `epoch` is 0

    def epoch(self, step: int) -> int:
        return 0

    def step_samples(self, step: int) -> list[int]:
        return list(range(step * self.global_batch, (step + 1) * self.global_batch))

    def step_counts(self, step: int) -> np.ndarray:
        if self.mix is None:
            return np.array([self.global_batch], dtype=np.int64)
        return self.mix.step_counts(step)

    def copy(self) -> StreamOrder:
        """The same order with caches of its own (for the reader thread: `MixedOrder` caches are not thread-safe)."""
        if self.mix is None:
            return self
        sizes = [self.global_batch] * len(self.mix.sizes)
        return StreamOrder(self.global_batch, MixedOrder(sizes, self._weights, self.global_batch, self.mix.seed))

    def source_starts(self, step: int, sources: int) -> list[int]:
        """Each source's samples drawn before step `step`."""
        if self.mix is None:
            return [step * self.global_batch]
        return self.mix.drawn_before(step).tolist()[:sources]


class _Reader(threading.Thread):
    """Reads and tokenizes steps `start`, `start + 1`, ... into a bounded queue: (step, {slot: sample}) of this
    rank's slots, or the exception that stopped it."""

    def __init__(self, streams: Sequence[SourceStream], order: StreamOrder, start: int, mine: range):
        super().__init__(name=f"stream-reader@{start}", daemon=True)
        self.streams, self.order, self.start_step, self.mine = streams, order.copy(), start, mine
        self.out: queue.Queue[tuple[int, dict[int, Sample]] | BaseException] = queue.Queue(AHEAD_STEPS)
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            starts = self.order.source_starts(self.start_step, len(self.streams))
            its = [s.samples(c) for s, c in zip(self.streams, starts, strict=True)]
            g = self.order.global_batch
            for step in itertools.count(self.start_step):
                srcs = np.zeros(g, dtype=np.int64) if self.order.mix is None else self.order.mix.draws(step)[0]
                rows = {}
                for j, s in enumerate(srcs.tolist()):
                    sample = next(its[s])
                    if j in self.mine:
                        rows[step * g + j] = sample
                if not self._put((step, rows)):
                    return
        except BaseException as err:  # handed to the loop, which raises it (a bad record is a ConfigError)
            self._put(err)

    def _put(self, item: Any) -> bool:
        while not self.halt.is_set():
            try:
                self.out.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)


class StreamData(SFTData):
    """`SFTData` over a stream: `collate(ids)` of a step's slot ids takes its rows from the reader thread; eval rows
    (from `data.eval_path`) are prepared as usual. Lives in this process only (DataLoader workers get none)."""

    streamed = True

    def __init__(self, streams: Sequence[SourceStream], order: StreamOrder, eval_rows: Any, pad_id: int,
                 max_seq_len: int, sources: Sequence[str], rank: int, world_size: int):  # fmt: skip
        super().__init__([], eval_rows, pad_id, max_seq_len, sources)
        self.streams, self.order = list(streams), order
        per_rank = order.global_batch // world_size
        self.mine = range(rank * per_rank, (rank + 1) * per_rank)
        self.offsets = np.arange(len(self.streams) + 1, dtype=np.int64)  # not ids: sources are told by the order
        self._kept: OrderedDict[int, dict[int, Sample]] = OrderedDict()
        self._reader: _Reader | None = None
        self._next = -1  # the step the reader gives next
        # The lineage's fingerprint of the data: each source's first samples, the same on every rank.
        self.train = [s.row() for st in self.streams for s in itertools.islice(st.samples(0), HEAD_SAMPLES)]

    @property
    def longest(self) -> int:
        return self.max_seq_len + 1

    def source_counts(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        steps = {int(i) // self.order.global_batch for i in ids}
        return sum((self.order.step_counts(s) for s in steps), np.zeros(len(self.sources), dtype=np.int64))

    def step_rows(self, step: int) -> dict[int, Sample]:
        """This rank's samples of step `step`, by slot id."""
        if step in self._kept:
            return self._kept[step]
        if self._reader is None or step < self._next or step > self._next + AHEAD_STEPS:
            self._restart(step)  # a resume, a step-down to an older checkpoint, or a jump
        while True:
            item = self._reader.out.get()  # type: ignore[union-attr]
            if isinstance(item, BaseException):
                self.close()
                raise item
            got, rows = item
            self._next = got + 1
            self._kept[got] = rows
            while len(self._kept) > KEEP_STEPS:
                self._kept.popitem(last=False)
            if got == step:
                return rows

    def _restart(self, step: int) -> None:
        self.close()
        self._reader = _Reader(self.streams, self.order, step, self.mine)
        self._next = step
        self._reader.start()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader = None

    def collate(self, ids: Sequence[int], split: str = "train") -> Batch:
        if split != "train":
            return super().collate(ids, split)
        step = int(ids[0]) // self.order.global_batch
        kept = self.step_rows(step)
        samples = [kept[int(i)] for i in ids]
        rows = [s.row() for s in samples]
        x, y = pad_rows(rows, self.pad_id, self.max_seq_len)
        positions = None
        if self.spec_packing:
            positions = torch.from_numpy(np.stack([record_positions(s.lengths, x.shape[1]) for s in samples]))
        return make_batch(x, y, rows, ids, positions)

    @property
    def spec_packing(self) -> bool:
        return any(s.spec.packing for s in self.streams)

    def __reduce__(self) -> Any:
        raise TypeError("streamed data is read by a thread of its own process: DataLoader workers cannot take it "
                        "(num_workers 0 with data.streaming)")  # fmt: skip


def index_path(spec: JobSpec, source: str, field: str, tokenizer: Tokenizer, number: int) -> Path | None:
    """Where the position index of a source lives (module docstring); None when the tokenizer cannot name its state."""
    tok, why = tokenizer_identity(tokenizer)
    root = usable_root(spec)
    if tok is None or root is None:
        log.info("data %s: no stream position index (%s): a restart re-reads the stream from the start", source,
                 why or "no usable cache directory")  # fmt: skip
        return None
    d = spec.data
    parts: dict[str, Any] = {"version": INDEX_VERSION, "source": str(Path(source).resolve()) if Path(source).exists()
                             else source, "number": number, "seed": spec.training.seed, "tokenizer": tok,
                             **d.model_dump(mode="json", include={"format", "prompt_field", "response_field",
                                                                 "messages_field", "max_seq_len", "packing",
                                                                 "shuffle_buffer"})}  # fmt: skip
    if d.text_field != "text":  # text records' field (at its default left out: no other index moves)
        parts["text_field"] = d.text_field
    if d.text_overlap:  # raw-text blocks' overlap (0 left out: as the text_field)
        parts["text_overlap"] = d.text_overlap
    if Path(source).is_file():
        st = os.stat(source)
        parts["stat"] = [st.st_size, st.st_mtime_ns]
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    return root / "stream" / f"{digest}.jsonl"


def load_stream(spec: JobSpec, tokenizer: Tokenizer, rank: int = 0, world_size: int = 1,
                write_index: bool = True) -> StreamData:  # fmt: skip
    """The streamed training data of `spec` (`data.streaming`) and its eval rows (`data.eval_path`, else none)."""
    d, t = spec.data, spec.training
    sources = d.train_sources(str(BUNDLED))
    names = source_names(sources)
    streams = []
    for i, source in enumerate(sources):
        field = "data.path" if d.sources is None else f"data.sources[{i}].path"
        fmt = d if source.format is None else d.model_copy(update={"format": source.format})
        index = PositionIndex(index_path(spec, source.path, field, tokenizer, i), write=write_index)
        streams.append(SourceStream(source.path, field, fmt, tokenizer, t.seed, i, index))
    mix = None
    if len(sources) > 1:
        mix = MixedOrder([t.global_batch] * len(sources), [s.weight for s in sources], t.global_batch, t.seed)
    if d.eval_path:
        held = encode_file(d.eval_path, d, tokenizer, "data.eval_path", EVAL_SPLITS, cache_dir=usable_root(spec))
        eval_rows: Any = _rows(held, np.arange(len(held)), d, "eval")
    else:
        eval_rows = []
        log.info("data: streamed, no data.eval_path: no eval (a stream's length is unknown: nothing is held out)")
    buffer = SHUFFLE_BUFFER if d.shuffle_buffer is None else d.shuffle_buffer
    log.info("data: streaming %d source(s) (%s), shuffled in windows of %s records, packing %s", len(sources),
             ", ".join(names), buffer if buffer > 1 else "no", "on" if d.packing else "off")  # fmt: skip
    return StreamData(streams, StreamOrder(t.global_batch, mix), eval_rows, tokenizer.pad_id, d.max_seq_len, names,
                      rank, world_size)  # fmt: skip
