"""Streaming (runner/data/stream.py): the streamed steps are the prepared path's tokens in stream order, a restart at
any step gives the same samples without tokenizing what came before, several sources interleave by weight, the
reader stays flat in memory, and a real tiny-model run trains, checkpoints and resumes exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from jobspec.spec.loader import SpecError, parse_spec
from runner.data import stream as stream_mod
from runner.data.dataset import Batch, _rows, encode_file
from runner.data.mix import MixedOrder
from runner.data.prepare import CHUNK_RECORDS
from runner.data.stream import SourceStream, StreamData, load_stream
from runner.data.tokenizer import ByteTokenizer
from runner.data.tokens import Rows, pack_groups
from tests.runner.train_helpers import (
    ROOT,
    records,
    tiny_spec,
    tiny_spec_dict,
    train_and_resume,
    write_jsonl,
)

GB = 8


def chat_rows(n: int, seed: int = 0, tag: str = "") -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = " ".join(f"w{int(x)}" for x in rng.integers(0, 999, int(rng.integers(1, 12))))
        # every 7th has an empty response: no target, dropped by both paths
        out.append({"prompt": f"{tag}q{i} {words}", "response": "" if i % 7 == 3 else f"a{i} {words[:20]}"})
    return out


def stream_spec(tmp_path, data_file, **data):
    return tiny_spec(tmp_path / "run", data={"path": str(data_file), "streaming": True, "max_seq_len": 32, **data},
                     training={"global_batch": GB, "steps": 50})  # fmt: skip


def reference_rows(spec, order: np.ndarray | None = None) -> Rows:
    """The prepared path's rows of the whole file (cache off), records taken in `order` (default: file order)."""
    d = spec.data
    streams = encode_file(d.path, d, ByteTokenizer())
    which = np.arange(len(streams)) if order is None else order
    if not d.packing:
        return _rows(streams, which, d, "ref")
    kept = which[streams.trainable[which]]
    return Rows(streams, kept, pack_groups(streams.lengths[kept], d.max_seq_len))


def streamed(data: StreamData, steps) -> list[tuple[np.ndarray, np.ndarray]]:
    return [s.row() for step in steps for _, s in sorted(data.step_rows(step).items())]


def same_rows(a, b) -> None:
    assert len(a) == len(b)
    for k, ((x, y), (u, v)) in enumerate(zip(a, b, strict=True)):
        assert np.array_equal(x, u) and np.array_equal(y, v), k


@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
def test_streamed_steps_are_the_whole_files_rows_in_order(tmp_path, packing):
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(300))
    spec = stream_spec(tmp_path, path, packing=packing, shuffle_buffer=0)
    ref = reference_rows(spec)
    data = load_stream(spec, ByteTokenizer())
    try:
        steps = len(ref) // GB
        same_rows(streamed(data, range(steps)), ref[: steps * GB])
        # the next pass starts again at the first record: the pass's last row closed, no row joins two passes
        rest = len(ref) - steps * GB
        wrapped = streamed(data, [steps, steps + 1])
        same_rows(wrapped[:rest], ref[steps * GB :])
        same_rows(wrapped[rest : rest + 3], ref[:3])
    finally:
        data.close()


def test_packed_batches_carry_each_records_positions(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(120))
    spec = stream_spec(tmp_path, path, packing=True, shuffle_buffer=0)
    ref = reference_rows(spec)
    data = load_stream(spec, ByteTokenizer())
    try:
        batch: Batch = data.collate(list(range(GB, 2 * GB)))
        assert batch.position_ids is not None and batch.sample_ids == tuple(range(GB, 2 * GB))
        for r, i in enumerate(range(GB, 2 * GB)):
            n = len(ref[i][0])
            assert np.array_equal(batch.position_ids[r, :n].numpy(), ref.positions(i)), i
            assert np.array_equal(batch.input_ids[r, :n].numpy(), ref[i][0])
    finally:
        data.close()


