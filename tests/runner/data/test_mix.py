"""Several sources mixed by weight (runner/data/mix.py): proportions, exact resume, every row before a repeat, one
source unchanged, the rows of each source loaded side by side, and the cost of reaching a far step."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSource
from runner.data.dataset import DataOrder, data_order, load_data, total_steps
from runner.data.mix import BLOCK, ConcatRows, MixedOrder, source_names
from runner.data.tokenizer import ByteTokenizer
from tests.runner.train_helpers import tiny_spec, write_jsonl


def sources_of(order: MixedOrder, ids) -> np.ndarray:
    return np.searchsorted(order.offsets, np.asarray(ids), side="right") - 1


def ids_of(order, steps) -> np.ndarray:
    return np.concatenate([order.step_samples(s) for s in steps])


@pytest.mark.parametrize(
    ("weights", "global_batch"), [((3, 1), 64), ((1, 1, 2), 50), ((0.2, 5.0, 1.0, 0.8), 7)], ids=str
)
def test_each_source_gets_its_weights_share_over_10k_samples(weights, global_batch):
    order = MixedOrder([500, 37, 1000, 3][: len(weights)], weights, global_batch, seed=11)
    steps = range(10_000 // global_batch + 1)
    share = np.bincount(sources_of(order, ids_of(order, steps)), minlength=len(weights)) / (len(steps) * global_batch)
    np.testing.assert_allclose(share, np.asarray(weights) / sum(weights), atol=0.02)


def test_step_counts_are_the_sources_of_the_step_samples():
    order = MixedOrder([40, 13, 7], [1, 2, 3], 16, seed=0)
    for step in (0, 1, 57, BLOCK // 16 - 1, BLOCK // 16, 5000):
        np.testing.assert_array_equal(
            order.step_counts(step), np.bincount(sources_of(order, order.step_samples(step)), minlength=3)
        )


def test_an_order_rebuilt_at_any_step_gives_the_running_orders_ids():
    """A resume (or an OOM redo) rebuilds the order from scratch at step k: the same ids as the order that ran."""
    running = MixedOrder([300, 20, 111], [3, 1, 2], 24, seed=5)
    seen = {s: running.step_samples(s) for s in range(0, 3000)}  # crosses blocks of BLOCK slots
    for k in (0, 1, 682, 683, 684, 1500, 2999):
        assert MixedOrder([300, 20, 111], [3, 1, 2], 24, seed=5).step_samples(k) == seen[k], k
    back = MixedOrder([300, 20, 111], [3, 1, 2], 24, seed=5)
    for k in (2999, 10, 1500, 0):  # any order of asking: no state but caches
        assert back.step_samples(k) == seen[k]
    assert MixedOrder([300, 20, 111], [3, 1, 2], 24, seed=6).step_samples(0) != seen[0]


def test_a_step_wider_than_a_block_is_the_same_draws():
    """global_batch above BLOCK: a step spans several blocks; per source, the draws are consecutive."""
    order = MixedOrder([70_000, 50_000], [1, 1], BLOCK + 1000, seed=2)
    ids = ids_of(order, range(3))
    src = sources_of(order, ids)
    for s in (0, 1):
        rows = ids[src == s] - order.offsets[s]
        assert len(set(rows.tolist())) == len(rows)  # fewer draws than rows: no repeat yet


def test_every_source_goes_through_all_its_rows_before_repeating_one():
    sizes = [97, 10, 3]
    order = MixedOrder(sizes, [1, 3, 2], 8, seed=9)
    ids = ids_of(order, range(400))
    src = sources_of(order, ids)
    for s, n in enumerate(sizes):
        rows = ids[src == s] - order.offsets[s]
        full = len(rows) // n
        assert full >= 2, "the test must see a source repeat"
        for e in range(full):
            assert sorted(rows[e * n : (e + 1) * n].tolist()) == list(range(n)), (s, e)
        assert rows[:n].tolist() != rows[n : 2 * n].tolist()  # each epoch of a source has its own permutation


def test_one_source_is_exactly_data_order(tmp_path):
    """`data.path` and a one-entry `data.sources` give DataOrder, the ids existing runs and checkpoints rely on."""
    data_file = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(50)])
    for data in ({"path": str(data_file)}, {"sources": [{"path": str(data_file), "weight": 3.0}]}):
        spec = tiny_spec(tmp_path / "run", data={**data, "eval_fraction": 0.1})
        loaded = load_data(spec, ByteTokenizer())
        order = data_order(spec, loaded)
        assert type(order) is DataOrder
        reference = DataOrder(len(loaded.train), 8, spec.training.seed)
        assert [order.step_samples(s) for s in range(12)] == [reference.step_samples(s) for s in range(12)]
        # Pinned from the code before sources existed: the same rows held out, the same ids, the same rows behind them.
        assert order.step_samples(3) == [10, 3, 38, 41, 17, 30, 6, 15]  # seed 42
        assert loaded.train[3][0][:6].tolist() == [257, 260, 113, 52, 261, 97]  # "q4": rows 0-3 kept, so 4 is


def text_of(row) -> str:
    """The bytes of a row's ids (ByteTokenizer: an id under 256 is that byte; its markers are left out)."""
    return bytes(i for i in row[0].tolist() if i < 256).decode(errors="replace")


def write_source(path, n, tag):
    return write_jsonl(path, [{"prompt": f"{tag} question {i}", "response": f"{tag} answer {i}"} for i in range(n)])


