"""Two data sources by weight through the real runner: it trains, a resume trains on exactly the same samples,
and metrics.jsonl reports each source's samples since the previous record."""

from __future__ import annotations

import json

import numpy as np

from jobspec.contract import EXIT_OK
from jobspec.report.metrics import MetricsFile
from runner.data.dataset import data_order, load_data
from runner.data.tokenizer import ByteTokenizer
from tests.runner.train_helpers import records, tiny_spec, train_and_resume, train_in_process, write_jsonl


def sources(tmp_path) -> dict:
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": f"say {i}", "response": f"{i} said"} for i in range(30)])
    code = write_jsonl(
        tmp_path / "code.jsonl",
        [{"messages": [{"role": "user", "content": f"add {i}"}, {"role": "assistant", "content": f"x += {i}"}]}
         for i in range(12)],
    )  # fmt: skip
    return {"sources": [{"path": str(chat), "weight": 3}, {"path": str(code), "name": "code"}], "eval_fraction": 0.1}


def sample_log(run) -> dict[int, list[int]]:
    """{step trained (1-based, as in metrics): ids}."""
    lines = (run / "samples-rank0.jsonl").read_text().splitlines()
    return {r["step"]: r["ids"] for r in map(json.loads, lines)}


def test_two_sources_train_resume_exactly_and_report_the_mix(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBSPEC_RECORD_SAMPLES", "1")  # every rank logs the ids it trained on, per step
    sections = {"data": sources(tmp_path), "training": {"micro_batch": 4, "steps": 8, "eval_every": 4},
                "checkpoints": {"every_steps": 4}}  # fmt: skip
    train_and_resume(tmp_path, sections)
    assert records(tmp_path / "part", "plan")[0]["step"] == 4

    full, part = sample_log(tmp_path / "full"), sample_log(tmp_path / "part")
    assert sorted(part) == [5, 6, 7, 8] and all(part[s] == full[s] for s in part)  # the same samples after a resume
    losses = {r["step"]: r["loss"] for r in records(tmp_path / "full")}
    assert all(r["loss"] == losses[r["step"]] for r in records(tmp_path / "part"))

    spec = tiny_spec(tmp_path / "full", **sections)
    data = load_data(spec, ByteTokenizer())
    assert data.offsets.tolist() == [0, 27, 38]  # 30 - 3 and 12 - 1 held out
    trained = np.concatenate([full[s] for s in range(1, 9)])
    assert set(data.source_counts(trained).tolist()) != {0}  # both sources trained on
    assert full[1] == data_order(spec, data).step_samples(0)

    mixes = [r["samples_by_source"] for r in records(tmp_path / "full")]
    assert len(mixes) == 8 and all(sum(m.values()) == 8 for m in mixes)  # log_every 1: one step each
    for step, mix in enumerate(mixes, start=1):
        assert mix == dict(zip(("chat.jsonl", "code"), data.source_counts(full[step]).tolist(), strict=True))
    read = list(MetricsFile(tmp_path / "full" / "metrics.jsonl").records())  # `jobspec report` keeps the field
    assert [r["samples_by_source"] for r in read if r["kind"] == "train"] == mixes
    assert records(tmp_path / "full", "eval")  # held-out rows of both sources evaluated


def test_the_mix_counts_every_step_between_records(tmp_path):
    sections = {"data": sources(tmp_path), "training": {"steps": 7, "log_every": 3}, "checkpoints": {"every_steps": 7}}
    code, _ = train_in_process(tiny_spec(tmp_path / "run", **sections))
    assert code == EXIT_OK
    rows = records(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 3, 6, 7]
    assert [sum(r["samples_by_source"].values()) for r in rows] == [8, 16, 24, 8]
    one = tiny_spec(tmp_path / "one", training={"steps": 2, "warmup_steps": 1}, checkpoints={"every_steps": 2})
    assert train_in_process(one)[0] == EXIT_OK
    assert "samples_by_source" not in records(tmp_path / "one")[0]  # one source: no mix to report
