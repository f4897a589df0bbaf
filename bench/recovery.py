"""Seconds from an OOM to the next completed step, in process and across a tier restart; steps lost.

    python bench/recovery.py [--steps 12] [--fault-step 6] [--vendor cpu|cuda] [--keep DIR]

Runs the real runner (`python -m runner SPEC`, tiny preset) with `JOBSPEC_FAULT_OOM` three times:
  shrink      micro-batch 8, `step=K`: step K runs out at 8, shrinks to 4 and is redone in process;
  step-down   micro-batch 1, `step=K`: micro-batch 1 runs out, the worker checkpoints step K-1 and
              rebuilds itself at the next tier in the same process, resuming from that checkpoint;
  relaunch    the same with JOBSPEC_STEP_DOWN=restart: the worker exits 75 and the supervisor starts
              a new one at the next tier (the fallback for a poisoned device or a rank-local OOM).
Recovery = time of step K's metrics record - time of the OOM (the shrink event's `oom_at`, or the
tier state's failure time). Steps lost = last step completed before the OOM - step resumed from
(the goal is 0). The usual step time is printed beside it for scale.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def spec_dict(run_dir: Path, *, micro_batch: int, steps: int, vendor: str) -> dict[str, Any]:
    return {
        "name": "bench-recovery",
        "model": {"preset": "tiny"},
        "data": {"max_seq_len": 64},
        "training": {"global_batch": 8, "micro_batch": micro_batch, "learning_rate": 3e-3, "warmup_steps": 2,
                     "steps": steps, "precision": "fp32", "log_every": 1},
        "hardware": {"vendor": vendor, "gpus": 1},
        "memory": {"tier": "fast"},
        "checkpoints": {"dir": str(run_dir), "every_steps": 1000, "keep": 2},
    }  # fmt: skip


def run(run_dir: Path, spec: dict[str, Any], fault: str, **extra: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the runner and its children) of one run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "JOBSPEC_FAULT_OOM": fault, "PYTHONUNBUFFERED": "1", **extra}
    t0, cpu0 = time.perf_counter(), _child_cpu()
    proc = subprocess.run([sys.executable, "-m", "runner", str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    wall, cpu = time.perf_counter() - t0, _child_cpu() - cpu0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"runner exited {proc.returncode} for {fault!r}")
    return wall, cpu


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_time(rows: list[dict[str, Any]], skip: set[int]) -> float:
    """Median seconds between consecutive train records, leaving out the steps in `skip`."""
    train = [r for r in rows if r.get("kind") == "train"]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(train) if b["step"] == a["step"] + 1
            and b["step"] not in skip]  # fmt: skip
    return statistics.median(gaps) if gaps else float("nan")


def in_process(base: Path, steps: int, k: int, vendor: str) -> dict[str, Any]:
    run_dir = base / "in_process"
    wall, cpu = run(run_dir, spec_dict(run_dir, micro_batch=8, steps=steps, vendor=vendor), f"step={k}")
    rows = metrics(run_dir)
    event = next(r for r in rows if r.get("event") == "oom_shrink")
    done = next(r for r in rows if r.get("kind") == "train" and r["step"] == k)
    resumed = [r for r in rows if r.get("kind") == "plan"]
    return {
        "scenario": "in-process shrink",
        "recovery_s": done["time"] - event["oom_at"],
        "step_s": step_time(rows, {1, k}),
        "steps_lost": 0 if len(resumed) == 1 else None,
        "detail": f"micro-batch {event['from_micro_batch']} -> {event['to_micro_batch']}",
        "wall_s": wall,
        "cpu_s": cpu,
    }


def tier_step_down(base: Path, steps: int, k: int, vendor: str, how: str = "in_process") -> dict[str, Any]:
    run_dir = base / f"tier_{how}"
    spec = spec_dict(run_dir, micro_batch=1, steps=steps, vendor=vendor)
    wall, cpu = run(run_dir, spec, f"step={k}", JOBSPEC_STEP_DOWN=how)
    rows = metrics(run_dir)
    state = json.loads((run_dir / "tier_state.json").read_text())
    failed = state["failed"][0]
    before = [r["step"] for r in rows if r.get("kind") == "train" and r["time"] <= failed["at"]]
    plans = [r for r in rows if r.get("kind") == "plan"]
    resumed_from = plans[-1]["step"]
    done = next(r for r in rows if r.get("kind") == "train" and r["step"] == k and r["time"] > failed["at"])
    where = "in process" if how == "in_process" else "relaunch"
    return {"scenario": f"tier {failed['tier']} -> {plans[-1]['tier']}, {where}",
            "recovery_s": done["time"] - failed["at"], "step_s": step_time(rows, {1, k, resumed_from + 1}),
            "steps_lost": max(before, default=0) - resumed_from, "detail": f"resumed from step {resumed_from}",
            "wall_s": wall, "cpu_s": cpu}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fault-step", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--vendor", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="jobspec-recovery-"))
    scenarios = {
        "shrink": lambda d: in_process(d, args.steps, args.fault_step, args.vendor),
        "step-down": lambda d: tier_step_down(d, args.steps, args.fault_step, args.vendor, "in_process"),
        "relaunch": lambda d: tier_step_down(d, args.steps, args.fault_step, args.vendor, "restart"),
    }
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios}
    for i in range(args.rounds):  # interleaved: each round runs every scenario once, in turn
        for name, scenario in scenarios.items():
            rounds[name].append(scenario(base / f"round{i}"))
    print(f"OOM recovery ({args.vendor}, tiny preset, global batch 8, fault at step {args.fault_step}; "
          f"medians of {args.rounds} interleaved rounds):")  # fmt: skip
    for rs in rounds.values():
        med = {k: statistics.median(r[k] for r in rs) for k in ("recovery_s", "step_s", "wall_s", "cpu_s")}
        ratio = statistics.median(r["recovery_s"] / r["step_s"] for r in rs)
        lost = sorted({r["steps_lost"] for r in rs}, key=str)
        print(
            f"  {rs[0]['scenario']:40s} OOM -> next step {med['recovery_s']:6.2f} s = {ratio:5.1f} usual steps "
            f"({med['step_s']:.3f} s); steps lost {lost}; run {med['wall_s']:.1f} s wall, {med['cpu_s']:.1f} s CPU"
        )


if __name__ == "__main__":
    main()
