"""Why a job is not running: its phase, reason and message from the Job, its pods, its events and Kueue.

Pure (objects in, a Diagnosis out), so every not-running state is tested on hand-made objects. A job is
`Running` only when every index that has not finished has a pod whose runner container runs: a gang with one
member Unschedulable trains no step. Otherwise the first problem found, in this order, is the reason:
    FailedCreate        the Job controller's pod creation was refused (a missing PriorityClass, a quota, an
                        admission policy): a Warning event on the Job, newer than its last SuccessfulCreate
    Evicted             a pod preempted, drained or evicted (its DisruptionTarget condition or reason)
    ErrImagePull, ImagePullBackOff, InvalidImageName, CreateContainerConfigError, CrashLoopBackOff, ...
                        the runner container waits for that reason (the kubelet's message follows)
    Unschedulable       the scheduler's message ("0/4 nodes are available: 4 Insufficient nvidia.com/gpu")
    NotScheduled        no node yet and no word from the scheduler: it has not looked at the pod (a busy or
                        missing scheduler); nothing is pulled or mounted before a node is chosen
    ContainerCreating   on its node: pulling the image, mounting volumes: on its way
A suspended Job with a Kueue queue gets the Workload's word: not admitted and why (no quota, no LocalQueue),
evicted or preempted by Kueue, or admitted and starting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobspec.cluster.pods import main_container, parse_index_set, pods_by_index
from jobspec.spec.credentials import redact

# A runner container waiting for one of these is stuck until someone acts: shown before Unschedulable.
STUCK_WAITING = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",  # a Secret or ConfigMap key it names is missing
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
)
SETTLED = ("Failed", "Succeeded", "Terminating", "Failing", "Succeeding")  # the Job's own conditions say it
MAX_CHARS = 300


@dataclass(frozen=True)
class Diagnosis:
    phase: str
    reason: str | None
    message: str | None


def _say(text: Any) -> str | None:
    return redact(" ".join(str(text).split()), token_like=True)[:MAX_CHARS] if text else None


def _when(obj: dict[str, Any]) -> str:
    md = obj.get("metadata") or {}
    return str(obj.get("lastTimestamp") or obj.get("eventTime") or md.get("creationTimestamp") or "")


def failed_create(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The Job's newest FailedCreate event, unless a SuccessfulCreate came after it."""
    relevant = [e for e in events if e.get("reason") in ("FailedCreate", "SuccessfulCreate")]
    newest = max(relevant, key=_when, default=None)
    return newest if newest is not None and newest.get("reason") == "FailedCreate" else None


def pod_problem(pod: dict[str, Any]) -> tuple[str, str | None] | None:
    """(reason, message) when the pod is not running its runner, None when it runs or has ended normally."""
    status = pod.get("status") or {}
    name = (pod.get("metadata") or {}).get("name")
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    disrupted = next((c for c in conditions if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
    if disrupted or status.get("reason") in ("Evicted", "Preempting"):
        said = (disrupted or {}).get("message") or status.get("message") or (disrupted or {}).get("reason")
        return "Evicted", _say(f"pod {name}: {said}" if said else f"pod {name}")
    _, cstatus = main_container(pod)
    waiting = (cstatus.get("state") or {}).get("waiting") or {}
    if waiting.get("reason") in STUCK_WAITING:
        return waiting["reason"], _say(f"pod {name}: {waiting.get('message') or waiting['reason']}")
    unscheduled = next((c for c in conditions if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
    if unscheduled is not None:
        return unscheduled.get("reason") or "Unschedulable", _say(f"pod {name}: {unscheduled.get('message') or ''}")
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    if "running" in (cstatus.get("state") or {}) and status.get("phase") == "Running":
        return None
    if not (pod.get("spec") or {}).get("nodeName"):  # the kubelet, which pulls and mounts, has not got it yet
        scheduler = (pod.get("spec") or {}).get("schedulerName") or "default-scheduler"
        return "NotScheduled", _say(f"pod {name} has no node yet and {scheduler} has not said why: it has not "
                                    "looked at the pod so far (busy, or not running)")  # fmt: skip
    return waiting.get("reason") or "ContainerCreating", _say(waiting.get("message"))


def kueue_word(queue: str | None, workloads: list[dict[str, Any]] | None) -> tuple[str, str]:
    """Why a queued Job is still suspended, from its Workload's conditions."""
    if workloads is None:
        return "Queued", f"waiting for Kueue to admit it from queue {queue} (its Workload is not readable here)"
    if not workloads:
        return "NoWorkload", (
            f"Kueue has made no Workload for it: is Kueue installed, and LocalQueue {queue} in this namespace? "
            "(`kubectl get localqueue`)"
        )
    wl = workloads[0]
    name = (wl.get("metadata") or {}).get("name")
    conds = {c.get("type"): c for c in (wl.get("status") or {}).get("conditions") or [] if isinstance(c, dict)}
    for kind in ("Evicted", "Preempted"):
        if (conds.get(kind) or {}).get("status") == "True":
            return kind, _say(f"by Kueue (Workload {name}): {conds[kind].get('message') or conds[kind].get('reason')}")
    if (conds.get("Admitted") or {}).get("status") == "True":
        return "Admitted", f"admitted by Kueue (Workload {name}); the Job is being started"
    held = conds.get("QuotaReserved") or {}
    said = held.get("message") or "no quota reserved yet"
    return held.get("reason") or "Pending", _say(f"Kueue has not admitted Workload {name}: {said}") or ""


def explain(
    job: dict[str, Any],
    phase: str,
    pods: list[dict[str, Any]],
    events: list[dict[str, Any]],
    workloads: list[dict[str, Any]] | None,
    queue: str | None,
) -> Diagnosis | None:
    """The Diagnosis of a job whose conditions do not settle it (None: keep the conditions' phase and reason).
    `phase` is the conditions' phase; `workloads` None: Kueue's Workloads could not be read."""
    if phase in SETTLED:
        return None
    if phase == "Suspended":
        return Diagnosis("Suspended", *kueue_word(queue, workloads)) if queue else None
    spec, st = job.get("spec") or {}, job.get("status") or {}
    raw = spec.get("completions") or spec.get("parallelism") or 1
    completions = int(raw) if isinstance(raw, int) or (isinstance(raw, str) and raw.isdigit() and len(raw) < 7) else 1
    done = parse_index_set(st.get("completedIndexes"))
    groups = pods_by_index(pods)
    waiting = [i for i in range(min(completions, 100_000)) if i not in done]
    created = failed_create(events)
    if created is not None and any(i not in groups for i in waiting):
        return Diagnosis("Pending", "FailedCreate", _say(created.get("message")))
    problems = [(i, pod_problem(groups[i][0])) for i in waiting if i in groups]
    found = [(i, p) for i, p in problems if p is not None]
    if not found and all(i in groups for i in waiting):
        return Diagnosis("Running", None, None)
    if not found:
        return Diagnosis("Pending", "NoPod", f"no pod yet for index {min(i for i in waiting if i not in groups)}")
    order = ["Evicted", *STUCK_WAITING, "Unschedulable"]
    found.sort(key=lambda item: order.index(item[1][0]) if item[1][0] in order else len(order))
    index, (reason, message) = found[0]
    return Diagnosis("Pending", reason, f"index {index}: {message}" if message else f"index {index}")
