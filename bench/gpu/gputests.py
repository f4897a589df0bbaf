"""The gpu test tier (`pytest -m gpu`) in a subprocess, summarised from its JUnit XML.

Only the test files that use the `gpu` marker are collected (the other tiers' files import packages the
device machine may lack, e.g. kubernetes-validate). Printed figures are kept: `junit_logging=all` puts
each test's output into the XML.
"""

from __future__ import annotations

import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from bench.gpu.common import ROOT


def gpu_test_files() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text(errors="replace")
    )


def summarise(xml_path: Path) -> dict[str, Any]:
    """Totals and one row per test case from a pytest JUnit XML file."""
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, f"{xml_path}: no testsuite"
    cases = []
    for case in suite.iter("testcase"):
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


def run(out_dir: Path, timeout_s: float) -> dict[str, Any]:
    files = gpu_test_files()
    xml = out_dir / "gpu-tests.xml"
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
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(30.0, timeout_s))
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as err:
        code, tail = None, f"timed out after {err.timeout:.0f} s"
    result: dict[str, Any] = {
        "command": " ".join(["python", *cmd[1:]]).replace(str(out_dir), "$OUT"),
        "files": files,
        "exit_code": code,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    if xml.exists():
        result.update(summarise(xml))
    else:
        result["error"] = "no JUnit XML written"
    result["tail"] = tail.splitlines()[-15:]
    return result
