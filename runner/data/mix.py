"""Several training sources mixed by weight (`data.sources`), and the order steps consume their rows.

The rows of all sources form one id space: source s owns the ids [offsets[s], offsets[s+1]) (`ConcatRows`), so
the loader, the checkpoints and the sample logs keep reading plain row ids.

Order (`MixedOrder`), a pure function of (seed, step) like `DataOrder`, so a resumed run, or a step redone at a
smaller micro-batch after an OOM, sees exactly the same samples:
- the global sample slots n = step * global_batch + j are cut into blocks of BLOCK slots; block k holds
  Multinomial(BLOCK, weights / sum) draws of each source, its counts drawn by numpy's PCG64 seeded with
  (seed, chunk) for CHUNK_BLOCKS blocks at once, their arrangement a permutation seeded with (seed, k): the
  same law as one `choice(p=weights)` per slot, and the counts before any block are a cumulative sum of a
  few vectorized draws (a resume at step 1,000,000 costs milliseconds, not a replay of every step);
- the c-th draw of source s is row perm_{s,e}[c mod len_s], e = c // len_s, perm_{s,e} a permutation of that
  source's rows seeded with (seed, s, e): every source goes through all its rows before it repeats any, and a
  small source with a large weight repeats (epochs of its own) while a large one may not finish one.

`total_steps` counts epochs over the sum of all sources' rows (runner/data/dataset.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import PurePosixPath
from typing import overload

import numpy as np

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSource
from runner.data.tokens import Row

BLOCK = 1 << 14  # sample slots whose sources one permutation arranges
CHUNK_BLOCKS = 1 << 10  # blocks whose source counts one generator draws (16.8M slots)
_COUNTS, _SLOTS, _ROWS = 0x4D4958, 0x534C54, 0x524F57  # generator tags: "MIX", "SLT", "ROW"
_PERMS_KEPT = 4  # row permutations cached per source (a step may straddle a source's epochs)


def source_names(sources: Sequence[DataSource]) -> list[str]:
    """Each source's label in logs and metrics: its `name`, else its file or directory name (a hub id's last
    part); a default that another source already has gets `#2`, `#3`... (the spec refuses two equal `name`s)."""
    taken = {s.name for s in sources if s.name}
    names: list[str] = []
    for i, s in enumerate(sources):
        if s.name:
            names.append(s.name)
            continue
        base = PurePosixPath(s.path.rstrip("/")).name or f"source{i}"
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}#{n}"
        taken.add(name)
        names.append(name)
    return names


class ConcatRows(Sequence[Row]):
    """The rows of several sources end to end: id i is row i - offsets[s] of part s, offsets[s] <= i < offsets[s+1].
    Views, not copies: each part keeps its own (possibly memory-mapped) token store."""

    def __init__(self, parts: Sequence[Sequence[Row]]):
        self.parts = list(parts)
        self.offsets = np.concatenate(([0], np.cumsum([len(p) for p in self.parts]))).astype(np.int64)
        self._lengths: np.ndarray | None = None

    @property
    def lengths(self) -> np.ndarray:
        """Positions per row, all parts (runner/data/tokens.py `Rows.lengths`)."""
        if self._lengths is None:
            self._lengths = np.concatenate([np.asarray(p.lengths, dtype=np.int64) for p in self.parts])  # type: ignore[attr-defined]
        return self._lengths

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @overload
    def __getitem__(self, i: int) -> Row: ...
    @overload
    def __getitem__(self, i: slice) -> list[Row]: ...
    def __getitem__(self, i: int | slice) -> Row | list[Row]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        part, r = self.locate(i)
        return part[r]

    def __iter__(self) -> Iterator[Row]:
        for part in self.parts:
            yield from part

    def locate(self, i: int) -> tuple[Sequence[Row], int]:
        """(the part, the row within it) of id i."""
        k = int(i) + len(self) if int(i) < 0 else int(i)
        if not 0 <= k < len(self):
            raise IndexError(f"index {i} out of range for {len(self)}")
        s = int(np.searchsorted(self.offsets, k, side="right")) - 1
        return self.parts[s], k - int(self.offsets[s])

    @property
    def packed(self) -> bool:
        """Whether some row holds several records (runner/data/tokens.py `Rows.packed`)."""
        return any(getattr(p, "packed", False) for p in self.parts)


class MixedOrder:
    """Which row ids optimizer step `step` consumes when several sources mix by weight (see the module docstring).

    `sizes`: training rows per source (ids offset by the sizes before), `weights`: positive, any scale.
    `steps_per_epoch` is sum(sizes) // global_batch (epochs count passes over all rows, for `total_steps`
    and the logs; each source has epochs of its own).
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch: int, seed: int):
        total = int(sum(sizes))
        if total < global_batch:
            raise ConfigError(
                f"training.global_batch {global_batch} is larger than the {total} training rows of all "
                "data.sources; lower it or add data"
            )
        if len(sizes) != len(weights) or min(sizes) < 1 or min(weights) <= 0:
            raise ValueError(f"sources need rows and positive weights: sizes {list(sizes)}, weights {list(weights)}")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes))).astype(np.int64)
        w = np.asarray(weights, dtype=np.float64)
        self.p = w / w.sum()
        self.global_batch, self.seed = global_batch, seed
        self.steps_per_epoch = total // global_batch
        # Counts of each source before block k: _before[k], grown a chunk of blocks at a time on demand.
        self._before = np.zeros((1, len(self.sizes)), dtype=np.int64)
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # block -> (source, rank in block) per slot
        self._perms: dict[tuple[int, int], np.ndarray] = {}  # (source, epoch) -> permutation of its rows

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def step_samples(self, step: int) -> list[int]:
        """The global_batch row ids of optimizer step `step` (0-based), in rank order."""
        src, draw = self.draws(step)
        epoch, row = np.divmod(draw, self.sizes[src])
        ids = np.empty(len(src), dtype=np.int64)
        for s, e in set(zip(src.tolist(), epoch.tolist(), strict=True)):  # a few (source, epoch) pairs per step
            hit = (src == s) & (epoch == e)
            ids[hit] = self.offsets[s] + self._perm(s, e)[row[hit]]
        return ids.tolist()

    def step_counts(self, step: int) -> np.ndarray:
        """Samples of each source in step `step`."""
        return np.bincount(self.draws(step)[0], minlength=len(self.sizes))

    def drawn_before(self, step: int) -> np.ndarray:
        """Draws of each source in the slots before step `step` (where each source's stream stands then)."""
        n = step * self.global_batch
        k = n // BLOCK
        src, _ = self._block(k)
        return self._counts_before(k) + np.bincount(src[: n - k * BLOCK], minlength=len(self.sizes))

    def draws(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index of the draw within its source) of each slot of step `step`, in slot order."""
        a, b = step * self.global_batch, (step + 1) * self.global_batch
        srcs, draws = [], []
        for k in range(a // BLOCK, (b - 1) // BLOCK + 1):  # one block, two at a boundary (more if G > BLOCK)
            lo, hi = max(a, k * BLOCK) - k * BLOCK, min(b, (k + 1) * BLOCK) - k * BLOCK
            src, rank = self._block(k)
            srcs.append(src[lo:hi])
            draws.append(self._counts_before(k)[src[lo:hi]] + rank[lo:hi])
        return np.concatenate(srcs), np.concatenate(draws)

    def _counts_before(self, k: int) -> np.ndarray:
        """Draws of each source in the blocks before block k."""
        if len(self._before) <= k:  # the chunks not drawn yet, up to k's, in one go
            known = (len(self._before) - 1) // CHUNK_BLOCKS
            counts = np.concatenate([self._chunk_counts(c) for c in range(known, k // CHUNK_BLOCKS + 1)])
            self._before = np.concatenate((self._before, self._before[-1] + np.cumsum(counts, axis=0)))
        return self._before[k]

    def _chunk_counts(self, chunk: int) -> np.ndarray:
        """(CHUNK_BLOCKS, sources): how many slots of each block of `chunk` draw each source."""
        rng = np.random.default_rng([self.seed, _COUNTS, chunk])
        return rng.multinomial(BLOCK, self.p, size=CHUNK_BLOCKS).astype(np.int64)

    def _block(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of each slot of block k, and its rank among the block's slots of that source."""
        if k not in self._blocks:
            counts = self._counts_before(k + 1) - self._counts_before(k)
            src = np.random.default_rng([self.seed, _SLOTS, k]).permutation(np.repeat(np.arange(len(counts)), counts))
            by_source = np.argsort(src, kind="stable")  # slots grouped by source, in slot order within each
            rank = np.empty(BLOCK, dtype=np.int64)
            rank[by_source] = np.arange(BLOCK) - np.repeat(np.cumsum(counts) - counts, counts)
            if len(self._blocks) >= 2:  # a step needs this block and maybe the one before
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[k] = (src, rank)
        return self._blocks[k]

    def _perm(self, s: int, e: int) -> np.ndarray:
        """Epoch e's permutation of source s's rows."""
        key = (s, e)
        if key not in self._perms:
            if len(self._perms) >= _PERMS_KEPT * len(self.sizes):
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = np.random.default_rng([self.seed, _ROWS, s, e]).permutation(int(self.sizes[s]))
        return self._perms[key]
