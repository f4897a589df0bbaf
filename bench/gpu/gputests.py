"""The gpu test tier (`pytest -m gpu`) in a subprocess, summarised from its JUnit XML.

Only the test files that use the `gpu` marker are collected (the other tiers' files import packages the
device machine may lack, e.g. kubernetes-validate), in the order of FIRST: the quick tests of open questions
before the tier-by-tier training runs, so that a cut-off tier still says the most. Printed figures are kept:
`junit_logging=all` puts each test's output into the XML. At its time limit pytest gets SIGINT, which ends
the running test and still writes the XML of those that finished; the rest are listed as not run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from bench.gpu.common import ROOT

# Seconds on the H200 (2026-11-28): oom 3.7 + 26.5, offload 9.2, plan 12.3, liger 3.1, trace 0.9, train[fast] 42.6
# (the tier's 136 s ended there). Recovery first: what the suite is most for.
FIRST = (
    "tests/runner/oom/test_oom_gpu.py",
    "tests/runner/sizing/test_plan_gpu.py",
    "tests/runner/train/test_offload.py",
    "tests/runner/train/test_loss_liger.py",
    "tests/runner/model/test_block_kernels.py",
    "tests/runner/train/test_host_sync.py",
    "tests/runner/train/test_trace.py",
    "tests/runner/train/test_compile.py",  # compile with and without Liger's blocks: never run on a GPU yet
)


def gpu_test_files() -> list[str]:
    tests = (ROOT / "tests").rglob("test_*.py")
    found = {str(p.relative_to(ROOT)) for p in tests if "mark.gpu" in p.read_text(errors="replace")}
    return [f for f in FIRST if f in found] + sorted(found - set(FIRST))


def summarise(xml_path: Path) -> dict[str, Any]:
    """Totals and one row per test case from a pytest JUnit XML file."""
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, f"{xml_path}: no testsuite"
    cases = []
    for case in suite.iter("testcase"):
        if not case.get("name"):  # pytest's placeholder for an interrupted run
            continue
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                lines = (el.get("message") or "").strip().splitlines()
                outcome, message = {"failure": "failed"}.get(tag, tag), lines[0][:300] if lines else ""
                break
        out = "\n".join(el.text or "" for el in case.iter("system-out"))
        cases.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": round(float(case.get("time") or 0), 2),
                "message": message,
                "output": out.strip()[-1500:],
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"total": len(cases), **counts, "seconds": round(float(suite.get("time") or 0), 2), "cases": cases}


INTERRUPT_S = 12.0  # from pytest's SIGINT to its kill: it ends the running test (a training run's process group
# is killed by tests/runner/train_helpers.py) and writes the XML of the finished ones


def _interrupt(proc: subprocess.Popen) -> str:
    """SIGINT to pytest, then SIGKILL if it has not ended INTERRUPT_S later; its output."""
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=INTERRUPT_S - 2)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def run(out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """`pytest -m gpu` on the gpu test files, ended by SIGINT after `timeout_s` (and killed INTERRUPT_S later)."""
    files = gpu_test_files()
    xml = out_dir / "gpu-tests.xml"
    xml.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "-q",
        "-o",
        "junit_logging=all",
        f"--junitxml={xml}",
        *files,
    ]
    t0, interrupted = time.perf_counter(), False
    # its own process group: what a test leaves running is killed with it
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=max(5.0, timeout_s))
    except subprocess.TimeoutExpired:
        interrupted = True
        out = _interrupt(proc)
    except BaseException:  # the part's own end (suite.Overrun): the tests' training runs must not outlive it
        _interrupt(proc)
        raise
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    result: dict[str, Any] = {
        "command": " ".join(["python", *cmd[1:]]).replace(str(out_dir), "$OUT"),
        "files": files,
        "exit_code": proc.returncode,
        "wall_s": round(time.perf_counter() - t0, 2),
        "interrupted": f"at its time limit ({timeout_s:.0f} s): SIGINT" if interrupted else None,
    }
    if xml.exists():
        result.update(summarise(xml))
    else:
        result["error"] = "no JUnit XML written"
    result["tail"] = (out or "").splitlines()[-15:]
    return result
