"""Running the `jobspec` CLI in tests: in a subprocess (`run_cli`) or in this process (`cli`)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

from jobspec.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m jobspec ARGS` from the repository root."""
    return subprocess.run([sys.executable, "-m", "jobspec", *args], capture_output=True, text=True, cwd=ROOT)


def cli(*argv: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `jobspec.cli.main(argv)`, argparse's exits included."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, out.getvalue() + err.getvalue()
