"""Print pip constraints that pin every declared dependency to its floor (`pkg>=X` -> `pkg==X`).

`pip install -c <this output> '.[extras]'` then installs the oldest versions pyproject.toml claims to
support (what `uv pip install --resolution lowest-direct` does), so CI can check that the floors are true.
torch is left out: the floors leg installs the CPU build of 2.13; torch's floor (2.11) and the newest it claims
(2.14.1) have legs of their own in .ci/run (.ci/torch-leg).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

SKIP = {"torch"}


def floors(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    pins = {}
    for req in reqs:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*([^;#]*)", req)
        name, spec = m.group(1).lower(), m.group(2)
        low = re.search(r">=\s*([0-9][0-9A-Za-z.\-]*)", spec)
        if name not in SKIP and low:
            pins[name] = low.group(1)
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    print("\n".join(floors(root / "pyproject.toml", sys.argv[1:])))
