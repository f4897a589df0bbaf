"""The step directories of a run directory (`step-N/`, complete once its DONE marker is there): found without torch.

The supervisor asks whether a run is finished before it starts any worker; a fresh run directory has no complete
step, and answering that must not cost torch's and DCP's imports (about 3 s of CPU at every start). store.py
re-exports these; what reads a checkpoint's contents (verify, load) stays there.
"""

from __future__ import annotations

import re
from pathlib import Path

DONE = "DONE"
STEP_NAME = re.compile(r"^step-(\d+)$")


def is_step_dir(path: Path) -> bool:
    return bool(STEP_NAME.match(path.name))


def complete(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint with its DONE marker, oldest first."""
    root = Path(root)
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        m = STEP_NAME.match(p.name)
        if m and (p / DONE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = complete(root)
    return done[-1][1] if done else None