def test_load_data_puts_the_sources_side_by_side(tmp_path):
    a = write_source(tmp_path / "a.jsonl", 40, "alpha")
    chat = [[{"role": "user", "content": f"beta {i}"}, {"role": "assistant", "content": "ok"}] for i in range(20)]
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": m} for m in chat])
    spec = tiny_spec(tmp_path / "run", data={"eval_fraction": 0.1,
                     "sources": [{"path": str(a), "weight": 3}, {"path": str(b), "format": "messages"}]})  # fmt: skip
    data = load_data(spec, ByteTokenizer())
    assert data.sources == ("a.jsonl", "b.jsonl")
    assert data.offsets.tolist() == [0, 36, 54]  # 10% of each source held out: 4 and 2
    assert len(data.eval) == 6
    text = text_of(data.train[0])
    assert "alpha" in text and "beta" not in text
    assert "beta" in text_of(data.train[40])
    np.testing.assert_array_equal(data.source_counts([0, 35, 36, 53, 1]), [3, 2])
    order = data_order(spec, data)
    assert isinstance(order, MixedOrder)
    assert order.steps_per_epoch == 54 // 8
    assert total_steps(spec.model_copy(update={"training": spec.training.model_copy(update={"steps": None})}),
                       order) == 54 // 8  # fmt: skip
    again = load_data(spec, ByteTokenizer())
    assert [again.train[i][0].tolist() for i in range(54)] == [data.train[i][0].tolist() for i in range(54)]
    # evaluation takes one held-out row of each source in turn: a budget of 2 rows already measures both
    assert data.eval_order() == [0, 4, 1, 5, 2, 3]
    assert ["alpha" in text_of(data.eval[i]) for i in data.eval_order()[:2]] == [True, False]


def test_each_source_is_packed_on_its_own(tmp_path):
    a, b = write_source(tmp_path / "a.jsonl", 30, "alpha"), write_source(tmp_path / "b.jsonl", 30, "beta")
    spec = tiny_spec(tmp_path / "run", data={"packing": True, "eval_fraction": 0.0,
                     "sources": [{"path": str(a)}, {"path": str(b)}]})  # fmt: skip
    data = load_data(spec, ByteTokenizer())
    assert len(data.train) < 60 and data.train.packed
    for i in range(len(data.train)):
        text = text_of(data.train[i])
        assert ("alpha" in text) != ("beta" in text), text  # no row joins two sources
    ids = data_order(spec, data).step_samples(0)
    batch = data.collate(ids)  # the collate of packed rows reads each id in its own source's rows
    assert batch.input_ids.shape[0] == 8 and batch.sample_ids == tuple(ids)
    for r, i in enumerate(ids):
        n = len(data.train[i][0])
        assert batch.input_ids[r, :n].tolist() == data.train[i][0].tolist()


def test_a_source_left_without_training_rows_is_named(tmp_path):
    a = write_source(tmp_path / "a.jsonl", 40, "alpha")
    # The prompt fills max_seq_len 64: no response token left to learn, the record is dropped.
    empty = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "q" * 200, "response": "a"}] * 3)
    spec = tiny_spec(tmp_path / "run", data={"sources": [{"path": str(a)}, {"path": str(empty)}]})
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.path .*b\.jsonl: no training rows"):
        load_data(spec, ByteTokenizer())


def test_a_bad_record_in_a_source_names_its_field_file_and_line(tmp_path):
    a = write_source(tmp_path / "a.jsonl", 4, "alpha")
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "q", "response": "a"}\n{"prompt": 3, "response": "a"}\n')
    spec = tiny_spec(tmp_path / "run", data={"sources": [{"path": str(a)}, {"path": str(bad)}]})
    with pytest.raises(ConfigError, match=r"b\.jsonl:2: .*prompt"):
        load_data(spec, ByteTokenizer())
    spec = tiny_spec(tmp_path / "run", data={"sources": [{"path": str(a)}, {"path": str(tmp_path / "gone.jsonl")}]})
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.path .*gone\.jsonl: no such file"):
        load_data(spec, ByteTokenizer())


def test_global_batch_over_all_rows_is_refused():
    with pytest.raises(ConfigError, match="global_batch 64 is larger than the 30 training rows"):
        MixedOrder([20, 10], [1, 1], 64, seed=0)


def test_source_names_default_to_the_file_and_are_made_unique():
    sources = [DataSource(path="x/train.jsonl"), DataSource(path="y/train.jsonl"), DataSource(path="org/chats"),
               DataSource(path="z/c.jsonl", name="train.jsonl#3"), DataSource(path="w/train.jsonl"),
               DataSource(path="/data/dir/")]  # fmt: skip
    assert source_names(sources) == ["train.jsonl", "train.jsonl#2", "chats", "train.jsonl#3", "train.jsonl#4", "dir"]


def test_concat_rows_reads_each_part():
    parts = [[(np.array([1]), np.array([1]))] * 3, [], [(np.array([2]), np.array([2]))] * 2]
    rows = ConcatRows(parts)
    assert len(rows) == 5 and rows.offsets.tolist() == [0, 3, 3, 5]
    assert [int(x[0]) for x, _ in rows] == [1, 1, 1, 2, 2] == [int(rows[i][0][0]) for i in range(5)]
    assert int(rows[-1][0][0]) == 2 and len(rows[1:4]) == 3
    with pytest.raises(IndexError):
        rows[5]


def test_a_far_step_costs_milliseconds_not_a_replay():
    """Resume at step 1,000,000 of 3 sources: a few vectorized draws, not a million steps of work."""
    sizes, weights = [200_000, 50_000, 5_000], [5, 3, 2]
    near, far = MixedOrder(sizes, weights, 64, seed=1), MixedOrder(sizes, weights, 64, seed=1)
    near.step_samples(10)
    t0 = time.perf_counter()
    far.step_samples(1_000_000)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    far.step_samples(1_000_001)
    after = time.perf_counter() - t0
    assert first < 2.0 and after < 0.05, (first, after)  # measured ~25 ms and ~0.1 ms on 2 shared cores
