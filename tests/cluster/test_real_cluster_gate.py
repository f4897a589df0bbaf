"""The `cluster` tier is reachable: with KUBECONFIG set, test_real_cluster.py gets past "KUBECONFIG is not set"
(the folder's autouse fixture deletes KUBECONFIG for every other test) and reaches its own connection step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_real_cluster_test_reads_kubeconfig(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-kubeconfig.yaml"  # set, but nothing there: the test's connection step says so
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "PYTEST_ADDOPTS")}
    env["KUBECONFIG"] = str(missing)
    target = "tests/cluster/test_real_cluster.py"
    argv = ["-m", "pytest", "-q", "-rs", "-m", "cluster", "-p", "no:cacheprovider", target]
    run = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    examples = len(list((REPO / "examples").rglob("*.yaml")))  # the one parametrized test: every example
    others = (REPO / target).read_text().count("\ndef test_") - 1  # the quickstart job, render | kubectl apply, ...
    assert f"{others + examples} skipped" in out, out
    assert "KUBECONFIG is not set" not in out, out
    assert "no usable kubeconfig" in out and "no-such-kubeconfig.yaml" in out, out
