"""Run the property tests (hypothesis) again and again with fresh seeds: what CI's fixed seeds do not explore.

    python bench/fuzz.py                 # 10 rounds over every module with a property test
    python bench/fuzz.py --rounds 50 tests/test_loader_hostile.py

Each round is one pytest run under the `fuzz` profile (tests/conftest.py): new random seeds, no deadline.
Prints, per round, the wall and CPU time and the failures; a failure prints hypothesis' reproduction blob
(`@reproduce_failure`). Exit 1 if any round failed.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def property_modules() -> list[str]:
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if re.search(r"^\s*@given\(", path.read_text(), flags=re.M):
            found.append(str(path.relative_to(ROOT)))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("paths", nargs="*", help="test files (default: every module with a @given property)")
    args = parser.parse_args()
    paths = args.paths or property_modules()
    env = {**os.environ, "HYPOTHESIS_PROFILE": "fuzz"}
    failed = 0
    for i in range(1, args.rounds + 1):
        cpu0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *paths],
                             cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
        summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-200:]
        print(f"round {i}/{args.rounds}: {summary} (wall {time.perf_counter() - t0:.0f} s, cpu {cpu:.0f} s)")
        if out.returncode != 0:
            failed += 1
            print(out.stdout[-6000:])
    print(f"{failed} of {args.rounds} rounds failed over {len(paths)} modules")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
