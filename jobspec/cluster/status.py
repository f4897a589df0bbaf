"""What a job is doing: its phase, each index's latest pod, the runner's last report and its live progress.

`build_status` is pure (Job + pods -> JobStatus) so it is tested without a server; the
runner reports through the container's termination message (a JSON line written to
/dev/termination-log), read tolerantly: any extra text, a traceback, or garbage is fine.
`collect_status` adds the reasons (diagnose.py) and rank 0's last progress line from its log (progress.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from jobspec.cluster.pods import (
    MAX_INDEXES,
    main_container,
    parse_index_set,
    pods_by_index,
)
from jobspec.cluster.progress import Progress, read_progress
from jobspec.cluster.resources import EVENT, JOB, POD, WORKLOAD
from jobspec.contract import ANNOTATION_SPEC_HASH, KUEUE_QUEUE_LABEL
from jobspec.spec.credentials import redact
from jobspec.untrusted import json_loads

if TYPE_CHECKING:  # the client module pulls in urllib3 and tenacity: only for commands that connect
    from jobspec.cluster.client import ClusterClient

log = logging.getLogger(__name__)

KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # on the Workload Kueue makes for a Job
# Failed pods of this index before this one, set by the Job controller when backoffLimitPerIndex is used (1.28+):
# the count survives the garbage collection of the failed pods, which the pods listed do not
INDEX_FAILURES = "batch.kubernetes.io/job-index-failure-count"
FINISHED = ("Succeeded", "Failed")
FAILED = ("Failed", "Failing")
MAX_ATTEMPTS = 10_000  # of one index: more than any backoffLimitPerIndex the spec renders
MAX_REPORT_CHARS = 64 * 1024  # of a termination message (the kubelet keeps 4096 bytes)


@dataclass(frozen=True)
class Report:
    """The runner's last word: memory tier, optimizer step, loss and why it stopped."""

    tier: str | None = None
    step: int | None = None
    loss: float | None = None
    reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other scalar keys the runner wrote


@dataclass(frozen=True)
class IndexStatus:
    index: int
    pod: str | None  # the newest pod for this index
    phase: str | None  # that pod's phase; for a pod-less index, from the Job's index lists
    detail: str | None  # why it waits or ended: ContainerCreating, Unschedulable, OOMKilled, ...
    restarts: int  # container restarts in the newest pod
    attempts: int  # pods created for this index (a retry at the next memory tier, a restart of the gang after a
    # lost member: each a new pod), from the pods listed or the controller's failure count, whichever is larger
    node: str | None
    exit_code: int | None
    report: Report | None


@dataclass(frozen=True)
class JobStatus:
    name: str
    namespace: str
    phase: str  # Pending, Running, Suspended, Succeeding, Succeeded, Failing, Failed, Terminating
    reason: str | None  # of the Failed or Suspended condition
    message: str | None
    spec_hash: str | None
    queue: str | None
    completions: int
    succeeded: int
    failed: int
    active: int
    start_time: str | None
    completion_time: str | None
    indexes: list[IndexStatus]
    report: Report | None  # index 0's (rank 0 reports), else the first index that has one
    progress: Progress | None = None  # rank 0's last progress line (progress.py), read by collect_status

    @property
    def failed_job(self) -> bool:
        return self.phase in FAILED

    def to_dict(self) -> dict[str, Any]:
        """Plain data with a fixed set of keys (documented as the `status -o json` format)."""
        return asdict(self)


def job_phase(job: dict[str, Any]) -> str:
    status = job.get("status") or {}
    true = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Failed" in true:
        return "Failed"
    if "Complete" in true:
        return "Succeeded"
    if (job.get("metadata") or {}).get("deletionTimestamp"):
        return "Terminating"
    if "FailureTarget" in true:
        return "Failing"
    if "SuccessCriteriaMet" in true:
        return "Succeeding"
    if "Suspended" in true or ((job.get("spec") or {}).get("suspend") and not status.get("active")):
        return "Suspended"
    return "Running" if status.get("active") else "Pending"


