"""The runner's errors end as the CLI's do, with `see: docs/troubleshooting.md#<section>`: the supervisor
(`python -m runner`, `jobspec run`), a worker's exit-2 message and the status it hands its supervisor, the export
tool and `jobspec eval`. Every section they can name exists on the troubleshooting page."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED
from jobspec.errors import EXIT_DOCS, TROUBLESHOOTING
from runner.process import supervisor
from tests.runner.train_helpers import ROOT, runner_env, tiny_spec_dict, worker_in_process, write_jsonl, write_spec
from tests.test_docs import anchors

SEE = re.compile(rf"^see: {re.escape(TROUBLESHOOTING)}#([a-z0-9-]+)$")


def last_link(stderr: str) -> str:
    """The section the output's last line points to; fails unless that line is a docs link to an existing anchor."""
    last = stderr.rstrip().splitlines()[-1]
    m = SEE.match(last)
    assert m, f"the output does not end with its docs link: {last!r}"
    assert m[1] in anchors(ROOT / TROUBLESHOOTING), f"{TROUBLESHOOTING} has no section #{m[1]}"
    return m[1]


def test_every_exit_code_section_exists() -> None:
    defined = anchors(ROOT / TROUBLESHOOTING)
    assert {a for a in EXIT_DOCS.values() if a not in defined} == set()


def test_python_m_runner_ends_a_bad_input_with_its_link(tmp_path) -> None:
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", data={"path": "/no/such/train.jsonl"}))
    done = subprocess.run([sys.executable, "-m", "runner", str(spec)], cwd=ROOT, env=runner_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == EXIT_CONFIG and "Traceback" not in done.stderr
    assert "data.path /no/such/train.jsonl" in done.stderr
    assert last_link(done.stderr) == "config-error"


def test_a_workers_exit_2_names_its_section_and_the_supervisor_ends_with_it(tmp_path, caplog) -> None:
    data = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "hi", "response": "there"}, {"prompt": 7, "response": []}])
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", data={"path": str(data)}))
    with caplog.at_level(logging.ERROR):
        code, status = worker_in_process(spec, tmp_path / "status.json")
    assert code == EXIT_CONFIG
    message = next(r.getMessage() for r in caplog.records if "bad.jsonl" in r.getMessage())
    assert last_link(message) == status["docs"].partition("#")[2]  # the worker's own log ends with it
    # ... and its supervisor's last line points to the same section, read from the status it was handed
    assert supervisor.Outcome(code, status["reason"], status).docs() == status["docs"]


@pytest.mark.parametrize(
    ("code", "docs", "expected"),
    [
        (EXIT_CONFIG, "docs/troubleshooting.md#lease-held", "docs/troubleshooting.md#lease-held"),
        (EXIT_CONFIG, None, "docs/troubleshooting.md#config-error"),  # failed before it could name a class
        (EXIT_FAILED, "https://example.com/x", "docs/troubleshooting.md#runner-crash"),  # not ours: ignored
        (EXIT_FAILED, "docs/troubleshooting.md#a b", "docs/troubleshooting.md#runner-crash"),
        (76, None, "docs/troubleshooting.md#oom-last-tier"),
        (EXIT_PREEMPTED, None, None),
        (EXIT_OK, None, None),
    ],
)
def test_the_supervisors_link(code, docs, expected) -> None:
    status = {"docs": docs} if docs else {}
    assert supervisor.Outcome(code, "why", status).docs() == expected


def test_a_supervisors_own_error_ends_with_its_link(tmp_path, capsys) -> None:
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", data={"eval_path": "/no/such/e.jsonl"}))
    assert supervisor.main([str(spec)]) == EXIT_CONFIG
    assert last_link(capsys.readouterr().err) == "config-error"


def test_export_and_eval_end_with_their_link(tmp_path, capsys) -> None:
    from runner.output import benchmarks, export

    assert export.main([str(tmp_path / "no-run"), "--out", str(tmp_path / "out")]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: ") and last_link(err) == "config-error"
    (tmp_path / "empty").mkdir()
    assert benchmarks.main([str(tmp_path / "empty"), "--tasks", "arc_easy"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: ") and last_link(err) == "config-error"
