"""Nothing from the runner's environment that looks like a secret reaches a log line, a traceback or the
termination message (which anyone who can read the pod sees): the values a Secret put in the
environment, debug variables included, and every credential shape."""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from jobspec.spec.credentials import secret_values
from runner.process import redaction, supervisor

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "Qx7rT2wY9uI4oP1aS6dF"  # a value under a secret-like name: no shape of its own
FAULT = "hf_" + "Kd8Jf3Lm9Qp2Rt7Vw1Xz4B"  # a token in a debug variable
PASSWORD = "Pw0rd" + "Mn3Bv8Cx5Zl"  # in a URL the runner was never told about


def pieces(secret: str, n: int = 6) -> set[str]:
    return {secret[i : i + n] for i in range(len(secret) - n + 1)}


def clean(text: str) -> bool:
    return not any(p in text for s in (TOKEN, FAULT, PASSWORD) for p in pieces(s))


ENV = {
    "HF_TOKEN": TOKEN, "JOBSPEC_FAULT_OOM": f"mbs>2,{FAULT}", "PATH": "/usr/local/bin:/usr/bin", "HOME": "/tmp",
    "DB_PASSWORD": "abc", "GIT_SHA": "0123456789abcdef0123456789abcdef01234567", "NCCL_DEBUG": "INFO",
}  # fmt: skip


def test_the_environments_secrets_are_found_by_name_and_by_shape() -> None:
    found = secret_values(ENV)
    assert TOKEN in found and f"mbs>2,{FAULT}" in found
    assert not {"/usr/local/bin:/usr/bin", "/tmp", "INFO", ENV["GIT_SHA"]} & set(found)
    assert "abc" not in found  # too short to replace: it would blank every "abc" in a log


@pytest.fixture()
def root_handler(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """The root logger with one handler of our own (pytest's are left alone), the excepthook restored after."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s [rank 0] %(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    return stream


def test_log_lines_and_tracebacks_are_scrubbed(root_handler: io.StringIO, capsys: pytest.CaptureFixture[str]) -> None:
    redaction.install(ENV)
    log = logging.getLogger("jobspec.runner")
    log.warning("environment: %s", ENV)  # a debug dump of the whole environment
    log.warning("fault injection on rank 0: JOBSPEC_FAULT_OOM=%r", ENV["JOBSPEC_FAULT_OOM"])
    try:
        raise OSError(f"401 for https://hub.example.com/x?token={TOKEN} (https://u:{PASSWORD}@hub.example.com)")
    except OSError:
        log.exception("training failed")
    out = root_handler.getvalue()
    assert clean(out), out
    assert "training failed" in out and "Traceback" in out and "<redacted>" in out and "NCCL_DEBUG" in out
    try:
        raise RuntimeError(f"uncaught, with {TOKEN}")
    except RuntimeError as err:
        sys.excepthook(RuntimeError, err, err.__traceback__)
    err_text = capsys.readouterr().err
    assert "uncaught, with <redacted>" in err_text and clean(err_text)
    redaction.install(ENV)  # twice (a test calling setup_logging again): one scrubbing layer
    assert not isinstance(logging.getLogger().handlers[0].formatter.inner, redaction.ScrubbingFormatter)  # type: ignore[union-attr]


def test_the_termination_message_is_scrubbed_before_it_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    long = "x" * 5000 + f" then {TOKEN} at https://:{PASSWORD}@hub.example.com"  # past the 4096-byte limit
    for reason in (f"HTTPError: 401 for {TOKEN}", long, f"{TOKEN[:10]}{'y' * 4080}{TOKEN}"):
        text = supervisor.Outcome(1, reason).message()
        assert clean(text) and len(text.encode()) <= 4096, text[-200:]
        assert json.loads(text)["exit_code"] == 1


def test_the_supervisor_writes_no_secret_to_its_log_or_termination_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    term = tmp_path / "termination-log"
    for name, value in {**ENV, "JOBSPEC_TERMINATION_LOG": str(term)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # main's basicConfig installs its own, on stderr
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    failure = f"worker 0 failed with exit code 1: HTTPError: 401 Unauthorized for {TOKEN} via https://:{PASSWORD}@h"
    monkeypatch.setattr(supervisor, "supervise", lambda *_: supervisor.Outcome(1, failure))
    monkeypatch.setattr(supervisor.preflight, "check", lambda spec: None)
    spec = str(ROOT / "examples" / "quickstart.yaml")
    assert supervisor.main([spec, "--set", f"checkpoints.dir={tmp_path / 'run'}"]) == 1
    message = json.loads(term.read_text())
    assert "401 Unauthorized" in message["reason"] and clean(message["reason"]), message
    logged = capsys.readouterr().err
    assert "exit 1" in logged and clean(logged), logged


def test_a_workers_failure_reaches_the_status_file_scrubbed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    from runner.process import worker

    class FailingRecipe:
        def __init__(self, spec: Any, env: Any, stop: Any) -> None:
            self.spec, self.root, self.status = spec, tmp_path, {"reason": "starting"}

        def setup(self) -> None:
            raise RuntimeError(f"hub refused token {TOKEN} for https://me:{PASSWORD}@hub.example.com/x")

        def cleanup(self) -> None:
            pass

    status = tmp_path / "status.json"
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("JOBSPEC_STATUS_FILE", str(status))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(worker, "Recipe", FailingRecipe)
    assert worker.main([str(ROOT / "examples" / "quickstart.yaml")]) == 1
    reason = json.loads(status.read_text())["reason"]
    assert reason.startswith("RuntimeError: hub refused token <redacted>") and clean(reason), reason
    logged = capsys.readouterr().err
    assert "training failed" in logged and clean(logged), logged