def parse_report(text: str | None) -> Report | None:
    """A Report from a termination message: the last line that is a JSON object wins; if there
    is none, the last non-empty line becomes the reason (e.g. a traceback's final line)."""
    if not isinstance(text, str) or not text.strip():
        return None
    text = text[:MAX_REPORT_CHARS]  # written by the job's own container: untrusted, bounded
    candidates = [text.strip(), *reversed([ln.strip() for ln in text.splitlines() if ln.strip()])]
    for candidate in candidates:
        if not candidate.startswith("{"):
            continue
        try:
            data = json_loads(candidate)
        except (ValueError, RecursionError):  # not JSON, an integer of 5,000 digits, nested 5,000 deep
            continue
        if isinstance(data, dict):
            return _report_from(data)
    last = [ln.strip() for ln in text.splitlines() if ln.strip()][-1]
    return Report(reason=redact(last, token_like=True)[:300])


def _report_from(data: dict[str, Any]) -> Report:
    def number(value: Any, kind: type) -> Any:
        try:
            num = kind(float(value)) if kind is int else float(value)
        except (TypeError, ValueError, OverflowError):
            return None
        return num if math.isfinite(num) else None

    tier, reason = data.get("tier"), data.get("reason")
    extra = {
        k[:64]: v[:300] if isinstance(v, str) else v
        for k, v in sorted(data.items())[:50]
        if k not in ("tier", "step", "loss", "reason") and isinstance(v, (str, int, float, bool)) and v == v
    }
    return Report(
        tier=str(tier)[:64] if tier is not None else None,
        step=number(data.get("step"), int),
        loss=number(data.get("loss"), float),
        reason=redact(str(reason), token_like=True)[:300] if reason is not None else None,
        extra=extra,
    )


