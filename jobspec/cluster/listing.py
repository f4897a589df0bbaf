"""`jobspec list`: the jobs jobspec made, found by the managed-by label."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from jobspec.cluster.resources import JOB
from jobspec.cluster.status import build_status
from jobspec.contract import LABEL_MANAGED_BY, MANAGED_BY

if TYPE_CHECKING:  # the client module pulls in urllib3 and tenacity: only for commands that connect
    from jobspec.cluster.client import ClusterClient


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(job: dict[str, Any]) -> JobSummary:
    st = build_status(job, [])
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
    )


def list_jobs(client: ClusterClient, namespace: str | None) -> list[JobSummary]:
    """Jobs made by jobspec in `namespace` (None: every namespace), oldest first."""
    jobs = client.list(JOB, namespace, f"{LABEL_MANAGED_BY}={MANAGED_BY}")
    return sorted((summarize(j) for j in jobs), key=lambda s: (s.created or "", s.namespace, s.name))
