"""Median wall time of `jobspec render examples/sft_fast.yaml` (goal: under 0.3 s).

    python bench/cli_startup.py [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_once(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    commands = {
        "python -c pass (floor)": [sys.executable, "-c", "pass"],
        "jobspec render sft_fast": [sys.executable, "-m", "jobspec", "render", "examples/sft_fast.yaml"],
        "jobspec plan sft_fast": [sys.executable, "-m", "jobspec", "plan", "examples/sft_fast.yaml"],
    }
    for name, argv in commands.items():
        time_once(argv)  # warm the page cache and .pyc files
        samples = [time_once(argv) for _ in range(args.runs)]
        print(
            f"{name:28s} median {statistics.median(samples) * 1000:6.0f} ms   "
            f"min {min(samples) * 1000:5.0f} ms   max {max(samples) * 1000:5.0f} ms   (n={args.runs})"
        )


if __name__ == "__main__":
    main()