def test_shuffle_is_the_seeded_window_permutation_of_the_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(250))
    spec = stream_spec(tmp_path, path, shuffle_buffer=64)
    order = np.concatenate([w * 64 + np.random.default_rng([spec.training.seed, stream_mod._WINDOW, 0, 0, w])
                            .permutation(min(64, 250 - w * 64)) for w in range(4)])  # fmt: skip
    ref = reference_rows(spec, order)
    data = load_stream(spec, ByteTokenizer())
    try:
        steps = len(ref) // GB
        got = streamed(data, range(steps))
        same_rows(got, ref[: steps * GB])
        assert not all(np.array_equal(a[0], b[0]) for a, b in zip(got, reference_rows(spec), strict=False))
    finally:
        data.close()


@pytest.mark.parametrize(("packing", "buffer", "suffix"), [(False, 0, "jsonl"), (True, 50, "jsonl"),
                                                          (True, 50, "parquet")])  # fmt: skip
def test_a_restart_at_step_k_gives_the_uninterrupted_streams_samples(tmp_path, packing, buffer, suffix, monkeypatch):
    rows = chat_rows(1500)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    if suffix == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
        path = tmp_path / "d.parquet"
    spec = stream_spec(tmp_path, path, packing=packing, shuffle_buffer=buffer)
    full = load_stream(spec, ByteTokenizer())  # writes the position index (rank 0)
    try:
        want = streamed(full, range(300))  # past the end of the first pass: into the second
    finally:
        full.close()
    for k in (1, 37, 64, 150, 299):
        again = load_stream(spec, ByteTokenizer(), write_index=False)
        try:
            same_rows(streamed(again, range(k, min(k + 3, 300))), want[k * GB : (k + 3) * GB])
        finally:
            again.close()
    tokenized = []
    real = stream_mod.render_chunk
    monkeypatch.setattr(stream_mod, "render_chunk", lambda t, chats, limit: tokenized.append(len(chats))
                        or real(t, chats, limit))  # fmt: skip
    fresh = load_stream(spec, ByteTokenizer(), write_index=False).streams[0]
    for c, how in ((2300, "index"), (2300, "replay")):
        tokenized.clear()
        if how == "replay":
            fresh.index.path = None
        first = next(fresh.samples(c))
        same_rows([first.row()], [want[c]])
        # From the index: the window of its entry, then at most INDEX_EVERY samples' records, a chunk at a time;
        # replayed: every record before sample c (about 1.5 a sample: a fifth has no target within 32 tokens).
        assert sum(tokenized) <= (c if how == "replay" else 2 * CHUNK_RECORDS) or how == "replay", tokenized
        assert how == "index" or sum(tokenized) > c


