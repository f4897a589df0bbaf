"""The prefetching loader: workers collate exactly what the loop would have collated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobspec.spec.loader import load_spec
from runner.data.dataset import DataOrder, load_data, micro_batches, rank_slice
from runner.data.loader import Prefetcher
from runner.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def setup():
    spec = load_spec(ROOT / "examples" / "quickstart.yaml", ["data.max_seq_len=64"])
    data = load_data(spec, load_tokenizer(None, 512))
    order = DataOrder(len(data.train), spec.training.global_batch, spec.training.seed)
    return data, lambda step: rank_slice(order.step_samples(step), 0, 1)


def same(a, b) -> bool:
    pairs = zip(a, b, strict=True)
    return all(torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels) for x, y in pairs)


@pytest.mark.parametrize("workers", [0, 1])
def test_workers_give_the_in_process_batches(setup, workers: int) -> None:
    data, step_ids = setup
    pre = Prefetcher(data, step_ids, start=3, total=8, micro_batch=4, num_workers=workers, pin_memory=False)
    for step in range(3, 8):
        ids = step_ids(step)
        expected = [data.collate(c) for c in micro_batches(ids, 4)]
        assert same(pre.batches(ids, 4), expected)
    assert pre.misses == 0


def test_a_shrink_collates_in_process_and_the_same_workers_go_on_at_the_new_micro_batch(setup) -> None:
    """No worker restart (it cost 7 steps of the tiny preset): steps handed to the workers at the old size are
    collated in process, every later one comes from the same workers at the new size."""
    data, step_ids = setup
    pre = Prefetcher(data, step_ids, start=0, total=12, micro_batch=8, num_workers=1, pin_memory=False)
    assert len(pre.batches(step_ids(0), 8)) == 2
    loader = pre._it
    redo = pre.batches(step_ids(0), 4)  # the same step after an OOM, smaller micro-batch
    assert len(redo) == 4 and pre.misses == 1 and same(redo, [data.collate(c) for c in micro_batches(step_ids(0), 4)])
    hits = []
    for step in range(1, 12):
        before = pre.misses
        batches = pre.batches(step_ids(step), 4)
        assert len(batches) == 4 and same(batches, [data.collate(c) for c in micro_batches(step_ids(step), 4)])
        hits.append(pre.misses == before)
    assert pre._it is loader  # the same iterator, the same worker
    assert pre.misses <= 1 + 3 and all(hits[3:])  # at most the prefetched steps (2 a worker, and the one asked for)
