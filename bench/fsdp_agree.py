"""What the OOM agreement before every FSDP collective costs: step time with and without it.

    python bench/fsdp_agree.py [--rounds 3] [--steps 30] [--tier zero3] [--micro-batch 2]

Runs the real runner (`python -m runner SPEC --nproc 2`: two gloo ranks on this machine, tiny preset)
twice a round, with the agreement (the default) and with `JOBSPEC_FSDP_AGREE=0`, in an order that
alternates from round to round (interleaved, paired). Step time = the gap between consecutive
`train` records of metrics.jsonl, median over the steps after the first five; CPU time = the whole
run's user + system time of the supervisor and its workers (imports and setup included, the same on
both sides). Reported: medians over rounds and the median of the per-round ratios. The work is the
same on both sides: the same spec, samples and micro-batches; only the pre-collective all-reduce differs.
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5  # steps left out of the step-time median (lazy init, first allocations)


def spec_dict(run_dir: Path, *, tier: str, micro_batch: int, steps: int) -> dict:
    return {
        "name": "bench-fsdp-agree",
        "model": {"preset": "tiny"},
        "data": {"max_seq_len": 64},
        "training": {"global_batch": 16, "micro_batch": micro_batch, "learning_rate": 3e-3, "warmup_steps": 2,
                     "steps": steps, "precision": "fp32", "log_every": 1},
        "hardware": {"vendor": "cpu", "gpus": 1},
        "memory": {"tier": tier, "fallback": False},
        "checkpoints": {"dir": str(run_dir), "every_steps": 10_000, "keep": 1},
        "output": {"export": False},
    }  # fmt: skip


def run_once(tmp: Path, name: str, agree: bool, args: argparse.Namespace) -> tuple[float, float, float]:
    """(median step seconds, wall seconds, CPU seconds) of one two-rank run."""
    run_dir = tmp / name
    spec = tmp / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(run_dir, tier=args.tier, micro_batch=args.micro_batch,
                                             steps=args.steps)))  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JOBSPEC_FSDP_AGREE": "1" if agree else "0"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "runner", str(spec), "--nproc", "2"], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    times = [r["time"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "train"]  # fmt: skip
    gaps = [b - a for a, b in itertools.pairwise(times)][WARMUP:]
    return statistics.median(gaps), wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tier", default="zero3", choices=["zero2", "zero3", "minimal"])
    parser.add_argument("--micro-batch", type=int, default=2, help="per-rank batch is 8: 4 micro-steps a step")
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="jobspec-fsdp-agree-") as tmp:
        for i in range(args.rounds):
            for agree in (True, False) if i % 2 == 0 else (False, True):
                results[agree].append(run_once(Path(tmp), f"r{i}-{int(agree)}", agree, args))
                step, wall, cpu = results[agree][-1]
                print(f"round {i + 1}: agreement {'on ' if agree else 'off'}  step {step * 1000:7.1f} ms  "
                      f"run {wall:5.1f} s wall, {cpu:5.1f} s CPU", flush=True)  # fmt: skip
    ratios = [on[0] / off[0] for on, off in zip(results[True], results[False], strict=True)]
    print(f"\n{args.tier}, 2 gloo ranks, tiny preset, micro-batch {args.micro_batch} (4 micro-steps a step), "
          f"{args.rounds} rounds, medians:")  # fmt: skip
    print("| agreement | step (ms) | run wall (s) | run CPU (s) |\n| --- | --- | --- | --- |")
    for agree in (True, False):
        steps, walls, cpus = zip(*results[agree], strict=True)
        print(f"| {'on (default)' if agree else 'off (JOBSPEC_FSDP_AGREE=0)'} | {statistics.median(steps) * 1000:.1f} "
              f"| {statistics.median(walls):.1f} | {statistics.median(cpus):.1f} |")  # fmt: skip
    print(f"step time with / without, median of paired ratios: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
