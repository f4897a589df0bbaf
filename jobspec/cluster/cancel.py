"""Cancel a job: delete the Job (its pods go with it), its Service, ConfigMap and NetworkPolicy.

The objects are found by the job label jobspec puts on everything it renders, so a
ConfigMap left over from an interrupted submit goes too. Objects jobspec did not make
are never deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jobspec.cluster.errors import NotFound, NotManaged, Op
from jobspec.cluster.resources import JOB, OWNED_KINDS
from jobspec.cluster.submit import is_managed, wait_gone
from jobspec.contract import LABEL_JOB, LABEL_MANAGED_BY, MANAGED_BY

if TYPE_CHECKING:  # the client module pulls in urllib3 and tenacity: only for commands that connect
    from jobspec.cluster.client import ClusterClient

CANCEL_WAIT = 180.0


@dataclass
class CancelResult:
    name: str
    namespace: str
    deleted: list[str] = field(default_factory=list)  # kubectl-style refs
    gone_already: list[str] = field(default_factory=list)  # deleted by someone else meanwhile


def job_selector(name: str) -> str:
    return f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_JOB}={name}"


def cancel(
    client: ClusterClient, namespace: str, name: str, *, wait: bool = False, wait_timeout: float = CANCEL_WAIT
) -> CancelResult:
    """Delete everything of job `name`. With `wait`, the Job is deleted in the foreground and
    this returns once it (and so every pod) is gone."""
    found = [(kind, obj) for kind in OWNED_KINDS for obj in client.list(kind, namespace, job_selector(name))]
    if not found:
        job = client.find(JOB, namespace, name)
        if job is not None and not is_managed(job):
            raise NotManaged(
                f'job "{name}" in namespace "{namespace}" was not created by jobspec; '
                f"not deleting it (use kubectl delete job {name} -n {namespace} if you mean it)"
            )
        raise NotFound(
            f'job "{name}" does not exist in namespace "{namespace}" (see `jobspec list -n {namespace}`)',
            status=404,
            op=Op("get", "jobs", "batch", namespace, name),
        )
    result = CancelResult(name, namespace)
    for kind, obj in found:
        obj_name = obj["metadata"]["name"]
        policy = "Foreground" if wait and kind is JOB else "Background"
        gone = client.delete(kind, namespace, obj_name, propagation=policy)
        (result.deleted if gone else result.gone_already).append(f"{kind.display}/{obj_name}")
    if wait and any(kind is JOB for kind, _ in found):
        others = [r for r in result.deleted if not r.startswith(f"{JOB.display}/")]
        after = f"deleted already: {', '.join(others)}" if others else ""
        wait_gone(client, namespace, name, wait_timeout, after=after)
    return result
