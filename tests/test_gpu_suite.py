"""The GPU proof suite (bench/gpu) cannot rot between GPU sessions: its CPU smoke runs every part here.

`python -m bench.gpu --smoke` trains the tiny preset for real (probe steps through JOBSPEC_FAULT_OOM's
`probes` rule, an OOM squeeze by fault injection, the trace of the runner's step, runner vs plain loop, every
one-rank tier), each part in a process of its own as on the GPU, and must write the same JSON keys and
Markdown sections as a GPU run, GPU-only figures null / "n/a (CPU)". Every spec the suite builds is built and
validated here for the GPU's sizes too, and a part that overruns its budget is ended, marked, and followed by
the next one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bench.gpu import calibrate, common, device, prepare, report, suite
from jobspec.catalog.presets import PRESETS
from jobspec.plan import memory
from jobspec.spec.models import JobSpec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, float]:
    out = tmp_path_factory.mktemp("gpu-suite")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "gpu-suite-smoke.json").read_text())
    print(f"\n--smoke: {wall:.1f} s; per part {record['seconds']}")
    return record, (out / "gpu-suite-smoke.md").read_text(), wall


@pytest.mark.slow
def test_smoke_writes_every_section_with_cpu_figures(smoke) -> None:
    record, md, wall = smoke
    assert tuple(record) == report.KEYS and record["parts"] == list(common.PART_ORDER) == list(report.PARTS)
    assert all(record[k] is not None for k in report.KEYS), [k for k in report.KEYS if record[k] is None]
    for title in report.SECTIONS.values():
        assert f"\n{title}\n" in md
    assert "n/a (CPU)" in md and "Not run in this call" not in md
    assert record["environment"]["driver"] is None and record["environment"]["peak_tflops"] is None
    assert record["environment"]["device"].startswith("cpu") and record["environment"]["torch_threads"] == 1
    budgets = common.Config.cpu_smoke().budgets
    for part in common.PART_ORDER:  # each part in its own process, within its budget
        assert record["status"][part]["status"] == "ok" and record["status"][part]["exit_code"] == 0, record["status"]
        assert 0 < record["seconds"][part] < budgets[part]
    assert wall < 180, f"--smoke took {wall:.0f} s; it is meant to take under a minute"

    tests = record["gpu_tests"]  # pytest -m gpu collected the gpu tests and skipped them all here
    assert tests["exit_code"] == 0 and tests["total"] >= 3 and tests["skipped"] == tests["total"]
    assert tests["files"][0] == "tests/runner/oom/test_oom_gpu.py" and not tests["interrupted"]
    assert record["userpath"]["status"].startswith("skipped in --smoke")  # tests/runner/oom/test_user_path.py


@pytest.mark.slow
def test_smoke_memory_part_compares_formula_trace_and_the_runners_probe_search(smoke) -> None:
    record = smoke[0]
    sizing = {s["tier"]: s for s in record["sizing"]}
    assert set(sizing) == {"fast", "zero2_offload"}
    for s in sizing.values():  # JOBSPEC_FAULT_OOM="mbs>5,probes": the largest divisor of 24 that fits is 4
        assert s["status"] == "ok", s
        assert s["model_micro_batch"] == 24 and s["verified_micro_batch"] == 4 == s["exhaustive_micro_batch"]
        assert s["verify_probes"] <= s["probe_bound"] and s["verified_over_exhaustive"] == 1.0
        assert {p["micro_batch"] for p in s["probes"] if not p["ok"]} >= {6, 24}
    assert {m["tier"] for m in record["memory_model"]} == {"fast", "zero2_offload"}
    for m in record["memory_model"]:
        assert m["predicted"]["total"] > m["predicted"]["states"] > 0
        assert m["measured"]["device_peak"] is None and m["error_device"] is None and m["measured"]["oom"] is None
        # the trace of the runner's step at the same micro-batch: the formula is fitted to it
        assert m["trace"]["peak"] > 0 and 0.5 < m["formula_over_trace"] < 2, m["trace"]
        assert m["error_trace_allocated"] is None  # no allocator to measure on the CPU
    assert record["calibration"]["status"].startswith("no GPU measurements")


@pytest.mark.slow
def test_smoke_recovery_throughput_tiers_soak(smoke) -> None:
    from bench import throughput
    record = smoke[0]
    rec = {r["scenario"]: r for r in record["recovery"]}
    shrink, down = rec["shrink"], rec["step-down"]
    assert shrink["ok"] and shrink["steps_lost"] == [0] and shrink["same_samples"]
    assert shrink["runs"][0]["shrinks"] == ["8->4", "4->2"] and shrink["median_recovery_s"] > 0
    assert down["ok"] and down["steps_lost"] == [0] and down["same_samples"]
    assert [(t["from"], t["to"]) for t in down["runs"][0]["tier_changes"]] == [("fast", "zero2_offload")]
    assert down["runs"][0]["final_tier"] == "zero2_offload" and down["runs"][0]["steps_done"] == 7
    assert "skipped" in rec["relaunch"]["runs"][0]
    sweep = record["oom_anywhere"]  # bench/oom_anywhere.py where the checkout has it, else a recorded reason
    if sweep["status"] == "ok":
        assert isinstance(sweep["points"], int) and isinstance(sweep["recovered"], int) and sweep["matrix_md"]
        assert sweep["budget_s"] <= common.Config.cpu_smoke().sweep_budget_s
    else:
        assert sweep == {"status": "not available in this checkout (no bench/oom_anywhere.py)"}

    tp = record["throughput"]
    assert tp["runner"]["median_tokens_per_s"] > 0 and tp["plain"]["median_tokens_per_s"] > 0
    assert tp["runner"]["mfu"] is None and tp["ratio_of_medians"] > 0 and tp["rounds"] == 3
    assert record["sides"]["budget_s"] <= record["status"]["throughput"]["budget_s"]
    sides, lora = record["sides"]["rows"]  # bench/throughput.py: runner, plain loop and HF Trainer, interleaved, first
    assert sides["row"] == "tiny" and sides["seq_len"] == 128 and sides["seconds"] > 0
    assert lora["row"] == "llama-tiny-lora" and lora["flops_formula"].startswith("4N + 2T_lora"), lora.get("status")
    assert lora["runner"]["median_tokens_per_s"] > 0 and lora["lora"] == list(throughput.ALL_PROJECTIONS)
    assert sides["rounds"] >= 1 and sides["flops_formula"] == "6N + 6*L*C*T (llm.c)"
    assert all(sides[s]["median_tokens_per_s"] > 0 for s in ("runner", "plain", "trainer"))
    assert sides["runner_over_plain"] > 0 and sides["runner_over_trainer_paired"] > 0
    assert [r["first"] for r in sides["per_round"][:2]] == ["runner", "plain"]  # the first side alternates
    tiers = {t["tier"]: t for t in record["tiers"]}
    assert tiers["fast"]["ratio_to_fast"] == 1.0 and all(t["tokens_per_s"] > 0 for t in tiers.values())
    soak = record["soak"]
    assert soak["steps"] == soak["steps_asked"] == 20 and soak["runner_shrinks"] == 0
    assert soak["vram_pct_device"] is None and soak["allocator_ooms"] is None


@pytest.mark.parametrize("sizes", ["gpu", "cpu_smoke"])
def test_every_spec_the_suite_builds_is_valid(tmp_path, sizes) -> None:
    """The H100 run of 2026-11-25 lost its throughput part to a spec the CPU smoke never built (the GPU's
    target_utilization 0.45, below the field's floor 0.5): every spec, at the GPU's sizes too, is built here."""
    cfg = getattr(common.Config, sizes)()
    data = common.write_data(tmp_path / "data.jsonl", rows=4, seq=cfg.seq)
    built = dict(suite.specs(cfg, tmp_path, data))
    expected = {"recovery", "relaunch", "userpath", "runner vs plain", "soak", *(f"tier speed {t}" for t in cfg.tiers),
                *(f"sides {r}" for r in cfg.sides_rows),
                *(f"memory {p} {t}" for p in cfg.memory_presets for t in cfg.memory_tiers)}  # fmt: skip
    assert set(built) == expected and all(isinstance(s, JobSpec) for s in built.values())
    for name, spec in built.items():
        assert spec.hardware.vendor == ("cuda" if sizes == "gpu" else "cpu"), name
        assert spec.model.preset in PRESETS, name
    assert built["runner vs plain"].memory.target_utilization == 0.5  # the floor: the plain twin shares the GPU
    if sizes == "gpu":
        assert {s.model.preset for n, s in built.items() if n.startswith("memory")} == {"gpt2-small"}
        assert built["userpath"].model.preset == "llama-1b" and built["userpath"].memory.tier == "fast"
        full, lora = built["sides llama-1b"], built["sides llama-8b-lora"]  # issue 42's rows: seq 2048, bf16
        assert (full.data.max_seq_len, full.training.precision, full.model.lora) == (2048, "bf16", None)
        assert (full.training.global_batch, full.training.micro_batch) == (16, 4)
        assert (lora.model.preset, lora.model.lora.rank, lora.data.max_seq_len) == ("llama-8b", 16, 2048)


def test_the_user_path_caps_leave_zero2_offload_room_and_fast_none() -> None:
    """The step-down squeeze of bench/gpu/userpath.py: between what zero2_offload and fast need at micro-batch 1."""
    from bench.gpu import userpath
    from jobspec.spec.loader import parse_spec

    setup = userpath.Setup.gpu()
    spec = parse_spec(yaml.safe_dump(userpath.spec_dict(setup, Path("/tmp/run"))))
    est = userpath.estimates(setup, spec)
    cap = userpath.step_down_cap(est)
    assert est["zero2_offload_mbs1"] + 4 * 1024**3 < cap < 0.8 * est["fast_mbs1"]  # margins either side


def test_gpu_budgets_fit_one_call_and_scale() -> None:
    cfg = common.Config.gpu()
    assert tuple(cfg.budgets) == common.PART_ORDER
    # one lease: the device call is at most 9 minutes and the machine's start-up is minutes of the 15: 8 at most
    assert sum(cfg.budgets.values()) <= 8 * 60 and cfg.sweep_budget_s < cfg.budgets["recovery"]
    assert common.PART_ORDER[:3] == ("tests", "recovery", "userpath")  # the most valuable first
    half = cfg.scaled(250)
    assert sum(half.budgets.values()) == pytest.approx(250, abs=0.5)
    factor = 250 / sum(cfg.budgets.values())
    assert half.budgets["tests"] == pytest.approx(cfg.budgets["tests"] * factor, abs=0.1)
    assert half.sweep_budget_s == pytest.approx(cfg.sweep_budget_s * factor, abs=0.1)
    assert common.Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# A part's process as the suite starts it, with the part replaced: it writes one item, then the `tests` part
# sleeps past its budget. The real `suite.child` runs around it (signal handler, status, record).
FAKE_PART = """
import sys, time
from pathlib import Path
from bench.gpu import suite

def part(name, cfg, work, data, out, budget, save, record):
    record["gpu_tests" if name == "tests" else "recovery"] = {"item": f"{name}: first item"}
    save()
    if name == "tests":
        time.sleep(60)

suite._part = part
suite.device.device_environment = lambda cfg: {"device": "fake"}
sys.exit(suite.child(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], float(sys.argv[5])))
"""


def test_a_part_past_its_budget_ends_with_what_it_has_and_the_next_part_runs(tmp_path, monkeypatch) -> None:
    import dataclasses

    monkeypatch.setattr(suite, "GRACE_S", 1.5)
    monkeypatch.setattr(suite, "MIN_PART_S", 1.0)
    cfg = dataclasses.replace(common.Config.cpu_smoke(), threads=None,
                              budgets={"tests": 5.0, "recovery": 20.0, "memory": 5.0, "throughput": 5.0})  # fmt: skip

    def command(part: str, work: Path, out: Path, stem: str, deadline: float) -> list[str]:
        return [sys.executable, "-c", FAKE_PART, part, str(work), str(out), stem, str(deadline)]

    t0 = time.perf_counter()
    record, code = suite.run(cfg, ["recovery", "tests"], tmp_path, "rec", command=command)
    assert code == 0 and record["parts"] == ["tests", "recovery"]  # the suite's order, whatever was asked
    assert record["status"]["tests"]["status"].startswith("overrun: ended at its budget")
    assert record["gpu_tests"] == {"item": "tests: first item"}  # written before the overrun, kept
    assert record["seconds"]["tests"] < 5.0 + 1
    assert record["status"]["recovery"]["status"] == "ok" and record["recovery"] == {"item": "recovery: first item"}
    assert record["environment"]["device"] == "fake" and record["sizing"] is None
    assert json.loads((tmp_path / "rec.json").read_text()) == record
    md = (tmp_path / "rec.md").read_text()
    assert "| tests | overrun: ended at its budget" in md and "Not run in this call (part `memory`" in md
    assert "(not rendered: KeyError" in md  # the fake's items have no figures: the JSON keeps them all the same
    assert time.perf_counter() - t0 < 20


def test_a_killed_part_is_marked_overrun_and_a_crashed_one_failed(tmp_path, monkeypatch) -> None:
    import dataclasses

    monkeypatch.setattr(suite, "GRACE_S", 1.0)
    monkeypatch.setattr(suite, "MIN_PART_S", 1.0)
    cfg = dataclasses.replace(common.Config.cpu_smoke(), budgets={"tests": 3.0, "recovery": 5.0})

    def command(part: str, work: Path, out: Path, stem: str, deadline: float) -> list[str]:
        # tests: ignores SIGUSR1 and sleeps (killed at its budget); recovery: dies at once
        code = "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); time.sleep(30)" \
            if part == "tests" else "raise SystemExit(3)"  # fmt: skip
        return [sys.executable, "-c", code]

    record, code = suite.run(cfg, ["tests", "recovery"], tmp_path, "rec", command=command)
    assert code == 0
    assert record["status"]["tests"]["status"] == "overrun: killed at its budget (3 s)"
    assert record["seconds"]["tests"] < 3.0 + 1
    assert record["status"]["recovery"]["status"].startswith("failed: exit 3")
    assert record["gpu_tests"] is None and record["recovery"] is None


def _probe(m: int, peak: float) -> dict:
    return {"micro_batch": m, "ok": True, "peak_allocated": int(peak), "peak_reserved": int(peak)}


def test_calibration_recovers_known_constants() -> None:
    """Peaks made from the memory model with known factors: the fit must give those factors back."""
    a, a_ckpt, b, fixed, pct = 1.3, 1.7, 0.9, 700 * 2**20, 0.04
    sizing, mems = [], []
    for preset in ("gpt2-small", "gpt2-medium", "llama-1b"):
        for tier in ("fast", "zero2_offload"):
            kw = dict(tier=tier, seq_len=1024, world_size=1)
            e0, e1 = (
                memory.estimate(PRESETS[preset], micro_batch=0, **kw),
                memory.estimate(PRESETS[preset], micro_batch=1, **kw),
            )
            act1, log1 = e1.activations - e0.activations, e1.logits - e0.logits
            scale = a_ckpt if e1.checkpointing else a
            per_sample = scale * act1 + b * log1
            sizing.append(
                {
                    "preset": preset,
                    "tier": tier,
                    "probes": [_probe(m, e0.states + m * per_sample) for m in (1, 2, 4, 8)],
                }
            )
            e = memory.estimate(PRESETS[preset], micro_batch=8, **kw)
            body = e.states + scale * e.activations + b * e.logits
            pred = {
                "states": e.states,
                "activations": e.activations,
                "logits": e.logits,
                "total": e.gpu_bytes,
                "checkpointing": e.checkpointing,
                "per_sample_activations": act1,
                "per_sample_logits": log1,
            }
            meas = {
                "peak_allocated": body,
                "peak_reserved": body,
                "context": fixed,
                "device_peak": body + fixed + pct * body,
            }
            mems.append({"preset": preset, "tier": tier, "micro_batch": 8, "predicted": pred, "measured": meas})
    cal = calibrate.calibrate({"sizing": sizing, "memory_model": mems})
    assert cal["status"] == "ok", cal
    s = cal["suggested"]
    assert s["activations x"] == pytest.approx(a, rel=1e-3)
    assert s["activations (checkpointing) x"] == pytest.approx(a_ckpt, rel=1e-3)
    assert s["logits x"] == pytest.approx(b, rel=1e-3)
    assert s["OVERHEAD_FIXED"] == pytest.approx(fixed, rel=1e-3) and s["OVERHEAD_PERCENT"] == pytest.approx(4, rel=1e-3)
    assert cal["worst_error_suggested"] < 1e-3 and any(abs(e["error_now"]) > 0.05 for e in cal["errors"])
    assert "logits x" in calibrate.text(cal)


def _record(**sections: object) -> dict:
    rec = dict.fromkeys(report.KEYS)
    env = {"date": "2026-01-01T00:00:00+00:00", "mode": "gpu", "device": "NVIDIA H100 80GB HBM3", "driver": "580"}
    rec.update({"schema": 2, "environment": env, "config": {"device": "cuda"}, "parts": [], "seconds": {},
                "status": {}, **sections})  # fmt: skip
    return rec


def test_report_says_which_part_was_not_run_and_merge_joins_parts() -> None:
    soak = {
        "preset": "gpt2-small",
        "tier": "fast",
        "micro_batch": 60,
        "grad_accum": 2,
        "steps": 200,
        "steps_asked": 200,
        "wall_s": 50.0,
        "cpu_s": 49.0,
        "tokens_per_s": 1e5,
        "mfu": 0.4,
        "runner_shrinks": 0,
        "allocator_ooms": 0,
        "vram_pct_device": 88.0,
        "vram_pct_allocated": 80.0,
        "peak_allocated": 60 * 2**30,
        "peak_reserved": 66 * 2**30,
        "device_total": 80 * 2**30,
    }
    a = _record(parts=["throughput"], seconds={"throughput": 300}, soak=soak)
    b = _record(parts=["memory"], seconds={"memory": 400}, calibration={"status": "no GPU measurements", "current": {}},
                status={"memory": {"status": "overrun: killed at its budget (90 s)"}})  # fmt: skip
    md = report.markdown(a)
    assert "Not run in this call (part `memory`)" in md and "Not run in this call (part `tests`)" in md
    assert "88.0 % of the device" in md and "n/a (CPU)" not in md
    assert "Not run in this call (part `memory`: overrun: killed" in report.markdown(b)
    merged = report.merge([a, b])
    assert merged["parts"] == ["throughput", "memory"] and merged["seconds"] == {"throughput": 300, "memory": 400}
    assert merged["status"] == {"memory": {"status": "overrun: killed at its budget (90 s)"}}
    assert merged["soak"] == soak and merged["calibration"]["status"] == "no GPU measurements"
    assert tuple(merged) == report.KEYS


def test_mfu_inputs_and_wheel_preparation() -> None:
    s = PRESETS["gpt2-small"]
    assert device.flops_per_token("gpt2-small", 1024) == 6 * s.params + 6 * 12 * 768 * 1024
    cfg = common.Config.gpu()
    assert device.peak_tflops(cfg, "NVIDIA H100 80GB HBM3")[0] == 989
    assert device.peak_tflops(cfg, "NVIDIA H100 PCIe")[0] == 756
    assert device.peak_tflops(cfg, "NVIDIA H200")[0] == 989
    assert device.peak_tflops(cfg, "NVIDIA A100-SXM4-80GB")[0] == 312
    assert device.peak_tflops(cfg, "Some GPU")[0] is None  # no guessed peak, no MFU
    assert device.mfu(1e5, 10**9, 989.0) == pytest.approx(1e14 / 989e12)
    cmd = prepare.command(ROOT / ".gpu-wheels")
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--no-deps" in cmd
    assert {c.split("==")[0] for c in cmd if "==" in c} == set(prepare.PACKAGES)
    assert ".gpu-wheels/" in (ROOT / ".gitignore").read_text().splitlines()


def test_throughput_rows_start_only_inside_the_budget_and_a_bad_row_is_refused(tmp_path, capsys, monkeypatch) -> None:
    """bench/throughput.py: a row that would not end inside the budget is recorded as not started (no model built),
    and an unknown `--rows` name ends the call with exit 2 and the rows there are, before anything is measured."""
    import bench.throughput as tp
    from bench.throughput import main, measure_rows

    rows = measure_rows(["tiny", "llama-tiny"], "cpu", 1, 1, common.Budget(5.0), first_s=12.0)
    assert [r["row"] for r in rows] == ["tiny", "llama-tiny"]
    assert all(r["status"].startswith("skipped: would not end inside the time budget") for r in rows), rows

    clock = [1000.0]  # the seconds measure_rows and the Budget read: each row's below, exactly

    def measure(row, *args, **kw):  # what a row takes: 0.3 s per 1e10 FLOPs of a step
        clock[0] += 0.3 * tp.step_flops(row) / 1e10
        return {"preset": row.preset}

    monkeypatch.setattr(tp, "measure", measure)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    seen = []  # the next row is expected to take the last one's seconds scaled by the FLOPs of a step
    rows = measure_rows(["llama-tiny-lora", "tiny", "llama-tiny"], "cpu", 1, 1, common.Budget(0.45), first_s=0.05,
                        on_row=lambda rs: seen.append(len(rs)))  # fmt: skip
    assert [r["row"] for r in rows] == ["llama-tiny-lora", "tiny", "llama-tiny"] and seen == [1, 2, 3]
    assert rows[0]["seconds"] >= 0.1 and "status" not in rows[0]  # ~0.12 s of 0.45: tiny's ~0.21 s still fits
    assert "status" not in rows[1] and rows[2]["status"].startswith("skipped: would not end inside"), rows
    assert "tiny's 0.2 s x 0.83, by FLOPs a step" in rows[2]["status"]
    with pytest.raises(SystemExit) as done:
        main(["--smoke", "--rows", "tiny,llama-7b", "--json", str(tmp_path / "r.json")])
    assert done.value.code == 2 and not (tmp_path / "r.json").exists()
    assert "no cpu row 'llama-7b': the rows are tiny, llama-tiny, llama-tiny-lora" in capsys.readouterr().err
