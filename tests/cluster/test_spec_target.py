"""status, logs and cancel take the spec file that was submitted: its name, and its namespace when written."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobspec.contract import EXIT_CLUSTER, EXIT_CONFIG, EXIT_OK

from .conftest import BARE_SPEC, NAMED_SPEC, CliRun
from .fake_api import FakeApi
from .objects import prerequisite

REPO = Path(__file__).resolve().parents[2]
SFT = "examples/sft_fast.yaml"  # job sft-fast, namespace: jobspec (the kubeconfig's context says ml)


@pytest.fixture
def submitted(api: FakeApi, kubeconfig: Path, cli: CliRun) -> list[str]:
    kc = ["--kubeconfig", str(kubeconfig)]
    for claim in ("sft-checkpoints", "sft-data"):  # what the example names (the pre-submit checks look)
        api.put(prerequisite("PersistentVolumeClaim", claim, "jobspec"))
    code, _, err = cli("submit", str(REPO / SFT), *kc)
    assert code == EXIT_OK, err
    assert api.get("jobs", "jobspec", "sft-fast") is not None
    api.get("jobs", "jobspec", "sft-fast")["status"] = {"active": 1}
    return kc


def test_status_of_a_spec_file_looks_in_the_spec_namespace(
    api: FakeApi, submitted: list[str], cli: CliRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    pod = api.add_pod("jobspec", "sft-fast", 0)["metadata"]["name"]
    code, out, err = cli("status", SFT, *submitted)
    assert code == EXIT_OK, err
    assert "sft-fast" in out and pod in out and "phase      Running" in out
    assert cli("status", "sft-fast", *submitted)[0] == EXIT_CLUSTER  # by name: the context's namespace, ml


def test_the_namespace_flag_wins_over_the_spec(submitted: list[str], cli: CliRun) -> None:
    code, _, err = cli("status", str(REPO / SFT), "-n", "other", *submitted)
    assert code == EXIT_CLUSTER and 'job "sft-fast" does not exist in namespace "other"' in err
    assert cli("status", str(REPO / SFT), "-n", "jobspec", *submitted)[0] == EXIT_OK


def test_logs_and_cancel_take_the_spec_file(api: FakeApi, submitted: list[str], cli: CliRun) -> None:
    pod = api.add_pod("jobspec", "sft-fast", 0)["metadata"]["name"]
    api.logs[("jobspec", pod)] = b"step 10 loss 3.1\n"
    assert cli("logs", str(REPO / SFT), *submitted)[:2] == (EXIT_OK, "step 10 loss 3.1\n")
    code, out, _ = cli("cancel", str(REPO / SFT), *submitted)
    assert code == EXIT_OK and 'job "sft-fast" cancelled' in out
    assert api.get("jobs", "jobspec", "sft-fast") is None


def test_a_spec_without_a_namespace_uses_the_context(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    kc = ["--kubeconfig", str(kubeconfig)]
    assert cli("submit", BARE_SPEC, *kc)[0] == EXIT_OK  # into the context's namespace, ml
    assert cli("status", BARE_SPEC, *kc)[0] == EXIT_OK
    code, _, err = cli("status", NAMED_SPEC, *kc)  # same job name, namespace: spec-ns written in the file
    assert code == EXIT_CLUSTER and 'namespace "spec-ns"' in err


def test_a_missing_or_bad_spec_file_is_bad_input(kubeconfig: Path, cli: CliRun, tmp_path: Path) -> None:
    kc = ["--kubeconfig", str(kubeconfig)]
    code, _, err = cli("status", str(tmp_path / "missing.yaml"), *kc)
    assert code == EXIT_CONFIG and "no such file" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    code, _, err = cli("cancel", str(bad), *kc)
    assert code == EXIT_CONFIG and "required field is missing" in err
