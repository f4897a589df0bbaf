"""Micro-batches collated ahead of the training loop by DataLoader workers, pinned when the plan says so.

A step's samples are a pure function of (seed, step), so the workers can collate the next steps while
the GPU trains on this one. The plan sizes `num_workers` and `pin_memory` from the container's CPUs and
memory (runner/sizing/hostmem.py). An item of the loader is (step, micro-batch): this rank's micro-batches of
that step. The keys are drawn lazily, when the loader hands a step to a worker, with the micro-batch the loop
uses at that moment; so when the loop asks for another micro-batch (an OOM shrink redoing a step smaller, a
regrow), the steps already handed out at the old size are collated in process (a miss) and every later one
comes from the workers at the new size, with no worker restarted. A restart cost more than the redone step
itself: 0.11 s against 0.015 s steps on this CPU (tiny preset, 2 workers; bench/recovery.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils.data import DataLoader, Dataset

from runner.data.dataset import Batch, SFTData, micro_batches

log = logging.getLogger("jobspec.runner")


@dataclass(frozen=True)
class StepBatches:
    step: int
    micro_batch: int
    ids: tuple[int, ...]
    batches: tuple[Batch, ...]

    def pin_memory(self) -> StepBatches:  # called by the DataLoader's pin-memory thread
        return replace(self, batches=tuple(_pinned(b) for b in self.batches))


def _pinned(b: Batch) -> Batch:
    positions = None if b.position_ids is None else b.position_ids.pin_memory()
    return replace(b, input_ids=b.input_ids.pin_memory(), labels=b.labels.pin_memory(), position_ids=positions)


class _Steps(Dataset):
    def __init__(self, data: SFTData, step_ids: Callable[[int], list[int]]):
        self.data, self.step_ids = data, step_ids

    def __getitem__(self, key: tuple[int, int]) -> StepBatches:
        step, micro_batch = key
        ids = self.step_ids(step)
        batches = tuple(self.data.collate(chunk) for chunk in micro_batches(ids, micro_batch))
        return StepBatches(step, micro_batch, tuple(ids), batches)


class _Keys:
    """The loader's sampler: (step, the loop's micro-batch when the step is handed to a worker)."""

    def __init__(self, owner: Prefetcher, start: int, total: int):
        self.owner, self.start, self.total = owner, start, total

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for step in range(self.start, self.total):
            yield step, self.owner.micro_batch

    def __len__(self) -> int:
        return max(0, self.total - self.start)


def _as_is(item: StepBatches) -> StepBatches:  # module level: DataLoader workers may need to pickle it
    return item


class Prefetcher:
    """`batches(ids, micro_batch)`: the collated micro-batches, from the workers when they have them."""

    def __init__(
        self,
        data: SFTData,
        step_ids: Callable[[int], list[int]],
        *,
        start: int,
        total: int,
        micro_batch: int,
        num_workers: int,
        pin_memory: bool,
    ):
        self.data, self.step_ids, self.total = data, step_ids, total
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.current: StepBatches | None = None
        self.misses = 0  # steps collated in process (tests and logs)
        self.miss_seconds = 0.0  # time spent collating misses in process (`take_miss_seconds`)
        self._it: Iterator[StepBatches] | None = None
        self._restart(start, micro_batch)

    def _restart(self, start: int, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        if start >= self.total:
            self._it = None
            return
        loader = DataLoader(
            _Steps(self.data, self.step_ids),
            sampler=_Keys(self, start, self.total),
            batch_size=None,
            collate_fn=_as_is,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=2 if self.num_workers else None,
            # Its own generator: iter() draws a base seed, which from the global one would shift dropout's
            # random numbers and break exact resume (tests/runner/checkpoint/test_resume.py, lora-dropout).
            generator=torch.Generator().manual_seed(0),
        )
        self._it = iter(loader)

    def close(self) -> None:
        """Stop the workers (the iterator's shutdown); batches() then collates in process."""
        self._it, self.current = None, None

    def batches(self, ids: Sequence[int], micro_batch: int) -> list[Batch]:
        ids = tuple(ids)
        if self.current is None or self.current.ids != ids:
            self.current = next(self._it, None) if self._it is not None else None
        item = self.current
        if item is not None and item.ids == ids and item.micro_batch == micro_batch:
            return list(item.batches)
        self.misses += 1
        t0 = time.perf_counter()
        if micro_batch != self.micro_batch:
            # A shrink (or a regrow): steps handed out from now on are collated at the new size; the ones the workers
            # hold at the old size become misses, collated here.
            log.info("data loader: micro-batch %d -> %d", self.micro_batch, micro_batch)
            self.micro_batch = micro_batch
        out = [self.data.collate(chunk) for chunk in micro_batches(ids, micro_batch)]
        self.miss_seconds += time.perf_counter() - t0
        return out

    def take_miss_seconds(self) -> float:
        """Seconds spent on misses since the last call (an OOM's recovery reports them)."""
        seconds, self.miss_seconds = self.miss_seconds, 0.0
        return seconds
