"""Job phase, per-index status and the runner's report: pure functions on hand-made objects."""

from __future__ import annotations

from typing import Any

import pytest

from jobspec.cluster.status import (
    Report,
    build_status,
    job_phase,
    parse_index_set,
    parse_report,
    pod_selector,
)

from .objects import make_objects


def job(status: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    obj = make_objects()[2]
    obj["metadata"].update(meta)
    obj["spec"]["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": "u1"}}
    obj["status"] = status or {}
    return obj


def pod(
    index: int,
    phase: str,
    *,
    created: str = "2025-01-01T00:01:00Z",
    name: str | None = None,
    state: dict[str, Any] | None = None,
    last: dict[str, Any] | None = None,
    restarts: int = 0,
    annotations: dict[str, str] | None = None,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name or f"train-{index}-{phase.lower()}",
            "creationTimestamp": created,
            "annotations": {"batch.kubernetes.io/job-completion-index": str(index), **(annotations or {})},
        },
        "spec": {"containers": [{"name": "runner"}, {"name": "sidecar"}], "nodeName": "gpu-1"},
        "status": {
            "phase": phase,
            "conditions": conditions or [],
            "containerStatuses": [
                {"name": "sidecar", "restartCount": 0, "state": {"running": {}}},
                {"name": "runner", "restartCount": restarts, "state": state or {}, "lastState": last or {}},
            ],
        },
    }


def cond(kind: str, status: str = "True", **extra: str) -> dict[str, Any]:
    return {"type": kind, "status": status, **extra}


@pytest.mark.parametrize(
    ("status", "spec_suspend", "meta", "phase"),
    [
        ({}, False, {}, "Pending"),
        ({"active": 1}, False, {}, "Running"),
        ({"conditions": [cond("Complete")]}, False, {}, "Succeeded"),
        ({"conditions": [cond("Failed", reason="BackoffLimitExceeded")]}, False, {}, "Failed"),
        ({"conditions": [cond("FailureTarget")], "active": 1}, False, {}, "Failing"),
        ({"conditions": [cond("SuccessCriteriaMet")], "active": 1}, False, {}, "Succeeding"),
        ({"conditions": [cond("Suspended")]}, True, {}, "Suspended"),
        ({}, True, {}, "Suspended"),  # Kueue created it suspended, no condition yet
        ({"conditions": [cond("Complete", "False")], "active": 1}, False, {}, "Running"),
        ({"active": 1}, False, {"deletionTimestamp": "2025-01-01T00:00:00Z"}, "Terminating"),
    ],
)
def test_job_phase(status: dict[str, Any], spec_suspend: bool, meta: dict[str, Any], phase: str) -> None:
    obj = job(status, **meta)
    obj["spec"]["suspend"] = spec_suspend
    assert job_phase(obj) == phase


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"tier": "zero2", "step": 1200, "loss": 1.25, "reason": "done"}', Report("zero2", 1200, 1.25, "done")),
        ('progress...\n{"tier": "fast", "step": "40", "loss": "2.5"}\n', Report("fast", 40, 2.5)),
        (
            '{"tier": "zero3", "step": 10}\n{"tier": "minimal", "step": 12, "reason": "oom: retry at next tier"}',
            Report("minimal", 12, None, "oom: retry at next tier"),
        ),
        (
            '{"loss": NaN, "step": 3.0, "micro_batch": 8, "nested": {"x": 1}}',
            Report(None, 3, None, None, {"micro_batch": 8}),
        ),
        (
            "Traceback (most recent call last):\n  File x\nRuntimeError: CUDA out of memory",
            Report(reason="RuntimeError: CUDA out of memory"),
        ),
        ('["not", "an", "object"]', Report(reason='["not", "an", "object"]')),
        ('{"step": "many", "loss": "inf", "tier": 3}', Report("3", None, None)),
        ("", None),
        ("   \n ", None),
        (None, None),
    ],
)
def test_parse_report_is_tolerant(text: str | None, expected: Report | None) -> None:
    assert parse_report(text) == expected


def test_parse_index_set() -> None:
    assert parse_index_set("0,2-4,7") == {0, 2, 3, 4, 7}
    assert parse_index_set("") == set() and parse_index_set(None) == set() and parse_index_set("x,1") == {1}


def test_pod_selector_uses_the_controller_uid() -> None:
    assert pod_selector(job()) == "batch.kubernetes.io/controller-uid=u1"
    bare = job()
    del bare["spec"]["selector"]
    assert pod_selector(bare) == "job-name=train"