def test_several_sources_interleave_by_the_mixed_orders_draws(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", chat_rows(200, seed=1, tag="A"))
    b = write_jsonl(tmp_path / "b.jsonl", chat_rows(90, seed=2, tag="B"))
    sources = [{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}]
    section = {"sources": sources, "streaming": True, "max_seq_len": 32, "shuffle_buffer": 0}
    spec = tiny_spec(tmp_path / "run", data=section, training={"global_batch": GB, "steps": 9})
    refs = [reference_rows(spec.model_copy(update={"data": spec.data.model_copy(update={"path": p, "sources": None})}))
            for p in (str(a), str(b))]  # fmt: skip
    mix = MixedOrder([GB, GB], [3, 1], GB, spec.training.seed)
    data: StreamData = load_stream(spec, ByteTokenizer())
    try:
        got = streamed(data, range(60))
        resumed = load_stream(spec, ByteTokenizer(), write_index=False)
        late = streamed(resumed, range(41, 60))
        resumed.close()
    finally:
        data.close()
    want = []
    for step in range(60):
        src, draw = mix.draws(step)
        want += [refs[s][d % len(refs[s])] for s, d in zip(src.tolist(), draw.tolist(), strict=True)]
    same_rows(got[: 20 * GB], want[: 20 * GB])  # within the first pass of both sources
    same_rows(late, got[41 * GB :])
    assert data.order.step_counts(3).sum() == GB and set(data.source_counts(range(GB))) <= set(range(GB + 1))


def test_each_rank_collates_its_slice_of_the_same_steps(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(200))
    spec = stream_spec(tmp_path, path, shuffle_buffer=16)
    one = load_stream(spec, ByteTokenizer())
    ranks = [load_stream(spec, ByteTokenizer(), rank=r, world_size=2, write_index=False) for r in range(2)]
    try:
        for step in (0, 5, 6):
            whole = one.step_rows(step)
            for r, data in enumerate(ranks):
                mine = data.step_rows(step)
                assert sorted(mine) == list(range(step * GB + r * GB // 2, step * GB + (r + 1) * GB // 2))
                same_rows([s.row() for _, s in sorted(mine.items())], [whole[i].row() for i in sorted(mine)])
        assert all(np.array_equal(x[0], y[0]) for x, y in zip(ranks[0].train, ranks[1].train, strict=True))
    finally:
        for d in (one, *ranks):
            d.close()


def test_a_bad_record_stops_the_stream_with_its_line(tmp_path):
    rows = chat_rows(40)
    rows[33] = {"prompt": "q", "response": 7}
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    from jobspec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"d\.jsonl:34: 'response' is of type int"):
        data = load_stream(stream_spec(tmp_path, path, shuffle_buffer=0), ByteTokenizer())
        try:
            streamed(data, range(6))
        finally:
            data.close()


def test_stream_data_refuses_dataloader_workers(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(30))
    data = load_stream(stream_spec(tmp_path, path), ByteTokenizer())
    try:
        with pytest.raises(TypeError, match="num_workers 0"):
            import pickle

            pickle.dumps(data)
    finally:
        data.close()


def test_a_hub_id_is_streamed_not_downloaded_whole(tmp_path, monkeypatch):
    """The hub boundary faked: `load_dataset(name, streaming=True)` answered by the local json builder."""
    import datasets

    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(60))
    calls = []
    real = datasets.load_dataset

    def fake(name, **kw):
        calls.append((name, kw))
        return real("json", data_files={"train": str(path)}, **kw)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    spec = stream_spec(tmp_path, path, shuffle_buffer=0)
    hub = spec.model_copy(update={"data": spec.data.model_copy(update={"path": "org/chats"})})
    data = load_stream(hub, ByteTokenizer())
    try:
        same_rows(streamed(data, range(3)), reference_rows(spec)[: 3 * GB])
    finally:
        data.close()
    assert calls and all(c == ("org/chats", {"streaming": True}) for c in calls)


# --- spec --------------------------------------------------------------------------------------------------------


def parse(tmp_path, data, training):
    import yaml

    return parse_spec(yaml.safe_dump(tiny_spec_dict(tmp_path, data=data, training=training)))


@pytest.mark.parametrize(
    ("data", "training", "message"),
    [
        ({"streaming": True}, {"steps": None, "epochs": 2}, "training.epochs: cannot count passes over a stream"),
        ({"streaming": True}, {"steps": None}, "training.steps: is required with data.streaming"),
        ({"streaming": True, "eval_fraction": 0.1}, {}, "cannot hold out `data.eval_fraction`"),
        ({"shuffle_buffer": 8}, {}, "applies to `data.streaming: true` only"),
    ],
)
def test_spec_refuses_what_a_stream_cannot_do(tmp_path, data, training, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace("`", "`")):
        parse(tmp_path, data, training)


def test_spec_takes_streaming_with_steps(tmp_path):
    spec = parse(tmp_path, {"streaming": True, "eval_path": "e.jsonl", "shuffle_buffer": 0}, {})
    assert spec.data.streaming and spec.data.shuffle_buffer == 0
    assert parse(tmp_path, {"streaming": True, "eval_fraction": 0}, {}).data.eval_fraction == 0


# --- a real run ----------------------------------------------------------------------------------------------------


def test_a_streamed_run_trains_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBSPEC_RECORD_SAMPLES", "1")
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(150))
    evals = write_jsonl(tmp_path / "e.jsonl", chat_rows(20, seed=9))
    sections = {"data": {"path": str(path), "eval_path": str(evals), "streaming": True, "packing": True,
                         "shuffle_buffer": 32}, "training": {"micro_batch": 4, "steps": 8},
                "checkpoints": {"every_steps": 4}}  # fmt: skip
    full, part = train_and_resume(tmp_path, sections)
    assert (tmp_path / "full" / "step-8").is_dir()
    assert records(tmp_path / "part", "plan")[0]["step"] == 4
    a = {r["step"]: r["loss"] for r in records(tmp_path / "full")}
    b = {r["step"]: r["loss"] for r in records(tmp_path / "part")}
    assert sorted(b) == [5, 6, 7, 8] and all(b[s] == a[s] for s in b), (a, b)
    assert records(tmp_path / "full", "eval")  # the eval set from eval_path
    ids = [json.loads(x) for x in (tmp_path / "full" / "samples-rank0.jsonl").read_text().splitlines()]
    assert [r["ids"] for r in ids] == [list(range(s * 8, s * 8 + 8)) for s in range(8)]
    for (k, v), (_, w) in zip(full.model.state_dict().items(), part.model.state_dict().items(), strict=True):
        assert torch.equal(v, w), k


