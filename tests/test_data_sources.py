"""`data.sources` outside the training loop: spec errors at their line, credentials refused in every source's path,
the job length over all sources, the metrics reader's `samples_by_source`, and the runner's preflight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobspec.errors import ConfigError
from jobspec.plan.job_length import count_rows, job_length
from jobspec.report.metrics import MetricsFile, validate
from jobspec.spec.loader import load_spec, parse_spec
from tests.cli_helpers import refused_at_line

HEAD = """name: mix
model:
  preset: tiny
training:
  global_batch: 8
  epochs: 1
hardware:
  vendor: cpu
data:
"""


def write(tmp_path: Path, data: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(HEAD + data)
    return path


BAD = {  # data section -> (field, line, words in the message)
    "path and sources": ("  path: x.jsonl\n  sources:\n    - path: y.jsonl\n", "data", 9, "not both"),
    "empty list": ("  sources: []\n", "data.sources", 10, "at least 1"),
    "zero weight": ("  sources:\n    - path: a.jsonl\n    - path: b.jsonl\n      weight: 0\n",
                    "data.sources.1.weight", 13, "greater than 0"),
    "negative weight": ("  sources:\n    - path: a.jsonl\n      weight: -2\n", "data.sources.0.weight", 12,
                        "greater than 0"),
    "no path": ("  sources:\n    - weight: 2\n", "data.sources.0.path", 11, "missing"),
    "empty path": ("  sources:\n    - path: ''\n", "data.sources.0.path", 11, "at least 1"),
    "unknown key": ("  sources:\n    - path: a.jsonl\n      wieght: 2\n", "data.sources.0.wieght", 12, "weight"),
    "same name": ("  sources:\n    - {path: a.jsonl, name: chat}\n    - {path: b.jsonl, name: chat}\n",
                  "data.sources.1.name", 12, "already data.sources.0.name"),
    "blank name": ("  sources:\n    - {path: a.jsonl, name: ' '}\n", "data.sources.0.name", 11, "empty"),
    "credentials in a source path": ("  sources:\n    - path: a.jsonl\n    - path: https://bob:hunter22@example.com/d.jsonl\n",
                                     "data.sources.1.path", 12, "credential"),
    "token in a source path": ("  sources:\n    - path: https://example.com/d.jsonl?token=abcDEF123456ghiJKL789\n",
                               "data.sources.0.path", 11, "credential"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD), ids=str)
def test_a_bad_source_is_refused_at_its_line(case, tmp_path, capsys):
    data, field, line, words = BAD[case]
    path = write(tmp_path, data)
    err = refused_at_line(path, field, line, words, capsys)
    assert "hunter22" not in err and "ghiJKL789" not in err  # a credential is never echoed


def test_good_sources_load_and_default_names_may_repeat(tmp_path):
    spec = load_spec(write(tmp_path, "  sources:\n    - {path: x/a.jsonl, weight: 3}\n    - {path: y/a.jsonl}\n"
                                     "    - {path: org/chats, name: hub, format: messages}\n"))  # fmt: skip
    assert [s.weight for s in spec.data.sources] == [3.0, 1.0, 1.0]
    assert spec.data.train_sources("bundled")[2].format == "messages"


def rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": "a"}) + "\n" for i in range(n)))
    return path


def test_the_job_length_counts_every_source(tmp_path):
    a, b = rows(tmp_path / "a.jsonl", 105), rows(tmp_path / "b.jsonl", 59)
    spec = parse_spec(HEAD + f"  eval_fraction: 0.1\n  sources:\n    - path: {a}\n    - path: {b}\n      weight: 4\n")
    assert count_rows(spec) == (164, "2 data.sources")
    length = job_length(spec)
    assert length.steps == (105 - 10 + 59 - 5) // 8  # the runner holds out int(n x 0.1) of each source
    missing = parse_spec(HEAD + f"  sources:\n    - path: {a}\n    - path: {tmp_path / 'gone.jsonl'}\n")
    assert count_rows(missing)[0] is None and "data.sources[1].path" in count_rows(missing)[1]
    assert job_length(missing).steps is None


def test_the_metrics_reader_keeps_a_good_mix_and_skips_a_bad_one(tmp_path):
    good = {"kind": "train", "step": 3, "samples_by_source": {"chat": 12, "code": 4}}
    assert validate(good)[0] == good
    for bad in ({"chat": -1}, {"chat": 1.5}, {"chat": True}, [1, 2], "chat", {"c" * 300: 1},
                {str(i): 1 for i in range(65)}):  # fmt: skip
        record, why = validate({**good, "samples_by_source": bad})
        assert record is None and why.startswith("samples_by_source:"), why
    run = tmp_path / "run"
    run.mkdir()
    lines = [good, {**good, "step": 4, "samples_by_source": {"chat": "many"}}, {**good, "step": 5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    metrics = MetricsFile(run / "metrics.jsonl")
    assert [r["step"] for r in metrics.records()] == [3, 5]
    assert metrics.skipped.count == 1


def test_preflight_checks_every_source_path(tmp_path):
    from runner.process import preflight

    a = rows(tmp_path / "a.jsonl", 3)
    spec = parse_spec(HEAD + f"  sources:\n    - path: {a}\n    - path: {tmp_path / 'gone.jsonl'}\n")
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.path .*gone\.jsonl: no such file"):
        preflight.check(spec)
    assert preflight.data_sources(spec) == [("data.sources[0].path", str(a)),
                                            ("data.sources[1].path", str(tmp_path / "gone.jsonl"))]  # fmt: skip