def test_build_status_per_index() -> None:
    oom = {
        "terminated": {
            "exitCode": 75,
            "reason": "Error",
            "message": '{"tier": "fast", "step": 50, "loss": 2.0, "reason": "oom: retry at zero2"}',
        }
    }
    pods = [
        pod(0, "Failed", created="2025-01-01T00:01:00Z", name="train-0-a", state=oom),
        pod(0, "Running", created="2025-01-01T00:05:00Z", name="train-0-b", state={"running": {}}),
        pod(1, "Pending", name="train-1-a", state={"waiting": {"reason": "ImagePullBackOff"}}),
    ]
    st = build_status(job({"active": 2, "failed": 1, "startTime": "2025-01-01T00:00:30Z"}), pods)
    assert (st.phase, st.completions, st.active, st.failed) == ("Running", 2, 2, 1)
    first, second = st.indexes
    assert (first.pod, first.phase, first.attempts, first.exit_code) == ("train-0-b", "Running", 2, None)
    assert first.report == Report("fast", 50, 2.0, "oom: retry at zero2")  # from the earlier attempt
    assert (second.pod, second.phase, second.detail, second.attempts) == ("train-1-a", "Pending", "ImagePullBackOff", 1)
    assert st.report == first.report


def test_build_status_of_a_failed_job() -> None:
    crashed = {
        "terminated": {
            "exitCode": 76,
            "reason": "Error",
            "message": '{"tier": "minimal", "reason": "oom at last tier"}',
        }
    }
    status = {
        "failed": 1,
        "conditions": [cond("Failed", reason="PodFailurePolicy", message="exit 76")],
        "completedIndexes": "1",
    }
    st = build_status(job(status), [pod(0, "Failed", state=crashed, restarts=0)])
    assert st.phase == "Failed" and st.failed_job
    assert (st.reason, st.message) == ("PodFailurePolicy", "exit 76")
    assert st.indexes[0].exit_code == 76 and st.indexes[0].detail == "Error"
    assert st.indexes[1].phase == "Succeeded" and st.indexes[1].pod is None  # its pod was cleaned up
    assert st.report == Report("minimal", None, None, "oom at last tier")


def test_restarts_and_last_state_reports() -> None:
    restarted = pod(
        0, "Running", state={"running": {}}, restarts=2, last={"terminated": {"exitCode": 1, "message": "boom"}}
    )
    st = build_status(job({"active": 1}), [restarted])
    assert (st.indexes[0].restarts, st.indexes[0].exit_code, st.indexes[0].report) == (2, 1, Report(reason="boom"))
    # An annotation is no report (nothing writes one: progress comes from the log, progress.py)
    annotated = pod(0, "Running", state={"running": {}}, annotations={"jobspec.dev/progress": '{"step": 7}'})
    assert build_status(job({"active": 1}), [annotated]).indexes[0].report is None


def test_unschedulable_pods_say_so() -> None:
    stuck = pod(0, "Pending", conditions=[cond("PodScheduled", "False", reason="Unschedulable")])
    stuck["status"]["containerStatuses"] = []
    st = build_status(job(), [stuck])
    assert st.indexes[0].detail == "Unschedulable"


def test_to_dict_keys_are_fixed() -> None:
    data = build_status(job(), []).to_dict()
    assert list(data) == [
        "name",
        "namespace",
        "phase",
        "reason",
        "message",
        "spec_hash",
        "queue",
        "completions",
        "succeeded",
        "failed",
        "active",
        "start_time",
        "completion_time",
        "indexes",
        "report",
        "progress",
    ]
    assert list(data["indexes"][0]) == [
        "index",
        "pod",
        "phase",
        "detail",
        "restarts",
        "attempts",
        "node",
        "exit_code",
        "report",
    ]


@pytest.mark.parametrize(
    ("count", "attempts"), [("3", 4), ("0", 1), ("junk", 1), ("-5", 1), ("9" * 40, 1), ("99999", 10_001)]
)
def test_attempts_count_the_failed_pods_of_an_index_the_cluster_already_removed(count: str, attempts: int) -> None:
    # a gang restarted after lost members: the failed pods were garbage-collected, the controller's count remains
    failures = {"batch.kubernetes.io/job-index-failure-count": count}
    newest = pod(0, "Running", state={"running": {}}, annotations=failures)
    assert build_status(job({"active": 1}), [newest]).indexes[0].attempts == attempts
