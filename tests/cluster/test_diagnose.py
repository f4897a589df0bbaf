"""`jobspec status` says why a job is not running: FailedCreate, Unschedulable, image pulls, CrashLoopBackOff,
evictions, Kueue admission; never `Running` while no pod runs. Pure on hand-made objects, then once through
the fake API server (events by field selector, the Workload by Kueue's job-uid label)."""

from __future__ import annotations

from typing import Any

import pytest

from jobspec.cluster.client import ClusterClient
from jobspec.cluster.diagnose import Diagnosis, explain
from jobspec.cluster.status import collect_status

from .fake_api import FakeApi
from .objects import make_objects
from .test_status import cond, job, pod

NO_CLASS = 'Error creating: pods "train-0-x" is forbidden: no PriorityClass with name training was found'
SCHEDULER = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available"


def event(reason: str, message: str, when: str) -> dict[str, Any]:
    kind = "Warning" if reason.startswith("Failed") else "Normal"
    return {"reason": reason, "message": message, "type": kind, "lastTimestamp": when,
            "involvedObject": {"kind": "Job", "name": "train"}}  # fmt: skip


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"waiting": {"reason": reason, "message": message}}


def running(index: int) -> dict[str, Any]:
    return pod(index, "Running", state={"running": {}})


def diagnose(pods: list[dict[str, Any]], events: list[dict[str, Any]] = (), status: dict | None = None) -> Diagnosis:
    found = explain(job(status or {"active": len(pods)}), "Running", pods, list(events), None, None)
    assert found is not None
    return found


def test_running_only_when_every_index_runs_its_runner() -> None:
    assert diagnose([running(0), running(1)]) == Diagnosis("Running", None, None)
    assert diagnose([running(0)]).phase == "Pending"  # index 1 has no pod: the gang trains nothing
    assert diagnose([running(0), running(1)], status={"active": 1, "completedIndexes": "1"}).phase == "Running"
    creating = pod(0, "Pending", state=waiting("ContainerCreating"))
    assert diagnose([creating, running(1)]).reason == "ContainerCreating"


def test_failed_create_names_the_missing_priority_class() -> None:
    events = [event("FailedCreate", NO_CLASS, "2025-01-01T00:02:00Z")]
    found = diagnose([], events, {})
    assert (found.phase, found.reason) == ("Pending", "FailedCreate") and "no PriorityClass with name training" in (
        found.message or ""
    )
    # a later SuccessfulCreate clears it; so do pods for every index
    later = [*events, event("SuccessfulCreate", "Created pod: train-0-y", "2025-01-01T00:03:00Z")]
    assert diagnose([], later, {}).reason == "NoPod"
    assert diagnose([running(0), running(1)], events).phase == "Running"


@pytest.mark.parametrize(
    ("state", "reason", "said"),
    [
        (waiting("ImagePullBackOff", 'Back-off pulling image "ghcr.io/x/runner:9"'), "ImagePullBackOff", "ghcr.io"),
        (waiting("ErrImagePull", "manifest unknown"), "ErrImagePull", "manifest unknown"),
        (waiting("CreateContainerConfigError", 'secret "hf" not found'), "CreateContainerConfigError", "hf"),
        (waiting("CrashLoopBackOff", "back-off 5m0s restarting failed container"), "CrashLoopBackOff", "back-off"),
    ],
)
def test_a_stuck_container_says_why(state: dict[str, Any], reason: str, said: str) -> None:
    found = diagnose([pod(0, "Pending", state=state), running(1)])
    assert (found.phase, found.reason) == ("Pending", reason)
    assert (
        found.message is not None and found.message.startswith("index 0: pod train-0-pending") and said in found.message
    )


def test_unschedulable_carries_the_schedulers_message() -> None:
    stuck = pod(1, "Pending", conditions=[cond("PodScheduled", "False", reason="Unschedulable", message=SCHEDULER)])
    stuck["status"]["containerStatuses"] = []
    found = diagnose([running(0), stuck])
    assert (found.phase, found.reason) == ("Pending", "Unschedulable") and SCHEDULER in (found.message or "")


def test_eviction_comes_first() -> None:
    evicted = pod(0, "Failed", conditions=[cond("DisruptionTarget", reason="PreemptionByScheduler",
                                                message="Preempted in order to admit critical pod")])  # fmt: skip
    stuck = pod(1, "Pending", conditions=[cond("PodScheduled", "False", reason="Unschedulable", message=SCHEDULER)])
    found = diagnose([evicted, stuck])
    assert found.reason == "Evicted" and "Preempted in order to admit" in (found.message or "")


def workload(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": "job-train-1a2b3", "namespace": "ml", "labels": {}},
            "status": {"conditions": conditions}}  # fmt: skip


