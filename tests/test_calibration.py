"""Plans that learn from runs: `jobspec plan --from RUN_DIR` and the runner correct the memory model by a
run's measured peak, and the time by its measured step time."""

from __future__ import annotations

import json
from pathlib import Path

from jobspec.cli import main
from jobspec.plan import calibration, memory
from jobspec.plan.planner import estimate_kwargs, model_shape, plan_spec
from jobspec.spec.loader import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "sft_fast.yaml"  # gpt2-medium, seq 1024, 2 x RTX3080-20GB, global batch 32


def write_run(run: Path, *, tier: str, micro_batch: int, peak: int | None, step_s: float, device: str = "cuda") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "plan", "step": 0, "tier": tier, "micro_batch": micro_batch, "device": device, "time": 0.0}]
    for step in range(1, 11):
        rows.append({"kind": "train", "step": step, "tier": tier, "micro_batch": micro_batch, "time": step * step_s,
                     "mem_used_bytes": peak, "tokens_per_s": 1000.0, "loss": 1.0})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tra')  # truncated
    return run


def model_peak(spec, tier: str, micro_batch: int) -> tuple[int, int]:
    """(the model's states, its per-sample bytes) at `tier`."""
    kw = estimate_kwargs(spec, spec.world_size, "bf16")
    at0, at1 = (memory.estimate(model_shape(spec), tier=tier, micro_batch=m, **kw) for m in (0, 1))
    return at0.states, (at1.activations + at1.logits) - (at0.activations + at0.logits)


def test_a_run_that_measured_twice_the_bytes_a_sample_halves_the_micro_batch(tmp_path, capsys):
    spec = load_spec(SPEC)
    before = plan_spec(spec)
    fast = next(p for p in before.plans if p.tier == "fast")
    states, sample = model_peak(spec, "fast", fast.micro_batch)
    run = write_run(tmp_path / "run", tier="fast", micro_batch=fast.micro_batch,
                    peak=states + 2 * sample * fast.micro_batch, step_s=3.0)  # fmt: skip
    after = plan_spec(spec, measured=calibration.read_run(run))
    fast_after = next(p for p in after.plans if p.tier == "fast")
    assert fast_after.max_micro_batch < fast.max_micro_batch * 0.6  # twice the bytes a sample
    assert after.times["fast"].step_seconds == 3.0 and "x2.00" in " ".join(after.measured)
    assert main(["plan", str(SPEC), "--from", str(run)]) in (0, 4)
    out = capsys.readouterr().out
    assert "measured (--from)" in out and "the run measured" in out and "3 s a step measured" in out
    assert main(["plan", str(SPEC), "--from", str(run), "-o", "json"]) in (0, 4)
    assert json.loads(capsys.readouterr().out)["measured"]


def test_a_cpu_run_gives_its_speed_but_no_memory(tmp_path):
    run = write_run(tmp_path / "cpu", tier="fast", micro_batch=4, peak=10**9, step_s=0.5, device="cpu")
    measured = calibration.read_run(run)
    assert measured["fast"].peak_bytes is None and measured["fast"].step_seconds == 0.5
    scale, line = calibration.sample_scale(model_shape(load_spec(SPEC)), measured["fast"], world_size=2,
                                           seq_len=1024)  # fmt: skip
    assert scale is None and "CPU run: no device memory measured" in line


def test_no_metrics_is_a_clear_error(tmp_path, capsys):
    assert main(["plan", str(SPEC), "--from", str(tmp_path / "nothing")]) == 2
    assert "no readable metrics.jsonl" in capsys.readouterr().err


def test_the_runner_plans_with_its_run_directorys_measurement(tmp_path):
    from runner.sizing.hostmem import HostInfo
    from runner.sizing.plan import size_for_tier
    from runner.sizing.probe import DeviceInfo

    gib = 1024**3
    spec = load_spec(SPEC, [f"checkpoints.dir={tmp_path / 'run'}"])
    device = DeviceInfo("cuda", "RTX3080-20GB", 20 * gib, 19 * gib, (8, 6), True, 1, "pynvml")
    host = HostInfo(64 * gib, 60 * gib, 16)
    plain = size_for_tier(spec, device, host, 2, "fast")
    states, sample = model_peak(spec, "fast", plain.micro_batch)
    write_run(tmp_path / "run", tier="fast", micro_batch=plain.micro_batch,
              peak=states + 3 * sample * plain.micro_batch, step_s=2.0)  # fmt: skip
    corrected = size_for_tier(spec, device, host, 2, "fast")
    assert corrected.micro_batch < plain.micro_batch
    assert any("per-sample bytes x3.00 from this run directory" in r for r in corrected.reasons)
