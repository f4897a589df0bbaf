"""`jobspec list`: the jobs jobspec made, found by the managed-by label, each with the phase `status` would give.

Per namespace, one list each of the jobs, their pods (by the same label, which the pod template carries), the Job
events and (when a queued job is suspended) Kueue's Workloads; each job's phase, reason and message come from them
as in `status` (status.explained, diagnose.py). A running or pending job's progress is rank 0's last progress line
(progress.py), read for at most MAX_PROGRESS_READS jobs, the newest first: one bounded log read each.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from jobspec.cluster.progress import Progress, read_progress
from jobspec.cluster.resources import EVENT, JOB, POD, WORKLOAD
from jobspec.cluster.status import KUEUE_JOB_UID_LABEL, JobStatus, _queued, _readable, explained
from jobspec.contract import LABEL_MANAGED_BY, MANAGED_BY

if TYPE_CHECKING:  # the client module pulls in urllib3 and tenacity: only for commands that connect
    from jobspec.cluster.client import ClusterClient

CONTROLLER_UID = "batch.kubernetes.io/controller-uid"  # the Job controller's label on its pods (1.27+)
LEGACY_CONTROLLER_UID = "controller-uid"
MAX_PROGRESS_READS = 20  # jobs whose progress one `list` reads (one log tail each)
MANAGED = f"{LABEL_MANAGED_BY}={MANAGED_BY}"


@dataclass(frozen=True)
class JobSummary:
    name: str
    namespace: str
    phase: str
    completions: int
    succeeded: int
    failed: int
    active: int
    queue: str | None
    created: str | None
    spec_hash: str | None
    reason: str | None = None  # why it is not running (as `status`)
    progress: Progress | None = None  # rank 0's last progress line, for a running job

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(job: dict[str, Any], st: JobStatus | None = None) -> JobSummary:
    """A job's line; `st` its explained status (without it, the Job's conditions alone)."""
    if st is None:
        st = explained(job, [], [], None)
    return JobSummary(
        name=st.name,
        namespace=st.namespace,
        phase=st.phase,
        completions=st.completions,
        succeeded=st.succeeded,
        failed=st.failed,
        active=st.active,
        queue=st.queue,
        created=job["metadata"].get("creationTimestamp"),
        spec_hash=st.spec_hash,
        reason=st.reason,
        progress=st.progress,
    )


def _labels(obj: dict[str, Any]) -> dict[str, Any]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _uid_of_pod(pod: dict[str, Any]) -> str | None:
    labels = _labels(pod)
    return labels.get(CONTROLLER_UID) or labels.get(LEGACY_CONTROLLER_UID)


Explained = tuple[dict[str, Any], JobStatus, list[dict[str, Any]]]  # the Job, its status, its pods


def _namespace_status(client: ClusterClient, namespace: str, jobs: list[dict[str, Any]]) -> list[Explained]:
    pods: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for pod in client.list(POD, namespace, MANAGED):
        pods[_uid_of_pod(pod)].append(pod)
    events: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in _readable(lambda: client.list(EVENT, namespace, field_selector="involvedObject.kind=Job")) or []:
        involved = event.get("involvedObject") or {}
        events[involved.get("uid") or involved.get("name") or ""].append(event)
    workloads = None
    if any(_queued(j) for j in jobs):
        workloads = _readable(lambda: client.list(WORKLOAD, namespace), None)
    out = []
    for job in jobs:
        md = job["metadata"]
        uid = md.get("uid")
        own = [w for w in workloads or [] if _labels(w).get(KUEUE_JOB_UID_LABEL) == uid]
        mine = pods.get(uid, [])
        st = explained(job, mine, events.get(uid, []) + events.get(md["name"], []), None if workloads is None else own)
        out.append((job, st, mine))
    return out


def list_jobs(client: ClusterClient, namespace: str | None) -> list[JobSummary]:
    """Jobs made by jobspec in `namespace` (None: every namespace), oldest first."""
    jobs = client.list(JOB, namespace, MANAGED)
    by_ns: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for job in jobs:
        by_ns[job["metadata"].get("namespace") or namespace or ""].append(job)
    found = [item for ns, group in by_ns.items() for item in _namespace_status(client, ns, group)]
    found.sort(key=lambda f: (f[0]["metadata"].get("creationTimestamp") or "", f[1].namespace, f[1].name))
    # Live jobs, Pending too: a gang with one member unschedulable may still train on rank 0, and `status` shows that
    # progress. read_progress reads nothing for a job whose rank 0 has not started.
    live = [i for i, (_, st, _) in enumerate(found) if st.phase in ("Running", "Pending")][-MAX_PROGRESS_READS:]
    for i in live:  # the newest live jobs: one bounded log tail each
        job, st, pods = found[i]
        found[i] = (job, replace(st, progress=read_progress(client, st.namespace, pods)), pods)
    return [summarize(job, st) for job, st, _ in found]
