"""Micro-batches collated ahead of the training loop by DataLoader workers, pinned when the plan says so.

A step's samples are a pure function of (seed, step), so the workers can collate the next steps while
the GPU trains on this one. The plan sizes `num_workers` and `pin_memory` from the container's CPUs and
memory (runner/sizing/hostmem.py). Item `step` of the loader is this rank's micro-batches of that step at the
plan's micro-batch; when the loop asks for something else (an OOM shrink redoing a step with a smaller
micro-batch), it collates in process and restarts the workers at the new micro-batch for later steps.
"""

from __future__ import annotations

import logging
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
    def __init__(self, data: SFTData, step_ids: Callable[[int], list[int]], micro_batch: int):
        self.data, self.step_ids, self.micro_batch = data, step_ids, micro_batch

    def __getitem__(self, step: int) -> StepBatches:
        ids = self.step_ids(step)
        batches = tuple(self.data.collate(chunk) for chunk in micro_batches(ids, self.micro_batch))
        return StepBatches(step, self.micro_batch, tuple(ids), batches)


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
        self._it: Iterator[StepBatches] | None = None
        self._restart(start, micro_batch)

    def _restart(self, start: int, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        if start >= self.total:
            self._it = None
            return
        loader = DataLoader(
            _Steps(self.data, self.step_ids, micro_batch),
            sampler=range(start, self.total),
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
        if item is not None and item.ids == ids and micro_batch != self.micro_batch:
            # A shrink: the workers are collating later steps at the old micro-batch; restart them.
            log.info("data loader: micro-batch %d -> %d from step %d", self.micro_batch, micro_batch, item.step + 2)
            self._restart(item.step + 1, micro_batch)
        return [self.data.collate(chunk) for chunk in micro_batches(ids, micro_batch)]
