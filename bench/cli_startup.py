"""CLI start-up cost: CPU and wall time of `jobspec render/validate/plan`, against `import pydantic`.

    python bench/cli_startup.py [--runs 15] [--spec examples/sft_fast.yaml]

Method: every round runs each command once, in an order rotated from round to round
(interleaved), so a machine that gets busier or quieter during the run moves every command
alike. CPU time is the child's user + system time (`resource.getrusage(RUSAGE_CHILDREN)` before
and after each run): unlike wall time it does not count waiting for a shared core. Each command
is compared with the `import pydantic` run of the same round (paired), and the median of those
ratios is reported beside the medians. The goal: CPU time under 2x `import pydantic`.

The children compile into a private bytecode cache (PYTHONPYCACHEPREFIX), filled by a warm-up
run, even where PYTHONDONTWRITEBYTECODE is set: an installed jobspec has its .pyc files, and
compiling its modules from source on every run would add ~80 ms that no user pays.

Two floors put the commands' figures in proportion: "one pydantic model" is PyYAML, BaseModel and
one model built, the least any CLI that reads YAML into pydantic models starts with; "... plugins
off" is the same with PYDANTIC_DISABLE_PLUGINS set, as the jobspec commands run (jobspec/cli.py).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "import pydantic"
GOAL = 2.0  # CPU time of a command / CPU time of `import pydantic`


def time_once(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) for one run of argv."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:  # stderr only then: validate's notes would fill the screen at every run
        sys.exit(f"{' '.join(argv[1:])} exited {done.returncode}:\n{done.stderr.decode(errors='replace')}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


FLOOR = "import yaml\nfrom pydantic import BaseModel\nclass A(BaseModel):\n    x: int"
# Set in the child before its model is built, where pydantic reads it: as jobspec/cli.py does.
PLUGINS_OFF = "import os\nos.environ['PYDANTIC_DISABLE_PLUGINS'] = '__all__'\n"


def commands(spec: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "python -c pass": [py, "-c", "pass"],
        BASELINE: [py, "-c", "import pydantic"],
        "one pydantic model": [py, "-c", FLOOR],
        "... plugins off": [py, "-c", PLUGINS_OFF + FLOOR],
        "jobspec validate": [py, "-m", "jobspec", "validate", spec],
        "jobspec render": [py, "-m", "jobspec", "render", spec],
        "jobspec plan": [py, "-m", "jobspec", "plan", spec],
    }


def measure(cmds: dict[str, list[str]], runs: int, pycache: str) -> dict[str, list[tuple[float, float]]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = pycache
    names = list(cmds)
    for argv in cmds.values():  # warm the page cache and write the .pyc files
        time_once(argv, env)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(runs):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:  # interleaved: a rotated order every round
            samples[name].append(time_once(cmds[name], env))
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="rounds (each runs every command once)")
    parser.add_argument("--spec", default="examples/sft_fast.yaml")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jobspec-pycache-") as pycache:
        samples = measure(commands(args.spec), args.runs, pycache)
    base = samples[BASELINE]
    print(f"{os.cpu_count()} CPUs, {args.runs} interleaved rounds; medians, ms (ratio: paired with {BASELINE!r})")
    print(f"{'command':18s} {'CPU':>6s} {'wall':>6s} {'CPU ratio':>10s} {'wall ratio':>10s}")
    worst = 0.0
    for name, runs in samples.items():
        cpu_ratio = statistics.median(c / b[1] for (_, c), b in zip(runs, base, strict=True))
        wall_ratio = statistics.median(w / b[0] for (w, _), b in zip(runs, base, strict=True))
        if name.startswith("jobspec"):
            worst = max(worst, cpu_ratio)
        print(
            f"{name:18s} {statistics.median(c for _, c in runs) * 1000:6.0f} "
            f"{statistics.median(w for w, _ in runs) * 1000:6.0f} {cpu_ratio:9.2f}x {wall_ratio:9.2f}x"
        )
    verdict = "ok" if worst < GOAL else "over"
    print(f"worst jobspec command: {worst:.2f}x the CPU time of {BASELINE!r} (goal < {GOAL:.0f}x): {verdict}")
    return 0 if worst < GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
