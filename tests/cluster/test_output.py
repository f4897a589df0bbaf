"""What the cluster commands print: `status -o json` is a fixed contract, tables read well."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from jobspec.cluster.output import age, table
from jobspec.contract import EXIT_FAILED, EXIT_OK

from .conftest import CliRun
from .fake_api import FakeApi
from .objects import make_objects


def _failed_job(api: FakeApi) -> None:
    objs = make_objects(queue="gpu-queue")
    for obj in objs:
        api.put(obj)
    job = api.get("jobs", "ml", "train")
    job["metadata"]["uid"] = "uid-1"
    job["spec"]["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": "uid-1"}}
    job["status"] = {
        "failed": 1,
        "succeeded": 1,
        "startTime": "2025-01-01T00:00:10Z",
        "completedIndexes": "1",
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": "PodFailurePolicy",
                "message": "Container runner for pod ml/train-0-x failed with exit code 76",
            }
        ],
    }
    message = (
        'loading\n{"tier": "minimal", "step": 12, "loss": 3.5, "reason": "oom at the last tier", "micro_batch": 1}'
    )
    api.add_pod(
        "ml",
        "train",
        0,
        phase="Failed",
        name="train-0-x",
        node="gpu-7",
        state={"terminated": {"exitCode": 76, "reason": "Error", "message": message}},
    )


def test_status_json_is_stable(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    _failed_job(api)
    line = ('{"step":12,"total_steps":40,"loss":3.5,"tokens_per_s":1234.5,"eta_s":60.0,"tier":"minimal",'
            '"micro_batch":1,'
            '"event":{"event":"tier_change","step":10,"detail":"tier zero3 -> minimal at restart"}}')  # fmt: skip
    api.logs[("ml", "train-0-x")] = f"12:00:00 INFO [rank 0] jobspec-progress/v1 {line}\nbye\n".encode()
    code, out, _ = cli("status", "train", "-o", "json", "--kubeconfig", str(kubeconfig))
    assert code == EXIT_FAILED
    report = {"tier": "minimal", "step": 12, "loss": 3.5, "reason": "oom at the last tier", "extra": {"micro_batch": 1}}
    assert json.loads(out) == {
        "name": "train",
        "namespace": "ml",
        "phase": "Failed",
        "reason": "PodFailurePolicy",
        "message": "Container runner for pod ml/train-0-x failed with exit code 76",
        "spec_hash": "hash-1",
        "queue": "gpu-queue",
        "completions": 2,
        "succeeded": 1,
        "failed": 1,
        "active": 0,
        "start_time": "2025-01-01T00:00:10Z",
        "completion_time": None,
        "indexes": [
            {
                "index": 0,
                "pod": "train-0-x",
                "phase": "Failed",
                "detail": "Error",
                "restarts": 0,
                "attempts": 1,
                "node": "gpu-7",
                "exit_code": 76,
                "report": report,
            },
            {
                "index": 1,
                "pod": None,
                "phase": "Succeeded",
                "detail": None,
                "restarts": 0,
                "attempts": 0,
                "node": None,
                "exit_code": None,
                "report": None,
            },
        ],
        "report": report,
        "progress": {
            "step": 12,
            "total_steps": 40,
            "loss": 3.5,
            "tokens_per_s": 1234.5,
            "eta_s": 60.0,
            "tier": "minimal",
            "micro_batch": 1,
            "event": "tier_change",
            "event_step": 10,
            "event_detail": "tier zero3 -> minimal at restart",
        },
    }


def test_status_human_output(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    _failed_job(api)
    code, out, _ = cli("status", "train", "--kubeconfig", str(kubeconfig))
    assert code == EXIT_FAILED
    lines = out.splitlines()
    assert lines[:4] == [
        "job        train",
        "namespace  ml",
        "phase      Failed (PodFailurePolicy: Container runner for pod ml/train-0-x failed with exit code 76)",
        "indexes    1/2 succeeded, 0 active, 1 failed pods",
    ]
    assert "report     tier minimal, step 12, loss 3.5, oom at the last tier, micro_batch=1" in lines
    header = next(i for i, ln in enumerate(lines) if ln.startswith("INDEX"))
    assert lines[header].split() == [
        "INDEX",
        "POD",
        "PHASE",
        "DETAIL",
        "RESTARTS",
        "ATTEMPTS",
        "NODE",
        "EXIT",
        "TIER",
        "STEP",
        "LOSS",
    ]
    assert lines[header + 1].split() == [
        "0",
        "train-0-x",
        "Failed",
        "Error",
        "0",
        "1",
        "gpu-7",
        "76",
        "minimal",
        "12",
        "3.5",
    ]
    assert lines[header + 2].split() == ["1", "-", "Succeeded"] + ["-", "0", "0"] + ["-"] * 5


def test_list_outputs(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    _failed_job(api)
    code, out, _ = cli("list", "--kubeconfig", str(kubeconfig))
    header = ["NAME", "PHASE", "REASON", "COMPLETIONS", "STEP", "LOSS", "TOK/S", "ETA", "TIER", "MBS", "LAST", "QUEUE"]
    assert code == EXIT_OK and out.splitlines()[0].split() == [*header, "AGE"]
    assert out.splitlines()[1].split()[:12] == ["train", "Failed", "PodFailurePolicy", "1/2", *["-"] * 7, "gpu-queue"]
    code, out, _ = cli("list", "-A", "-o", "json", "--kubeconfig", str(kubeconfig))
    assert code == EXIT_OK and api.calls("GET", "/apis/batch/v1/jobs")
    assert list(json.loads(out)[0]) == [
        "name",
        "namespace",
        "phase",
        "completions",
        "succeeded",
        "failed",
        "active",
        "queue",
        "created",
        "spec_hash",
        "reason",
        "progress",
    ]


def test_age_and_table_helpers() -> None:
    now = datetime(2025, 1, 2, 0, 0, 0, tzinfo=timezone.utc)
    ages = [
        age(t, now)
        for t in (
            "2025-01-01T23:59:15Z",
            "2025-01-01T23:58:00Z",
            "2025-01-01T21:00:00Z",
            "2024-12-29T00:00:00Z",
            None,
            "garbage",
        )
    ]
    assert ages == ["45s", "2m", "3h", "4d", "-", "-"]
    assert table(["A", "LONGER"], [["x", None], ["yyyy", 3]]) == "A     LONGER\nx     -\nyyyy  3\n"