# --- memory -------------------------------------------------------------------------------------------------------

RSS_SCRIPT = """
import json, os, sys, threading, time
from runner.data.tokenizer import ByteTokenizer
from tests.runner.train_helpers import tiny_spec
run, path, mode = sys.argv[1:4]
spec = tiny_spec(run, data={"path": path, "streaming": mode == "stream", "max_seq_len": 64, "eval_fraction": 0},
                 training={"global_batch": 64, "steps": 10})
page = os.sysconf("SC_PAGE_SIZE")
def rss():  # resident bytes now (ru_maxrss is a lifetime peak: the imports' would hide what follows)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
peak, done = [rss()], threading.Event()
def sample():
    while not done.wait(0.005):
        peak[0] = max(peak[0], rss())
before = peak[0]
threading.Thread(target=sample, daemon=True).start()
if mode == "stream":
    from runner.data.stream import load_stream
    data = load_stream(spec, ByteTokenizer())
    n = sum(len(data.step_rows(s)) for s in range(int(sys.argv[4])))
    data.close()
else:
    from runner.data.dataset import load_data
    data = load_data(spec, ByteTokenizer())
    n = len(data.train)
    sum(int(x.sum()) for x, _ in data.train[::97])  # touch the rows, as training would
done.set()
print(json.dumps([n, (max(peak[0], rss()) - before) / 2**20]))
"""


def rss_growth_mb(tmp_path, path, mode, steps=0) -> tuple[int, float]:
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / mode), str(path), mode, str(steps)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    n, mb = json.loads(out.stdout.strip().splitlines()[-1])
    return n, mb


def test_streaming_memory_stays_flat_in_the_data_size(tmp_path):
    """A 200k-record stream read 1,000 steps (64k samples) in: peak RSS grows a few MB; 20k vs 200k records alike,
    while the prepared path holds the data (and grows with it)."""
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        for i in range(200_000):
            f.write(json.dumps({"prompt": f"question {i} " + "x" * (i % 200), "response": f"answer {i} " + "y" * 90})
                    + "\n")  # fmt: skip
    small = tmp_path / "small.jsonl"
    small.write_text("".join(big.read_text().splitlines(keepends=True)[:20_000]))
    n_small, grow_small = rss_growth_mb(tmp_path, small, "stream", 300)
    n_big, grow_big = rss_growth_mb(tmp_path, big, "stream", 1000)
    assert n_small == 300 * 64 and n_big == 1000 * 64
    assert grow_big < 40, grow_big
    assert grow_big < grow_small + 15, (grow_small, grow_big)
    _, grow_prepared = rss_growth_mb(tmp_path, big, "prepared")
    assert grow_prepared > grow_big + 20, (grow_prepared, grow_big)


def test_source_stream_passes_go_on_without_end(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(10))
    spec = stream_spec(tmp_path, path, shuffle_buffer=4)
    s = SourceStream(str(path), "data.path", spec.data, ByteTokenizer(), 1, 0, stream_mod.PositionIndex(None, False))
    got = [x.ids for x in (next(it) for it in [s.samples(0)] for _ in range(40))]
    assert len(got) == 40  # 9 trainable records a pass: four passes and more, each its own permutation
