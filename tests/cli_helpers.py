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


def refused_at_line(path: Path, field: str, line: int, words: str, capsys) -> str:  # capsys: pytest's fixture
    """Assert that loading spec `path` fails with one issue on `field` at `line` whose message or hint holds `words`,
    and that `jobspec validate` exits 2 naming `path:line` without a traceback; validate's stderr."""
    import pytest

    from jobspec.errors import SpecError
    from jobspec.spec.loader import load_spec

    with pytest.raises(SpecError) as info:
        load_spec(path)
    issue = next((i for i in info.value.issues if i.path == field), None)
    assert issue is not None, f"no issue for {field}: {info.value}"
    assert issue.line == line, str(info.value)
    assert words in f"{issue.message} {issue.hint}", str(info.value)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}" in err and "Traceback" not in err
    return err