@pytest.mark.parametrize(
    ("workloads", "reason", "said"),
    [
        (None, "Queued", "not readable"),
        ([], "NoWorkload", "LocalQueue gpu-queue"),
        (
            [
                workload(
                    [cond("QuotaReserved", "False", reason="Pending", message="insufficient quota for nvidia.com/gpu")]
                )
            ],
            "Pending",
            "insufficient quota",
        ),
        (
            [
                workload(
                    [
                        cond(
                            "QuotaReserved",
                            "False",
                            reason="Inadmissible",
                            message="LocalQueue gpu-queue doesn't exist",
                        )
                    ]
                )
            ],
            "Inadmissible",
            "doesn't exist",
        ),
        (
            [workload([cond("Evicted", reason="Preempted", message="Preempted to accommodate a higher priority")])],
            "Evicted",
            "higher priority",
        ),
        ([workload([cond("QuotaReserved"), cond("Admitted")])], "Admitted", "being started"),
    ],
)
def test_kueue_admission(workloads: list[dict[str, Any]] | None, reason: str, said: str) -> None:
    suspended = job({"conditions": [cond("Suspended")]})
    found = explain(suspended, "Suspended", [], [], workloads, "gpu-queue")
    assert found is not None and (found.phase, found.reason) == ("Suspended", reason) and said in (found.message or "")


def test_a_hostile_completions_count_is_no_crash() -> None:
    broken = job({"active": 1})
    broken["spec"]["completions"] = "junk"
    assert explain(broken, "Running", [running(0)], [], None, None) == Diagnosis("Running", None, None)


def test_settled_jobs_keep_their_conditions() -> None:
    assert explain(job(), "Failed", [], [event("FailedCreate", NO_CLASS, "x")], None, None) is None
    assert explain(job(), "Suspended", [], [], None, None) is None  # suspended by hand, no queue


def test_status_reads_events_and_the_workload_through_the_api(api: FakeApi, client: ClusterClient) -> None:
    objs = make_objects()
    api.put({**objs[2], "status": {"active": 2}})
    api.put({"kind": "Event", "metadata": {"name": "train.1", "namespace": "ml"},
             **event("FailedCreate", NO_CLASS, "2025-01-01T00:02:00Z")})  # fmt: skip
    api.put({"kind": "Event", "metadata": {"name": "other.1", "namespace": "ml"},
             **{**event("FailedCreate", "not ours", "2025-01-01T00:09:00Z"),
                "involvedObject": {"kind": "Job", "name": "other"}}})  # fmt: skip
    st = collect_status(client, "ml", "train")
    assert (st.phase, st.reason) == ("Pending", "FailedCreate") and "no PriorityClass" in (st.message or "")
    assert api.calls("GET", "/events")[0].query["fieldSelector"] == "involvedObject.kind=Job,involvedObject.name=train"

    queued = make_objects("queued", queue="gpu-queue")[2]
    queued["spec"]["suspend"] = True
    uid = api.put({**queued, "status": {}})["metadata"]["uid"]
    wl = workload([cond("QuotaReserved", "False", reason="Pending", message="insufficient quota")])
    wl["metadata"]["labels"]["kueue.x-k8s.io/job-uid"] = uid
    api.put(wl)
    st = collect_status(client, "ml", "queued")
    assert (st.phase, st.reason) == ("Suspended", "Pending") and "insufficient quota" in (st.message or "")


def test_status_without_kueue_or_event_rights_still_answers(api: FakeApi, client: ClusterClient) -> None:
    queued = make_objects(queue="gpu-queue")[2]
    queued["spec"]["suspend"] = True
    api.put({**queued, "status": {}})
    api.fail("GET", r"/events", status=403, times=1)
    api.fail("GET", r"/workloads", status=404, times=1)  # Kueue's CRDs not installed
    st = collect_status(client, "ml", "train")
    assert (st.phase, st.reason) == ("Suspended", "Queued")


def test_a_pod_without_a_node_is_not_reported_as_pulling_its_image() -> None:
    """Seen on a real control plane (issue 43): a pod the scheduler has not looked at yet (no node, no PodScheduled
    condition, no container status) was `ContainerCreating`, "the image is being pulled", which no node is doing."""
    fresh = pod(0, "Pending")
    fresh["spec"].pop("nodeName")
    fresh["status"].pop("containerStatuses")
    found = diagnose([fresh, running(1)])
    assert (found.phase, found.reason) == ("Pending", "NotScheduled")
    assert "has no node yet" in (found.message or "") and "default-scheduler" in (found.message or "")
    fresh["spec"]["schedulerName"] = "volcano"  # a scheduler of its own: named, since it may be the one missing
    assert "volcano has not said why" in (diagnose([fresh, running(1)]).message or "")
    # once the scheduler has looked, its own word; once on a node, pulling and mounting
    said = cond("PodScheduled", "False", reason="Unschedulable", message=SCHEDULER)
    fresh["status"]["conditions"] = [said]
    assert diagnose([fresh, running(1)]).reason == "Unschedulable"
    placed = pod(0, "Pending", state=waiting("ContainerCreating"))
    assert diagnose([placed, running(1)]).reason == "ContainerCreating"
