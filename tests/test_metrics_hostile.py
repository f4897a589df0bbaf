"""`jobspec report` and `jobspec plan --from` on a metrics.jsonl someone else wrote: hostile values and lines are
skipped and counted (or the file refused with exit 2 naming file:line when nothing usable remains), special
files are refused without a read, and a long run is summarised in bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from jobspec.cli import main
from jobspec.plan import calibration
from jobspec.report import load_run
from jobspec.report.metrics import MAX_LINE_BYTES, MetricsFile, loads, validate
from jobspec.report.summary import BoundedSample, StepSeries

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "sft_fast.yaml"
GiB = 1024**3


def plan(step: int = 0, tier: str = "fast") -> dict[str, Any]:
    return {"time": 1.0, "kind": "plan", "step": step, "tier": tier, "micro_batch": 4, "grad_accum": 1,
            "world_size": 1, "global_batch": 4, "total_steps": 10, "device": "cuda", "precision": "bf16"}  # fmt: skip


def train(step: int, **extra: Any) -> dict[str, Any]:
    return {"time": 1.0 + step, "kind": "train", "step": step, "total_steps": 10, "loss": 2.0 / step, "lr": 1e-4,
            "tier": "fast", "micro_batch": 4, "grad_accum": 1, "world_size": 1, "global_batch": 4,
            "tokens_per_s": 1000.0 + step, "mem_used_bytes": GiB + step, "mem_total_bytes": 2 * GiB,
            **extra}  # fmt: skip


def good_lines(steps: int = 10) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in [plan(), *(train(s) for s in range(1, steps + 1))]).encode()


def run_dir(tmp_path: Path, data: bytes) -> Path:
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    (d / "metrics.jsonl").write_bytes(data)
    return d


def deep(n: int) -> bytes:
    return b'{"kind":"train","step":11,"x":' + b"[" * n + b"]" * n + b"}"


T11 = '{"time": 20.0, "kind": "train", "step": 11, "tier": "fast", "micro_batch": 4, "loss": %s, "mem_used_bytes": %s}'
HOSTILE: dict[str, bytes] = {
    "nan": (T11 % ("NaN", "1")).encode(),
    "infinity": (T11 % ("Infinity", "1")).encode(),
    "minus-infinity": (T11 % ("-Infinity", "1")).encode(),
    "float-overflow": (T11 % ("1e999", "1")).encode(),
    "int-5000-digits": (T11 % ("1.0", "9" * 5000)).encode(),
    "int-4000-digits": (T11 % ("1.0", "9" * 4000)).encode(),
    "negative-int-4000": (T11 % ("-" + "9" * 4000, "1")).encode(),
    "string-for-number": (T11 % ('"low"', "1")).encode(),
    "string-step": b'{"kind": "train", "step": "11", "loss": 1.0}',
    "null-step": b'{"kind": "train", "step": null, "loss": 1.0}',
    "bool-step": b'{"kind": "train", "step": true, "loss": 1.0}',
    "float-micro-batch": b'{"kind": "train", "step": 11, "tier": "fast", "micro_batch": 2.5}',
    "zero-micro-batch": b'{"kind": "train", "step": 11, "tier": "fast", "micro_batch": 0}',
    "list-tier": b'{"kind": "train", "step": 11, "tier": ["fast"], "micro_batch": 4}',
    "object-time": b'{"kind": "train", "step": 11, "time": {"t": 1}}',
    "negative-time": b'{"kind": "train", "step": 11, "time": -1e308}',
    "huge-float-bytes": b'{"kind": "train", "step": 11, "mem_used_bytes": 1e300}',
    "plan-garbage": b'{"kind": "plan", "step": "x", "tier": {"t": 1}, "micro_batch": "8"}',
    "event-garbage": b'{"kind": "event", "event": "oom_shrink", "step": "x", "from_micro_batch": "a"}',
    "eval-garbage": b'{"kind": "eval", "step": 11, "eval_loss": "NaN"}',
    "kind-number": b'{"kind": 5, "step": 11}',
    "no-kind": b'{"step": 11}',
    "deep-5000": deep(5000),
    "deep-100k-open": b"[" * 100_000,
    "array": b"[1, 2, 3]",
    "number": b"42",
    "string": b'"train"',
    "null": b"null",
    "binary": (bytes(range(256)) + os.urandom(512)).replace(b"\n", b" "),
    "utf-16": '{"kind": "train", "step": 11}'.encode("utf-16"),
    "long-line": b'{"kind": "train", "step": 11, "tier": "' + b"x" * (MAX_LINE_BYTES + 10) + b'"}',
    "long-string": b'{"kind": "train", "step": 11, "tier": "' + b"x" * 10_000 + b'"}',
    "truncated": b'{"time": 30.0, "kind": "tra',
}


@pytest.mark.parametrize("line", HOSTILE.values(), ids=HOSTILE.keys())
def test_report_skips_a_hostile_line_and_counts_it(line: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    d = run_dir(tmp_path, good_lines() + line + b"\n" + (json.dumps(train(12)) + "\n").encode())
    out = tmp_path / "out"
    assert main(["report", str(d), "--out", str(out)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    md = (out / "report.md").read_text()
    assert "line 12 of metrics.jsonl" in md and "1 line ignored" in md
    assert f"Final train loss | {2.0 / 12:.4f} (step 12)" in md  # the records after it still count
    run = load_run(d)
    assert run.unreadable == [12] and run.skipped.count == 1 and [r["step"] for r in run.train][-2:] == [10, 12]


@pytest.mark.parametrize("line", HOSTILE.values(), ids=HOSTILE.keys())
def test_plan_from_skips_a_hostile_line(line: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    d = run_dir(tmp_path, good_lines() + line + b"\n")
    assert main(["plan", str(SPEC), "--from", str(d)]) in (0, 4)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "measured (--from)" in captured.out
    fast = calibration.read_run(d)["fast"]
    assert fast.records == 10 and fast.peak_bytes == GiB + 10  # the ten good train records, not the hostile one


@pytest.mark.parametrize("command", ["report", "plan"])
@pytest.mark.parametrize(
    "data",
    [b"".join(HOSTILE[k] + b"\n" for k in ("binary", "nan", "deep-5000", "array")), HOSTILE["int-5000-digits"]],
    ids=["garbage", "one-bad-line"],
)
def test_nothing_usable_is_refused_with_exit_2_naming_file_and_line(command, data, tmp_path, capsys):
    d = run_dir(tmp_path, data)
    argv = ["report", str(d)] if command == "report" else ["plan", str(SPEC), "--from", str(d)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{d / 'metrics.jsonl'}:1: " in err and "no usable record" in err and "Traceback" not in err


def special(kind: str, d: Path) -> None:
    path = d / "metrics.jsonl"
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "dev-urandom":
        path.symlink_to("/dev/urandom")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link-out":
        (d.parent / "elsewhere.jsonl").write_bytes(good_lines())
        path.symlink_to(d.parent / "elsewhere.jsonl")
    elif kind == "dangling-link":
        path.symlink_to(d / "nothing-here")
    elif kind == "link-loop":
        path.symlink_to(path)


@pytest.mark.parametrize("command", ["report", "plan"])
@pytest.mark.parametrize("kind", ["dev-zero", "dev-urandom", "fifo", "directory", "link-out", "dangling-link",
                                  "link-loop"])  # fmt: skip
def test_a_special_metrics_file_exits_2_naming_it_without_reading(command: str, kind: str, tmp_path: Path):
    """In a subprocess with a timeout: before, /dev/zero and a FIFO made `plan --from` read (or wait) without end."""
    d = tmp_path / "run"
    d.mkdir()
    special(kind, d)
    argv = ["report", str(d)] if command == "report" else ["plan", str(SPEC), "--from", str(d)]
    result = subprocess.run([sys.executable, "-m", "jobspec", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert str(d / "metrics.jsonl") in result.stderr and "Traceback" not in result.stderr


def test_a_link_inside_the_run_directory_is_followed(tmp_path: Path):
    d = run_dir(tmp_path, good_lines())
    (d / "metrics.jsonl").rename(d / "real.jsonl")
    (d / "metrics.jsonl").symlink_to("real.jsonl")
    assert len(load_run(d).train) == 10


def test_a_hostile_tier_state_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    d = run_dir(tmp_path, good_lines())
    for state in (b"[" * 5000, b'{"failed": [1, "x", {"tier": 5}], "exhausted": "yes"}', b"\xff\x00"):
        (d / "tier_state.json").unlink(missing_ok=True)
        (d / "tier_state.json").write_bytes(state)
        run = load_run(d)
        assert run.tier_failures == {} and run.exhausted is False
    (d / "tier_state.json").unlink()
    (d / "tier_state.json").symlink_to("/dev/zero")
    assert load_run(d).tier_failures == {} and "tier_state.json" in caplog.text


def test_a_file_growing_while_read_is_read_to_its_size_at_open(tmp_path: Path):
    d = run_dir(tmp_path, good_lines())
    source = MetricsFile(d / "metrics.jsonl")
    records = source.records()
    first = next(records)
    with (d / "metrics.jsonl").open("ab") as f:  # a live run (or an attacker) appending while it is read
        f.write((json.dumps(train(99)) + "\n").encode() * 1000)
    assert [first, *records][-1]["step"] == 10 and source.usable == 11


def test_a_long_line_is_skipped_without_being_held(tmp_path: Path):
    d = run_dir(tmp_path, b'{"kind": "train", "step": 1, "tier": "' + b"x" * (20 * 1024**2) + b'"}\n' + good_lines())
    tracemalloc.start()
    records = list(MetricsFile(d / "metrics.jsonl").records())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(records) == 11 and peak < 4 * MAX_LINE_BYTES  # the 20 MB line was never in memory


def test_a_long_run_is_summarised_in_bounded_memory(tmp_path: Path):
    """30,000 steps (about 10 MB): the reader keeps at most MAX_POINTS points a series, not every record."""
    lines = [json.dumps(plan())] + [json.dumps(train(s)) for s in range(1, 30_001)]
    d = run_dir(tmp_path, ("\n".join(lines) + "\n").encode())
    tracemalloc.start()
    run = load_run(d)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * 1024**2  # the records alone are ~60 MB as dicts
    assert run.train_series.count == 30_000 and len(run.train) <= 2000 and run.train[-1]["step"] == 30_000
    peak_record = max((b.peak for b in run.train_series.buckets if b.peak), key=lambda r: r["mem_used_bytes"])
    assert peak_record["step"] == 30_000  # the exact peak survives the thinning


def test_step_series_thins_by_buckets_and_rewinds_on_a_resume():
    series = StepSeries(cap=64)
    for step in range(1, 10_001):
        series.add({"step": step, "loss": 1.0, "mem_used_bytes": step % 777})
    assert len(series.buckets) <= 64 and series.count == 10_000 and series.stride == 256
    assert max(v for _, v in series.points("mem_used_bytes")) == 776  # a peak, not a sample
    assert all(v == 1.0 for _, v in series.points("loss"))
    for step in range(5_001, 6_001):  # a resume from step 5,000 redoes the steps after it
        series.add({"step": step, "loss": 2.0})
    steps = [r["step"] for r in series.records]
    assert steps == sorted(steps) and steps[-1] == 6_000 and 5_000 < series.count <= 6_000
    exact = StepSeries(cap=64)
    for step in (1, 2, 3, 2, 3):  # while it fits, exact: the later record of a step wins
        exact.add({"step": step, "loss": float(step * 10)})
    assert [r["step"] for r in exact.records] == [1, 2, 3] and exact.count == 3


def test_bounded_sample_is_exact_while_it_fits_and_bounded_after():
    sample = BoundedSample(cap=100)
    for v in range(100):
        sample.add(float(v))
    assert sample.values == [float(v) for v in range(100)]
    for v in range(100, 100_000):
        sample.add(float(v))
    assert len(sample.values) <= 100 and sample.count == 100_000 and 40_000 < sorted(sample.values)[50] < 60_000


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ({"kind": "train", "step": 1, "loss": float("inf")}, "loss: inf is out of range"),
        ({"kind": "train", "step": 1, "micro_batch": True}, "micro_batch: expected an integer, got a boolean"),
        ({"kind": "train", "step": 1, "lr": -1.0}, "lr: -1 is out of range"),
        ({"kind": "train", "step": 1, "gpu_util": 250}, "gpu_util: 250 is out of range"),
        ({"kind": "plan", "tier": "x" * 65}, "tier: a string of 65 characters"),
        ({"kind": "plan", "checkpointing": "yes"}, "checkpointing: expected a boolean, got a string"),
        ({"kind": "eval"}, "step: missing from a eval record"),
        ([], "not a JSON object but a list"),
    ],
)
def test_validate_names_the_field_and_why(record: Any, why: str):
    assert validate(record)[0] is None and validate(record)[1].startswith(why)


def test_validate_keeps_known_fields_and_drops_the_rest():
    rec, why = validate({"kind": "train", "step": 3, "loss": 1.5, "gpu_util": None, "x": [[["deep"]]], "reasons": []})
    assert why == "" and rec == {"kind": "train", "step": 3, "loss": 1.5}


def test_loads_refuses_before_python_builds_it():
    assert loads(b"9" * 5000)[1] == "an integer of 5,000 digits"
    assert loads(b"[NaN]")[1] == "NaN is not a finite number"
    assert loads(b"[" * 50_000)[1] == "nested deeper than any record"
    assert loads(b"\xff")[1].startswith("not UTF-8 text")
    assert loads(b'{"a": 1}') == ({"a": 1}, "")