def pod_selector(job: dict[str, Any]) -> str:
    """The Job's own pod selector (controller-uid: never a previous job of the same name)."""
    match = ((job.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    if match:
        return ",".join(f"{k}={v}" for k, v in sorted(match.items()))
    return f"job-name={job['metadata']['name']}"


def _terminated(cstatus: dict[str, Any]) -> dict[str, Any]:
    return (cstatus.get("state") or {}).get("terminated") or (cstatus.get("lastState") or {}).get("terminated") or {}


def pod_detail(pod: dict[str, Any]) -> str | None:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return "Terminating"
    _, cstatus = main_container(pod)
    state = cstatus.get("state") or {}
    for key in ("waiting", "terminated"):
        if (state.get(key) or {}).get("reason"):
            return state[key]["reason"]
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return cond.get("reason") or "Unschedulable"
    return (pod.get("status") or {}).get("reason")


def pod_report(pod: dict[str, Any]) -> Report | None:
    _, cstatus = main_container(pod)
    for term in ((cstatus.get("state") or {}).get("terminated"), (cstatus.get("lastState") or {}).get("terminated")):
        report = parse_report((term or {}).get("message"))
        if report is not None:
            return report
    return None


def _count(value: Any, high: int = 2**31) -> int:
    """A count from the server's status (completions, restarts, succeeded): 0 when it is not a number, at most
    `high`."""
    return min(max(_int(value) or 0, 0), high)


def _int(value: Any) -> int | None:
    """An int32 from the server (Kubernetes' counts and exit codes are int32); None when it is not one."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if -(2**31) <= number < 2**31 else None


def _index_failures(pod: dict[str, Any]) -> int:
    return _count(((pod.get("metadata") or {}).get("annotations") or {}).get(INDEX_FAILURES), MAX_ATTEMPTS)


def _index_status(index: int, pods: list[dict[str, Any]], done: set[int], lost: set[int]) -> IndexStatus:
    if not pods:
        phase = "Succeeded" if index in done else "Failed" if index in lost else None
        return IndexStatus(index, None, phase, None, 0, 0, None, None, None)
    newest = pods[0]
    _, cstatus = main_container(newest)
    code = _terminated(cstatus).get("exitCode")
    statuses = (newest.get("status") or {}).get("containerStatuses") or []
    report = next((r for r in map(pod_report, pods) if r is not None), None)
    return IndexStatus(
        index=index,
        pod=newest["metadata"]["name"],
        phase=(newest.get("status") or {}).get("phase") or "Pending",
        detail=pod_detail(newest),
        restarts=sum(_count(s.get("restartCount")) for s in statuses if isinstance(s, dict)),
        attempts=max(len(pods), _index_failures(newest) + 1),
        node=(newest.get("spec") or {}).get("nodeName"),
        exit_code=_int(code),
        report=report,
    )


def build_status(job: dict[str, Any], pods: list[dict[str, Any]]) -> JobStatus:
    md, spec, st = job["metadata"], job.get("spec") or {}, job.get("status") or {}
    completions = max(_count(spec.get("completions") or spec.get("parallelism") or 1, MAX_INDEXES), 1)
    groups = pods_by_index(pods)
    done, lost = parse_index_set(st.get("completedIndexes")), parse_index_set(st.get("failedIndexes"))
    indexes = [_index_status(i, groups.get(i, []), done, lost) for i in sorted(set(range(completions)) | set(groups))]
    reports = [ix.report for ix in indexes if ix.report is not None]
    explained = ("Failed", "Suspended")
    cond = next((c for c in st.get("conditions") or [] if c.get("status") == "True" and c.get("type") in explained), {})
    return JobStatus(
        name=md["name"],
        namespace=md.get("namespace") or "",
        phase=job_phase(job),
        reason=cond.get("reason"),
        message=redact(cond["message"], token_like=True) if cond.get("message") else None,
        spec_hash=(md.get("annotations") or {}).get(ANNOTATION_SPEC_HASH),
        queue=(md.get("labels") or {}).get(KUEUE_QUEUE_LABEL),
        completions=completions,
        succeeded=_count(st.get("succeeded")),
        failed=_count(st.get("failed")),
        active=_count(st.get("active")),
        start_time=st.get("startTime"),
        completion_time=st.get("completionTime"),
        indexes=indexes,
        report=reports[0] if reports else None,
    )


def collect_status(client: ClusterClient, namespace: str, name: str) -> JobStatus:
    """The Job, its pods, its events and (queued) its Kueue Workload, read and explained (diagnose.py), with rank
    0's last progress line (progress.py)."""
    job = client.get(JOB, namespace, name)
    pods = client.list(POD, namespace, pod_selector(job))
    events = _readable(lambda: client.list(EVENT, namespace, field_selector=f"involvedObject.kind=Job,"
                                           f"involvedObject.name={name}"))  # fmt: skip
    workloads = None
    if _queued(job):
        uid = job["metadata"].get("uid")
        workloads = _readable(lambda: client.list(WORKLOAD, namespace, f"{KUEUE_JOB_UID_LABEL}={uid}"), None)
    st = explained(job, pods, events or [], workloads)
    return replace(st, progress=read_progress(client, namespace, pods))


def _queued(job: dict[str, Any]) -> bool:
    """A Kueue-queued Job that is suspended: its Workload says why (read only then)."""
    return bool((job["metadata"].get("labels") or {}).get(KUEUE_QUEUE_LABEL)) and job_phase(job) == "Suspended"


def explained(
    job: dict[str, Any],
    pods: list[dict[str, Any]],
    events: list[dict[str, Any]],
    workloads: list[dict[str, Any]] | None,
) -> JobStatus:
    """build_status, with the phase, reason and message diagnose.py finds in the pods, events and Workloads (shared
    by `status` and `list`)."""
    from jobspec.cluster.diagnose import explain  # it builds on this module's pod helpers

    st = build_status(job, pods)
    found = explain(job, st.phase, pods, events, workloads, st.queue)
    return st if found is None else replace(st, phase=found.phase, reason=found.reason, message=found.message)


def _readable(read: Callable[[], list[dict[str, Any]]], otherwise: Any = ()) -> Any:
    """What `read` lists, or `otherwise` where the submitter may not list it (an older Role) or the cluster
    has no such resource (no Kueue): status still answers from the Job and its pods."""
    from jobspec.cluster.errors import Forbidden, NotFound

    try:
        return read()
    except (Forbidden, NotFound) as err:
        log.debug("status without it: %s", err)
        return otherwise
