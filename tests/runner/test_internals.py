"""runner/internals/: every private framework name in one package, checked before a tier is built.

An internal that a run needs and the installed version lacks is simulated by deleting it; the run must
stop with one message that names the package, its version, the internal and a fix (exit 2), never an
AttributeError in the middle of training. An internal with a fallback only logs what is lost.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.state import AcceleratorState, PartialState

from jobspec.catalog.tiers import TIERS
from jobspec.contract import EXIT_CONFIG
from jobspec.errors import ConfigError
from runner import internals
from tests.runner.train_helpers import tiny_spec_dict, worker_in_process, write_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_this_install_has_every_internal(tier: str, world_size: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        internals.check(tier, world_size, "cpu")
    assert "lacks" not in caplog.text


def test_a_missing_required_internal_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(AcceleratorState, "_reset_state")
    with pytest.raises(ConfigError) as err:
        internals.check("fast", 1, "cpu")
    msg = str(err.value)
    assert "accelerate" in msg and "AcceleratorState._reset_state" in msg
    assert internals.installed("accelerate") in msg  # the installed version
    assert "checked on accelerate" in msg and "pip install" in msg


def test_an_internal_only_some_tiers_need_is_checked_for_those(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(PartialState, "_shared_state")
    internals.check("fast", 1, "cpu")  # DDP/one process: not needed
    with pytest.raises(ConfigError, match=r"PartialState\._shared_state"):
        internals.check("zero3", 1, "cpu")


def test_a_missing_internal_with_a_fallback_only_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(internals, "fsdp_comm_bases", lambda: None)
    monkeypatch.setattr(internals, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        internals.check("zero3", 2, "cpu")
        internals.check("zero3", 2, "cpu")
    lines = [r.getMessage() for r in caplog.records if "AllGather" in r.getMessage()]
    assert len(lines) == 1 and "a rank-local OOM restarts all ranks" in lines[0]


def test_torchao_without_the_parts_hostadamw_reads() -> None:
    partial = SimpleNamespace(optim_dict={}, param_d2h_map={}, queue={})  # no stream, no device
    with pytest.raises(ConfigError, match=r"torchao .* lacks CPUOffloadOptimizer.stream/device.*zero2_offload"):
        internals.offload_parts(partial)


def test_a_run_without_the_internal_stops_at_start_with_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(AcceleratorState, "_reset_state")
    spec = write_spec(tmp_path / "spec.yaml", tiny_spec_dict(tmp_path / "run"))
    code, status = worker_in_process(spec, tmp_path / "status.json")
    assert code == EXIT_CONFIG
    assert "AcceleratorState._reset_state" in status.get("message", str(status))
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or "train" not in (
        tmp_path / "run" / "metrics.jsonl"
    ).read_text()


def test_only_the_adapter_names_private_framework_internals() -> None:
    """The same rule lint-imports enforces in CI (tests/import_contracts.py), so a plain pytest sees it too."""
    out = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "private framework names only through runner.internals KEPT" in " ".join(out.stdout.split())
