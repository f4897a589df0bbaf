"""Start-up: where the time goes from `jobspec run SPEC` to step 1, phase by phase (issue 41).

    python bench/startup.py                      # the quick start and a llama-1b start-up on this machine, 3 runs each
    python bench/startup.py --runs 1 --only quickstart
    python bench/startup.py --root /tmp/base     # another checkout (e.g. `git archive HEAD~3 | tar -x -C /tmp/base`)

Each run is `python -m jobspec run SPEC` in a fresh run directory, its output read line by line as it comes; the
time each line arrives is taken here (the log's own clock shows seconds only). Two views of the same run:

  milestones  the wall time from the launch to lines every version of the runner prints: the worker's first line
              (process start, imports, device probe), the data loaded, the plan, the model built, the model placed
              (accelerate), step 1; a milestone's row is the time since the previous one.
  phases      the runner's own phase lines (runner/phase.py: "X ..." then "X: done in W s (CPU C s)"), with its wall
              and CPU seconds (CPU: the worker's, process_time); a checkout without them shows none.

The quick start runs to step 1 of examples/quickstart.yaml (the spec as shipped, its run directory moved to a
temporary one). The llama-1b preset (1.2B parameters, fp32 on a CPU: about 5 GB) runs with LoRA (full fine-tuning
needs 22.75 GiB before a sample, which the plan refuses on a small host) and is stopped (SIGKILL to its process group)
once the model is placed: a CPU step of it would take minutes. Medians of `--runs` runs, dated, with the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"

# (name, pattern of the line that ends it): in order; the first line of the worker is any "[rank 0]" line
MILESTONES = [
    ("worker up (imports, device)", r"\[rank 0\] device "),
    ("data", r"\[rank 0\] data .*tokens from the cache|loading the tokenizer and the data: done"),
    ("plan", r"\[rank 0\] plan: pin_memory|planning the tier and micro-batch: done"),
    ("model built", r"\[rank 0\] model \S+: [0-9.]+M parameters"),
    ("model placed", r"\[rank 0\] engine: accelerate"),
    ("step 1", r"\[rank 0\] step 1/"),
]
# the preset with LoRA: full fine-tuning of 1.2B parameters needs 22.75 GiB before a sample, more than a small host has
LLAMA_1B = ["model.preset=llama-1b", "model.lora.rank=8", "model.lora.targets=[q_proj,v_proj]",
            "training.global_batch=1", "data.max_seq_len=128"]  # fmt: skip
PHASE_DONE = re.compile(r"\[rank 0\] (.+): done in ([0-9.]+) s \(CPU ([0-9.]+) s\)")


def run_once(spec: Path, sets: list[str], stop_at: str, root: Path) -> tuple[dict[str, float], dict[str, list[float]]]:
    """({milestone: seconds since launch}, {phase: [wall, cpu]}) of one run, stopped once `stop_at` is reached."""
    with tempfile.TemporaryDirectory(prefix="jobspec-startup-") as tmp:
        sets = [f"checkpoints.dir={tmp}/run", *sets]
        argv = [sys.executable, "-m", "jobspec", "run", str(spec), *(x for s in sets for x in ("--set", s))]
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp, env=env,
                                start_new_session=True)  # fmt: skip
        seen: dict[str, float] = {}
        phases: dict[str, list[float]] = {}
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                now = time.perf_counter() - start
                for name, pattern in MILESTONES:
                    if name not in seen and re.search(pattern, line):
                        seen[name] = now
                if (m := PHASE_DONE.search(line)) is not None:
                    phases[m.group(1)] = [float(m.group(2)), float(m.group(3))]
                if stop_at in seen:
                    break
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if stop_at not in seen:
            raise SystemExit(f"{spec}: the run ended (exit {proc.returncode}) before '{stop_at}'")
        return seen, phases


def report(title: str, runs: list[tuple[dict[str, float], dict[str, list[float]]]]) -> None:
    print(f"\n{title}: median of {len(runs)} run(s)")
    print(f"  {'milestone':<44} {'since launch s':>14} {'since previous s':>17}")
    previous = 0.0
    for name, _ in MILESTONES:
        times = [seen[name] for seen, _ in runs if name in seen]
        if len(times) != len(runs):
            continue
        at = statistics.median(times)
        print(f"  {name:<44} {at:>14.2f} {at - previous:>17.2f}")
        previous = at
    names = [n for n in runs[0][1] if all(n in p for _, p in runs)]
    if not names:
        print("  phases: none logged (a runner without runner/phase.py)")
        return
    print(f"  {'phase (the runner phase lines)':<72} {'wall s':>7} {'CPU s':>7}")
    for name in names:
        wall = statistics.median(p[name][0] for _, p in runs)
        cpu = statistics.median(p[name][1] for _, p in runs)
        print(f"  {name[:72]:<72} {wall:>7.2f} {cpu:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=("quickstart", "llama-1b"), default=None)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose jobspec and runner run")
    args = parser.parse_args()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{when}, {platform.machine()} {os.cpu_count()} cpus ({platform.processor() or platform.platform()}), "
          f"python {platform.python_version()}, load {os.getloadavg()[0]:.1f}, code {args.root}")  # fmt: skip
    cases = {
        "quickstart": (QUICKSTART, [], "step 1"),
        "llama-1b": (QUICKSTART, LLAMA_1B, "model placed"),
    }
    for name, (spec, sets, stop_at) in cases.items():
        if args.only not in (None, name):
            continue
        runs = [run_once(spec, sets, stop_at, args.root) for _ in range(args.runs)]
        report(f"{name} ({spec.name}{' ' + ' '.join(sets) if sets else ''}), to '{stop_at}'", runs)


if __name__ == "__main__":
    main()
