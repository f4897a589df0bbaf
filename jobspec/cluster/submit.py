"""Submit rendered objects: server-side apply, idempotent by spec hash, --replace to restart.

Decision table, keyed on the Job that already has this name:
    none                           -> apply ConfigMap, Service, NetworkPolicy, Job      "created"
    same spec-hash                 -> touch nothing                                     "unchanged"
    other spec-hash, no --replace  -> SpecChanged (a Job's pod template is immutable)
    --replace                      -> delete the Job (Foreground: its pods first), wait, apply  "replaced"
    not made by jobspec            -> NotManaged, whatever the flags
A PersistentVolumeClaim among the objects (the hub cache that jobs share) is created when missing and left
as it is when it exists, whoever made it: its size and class are the first job's, and data lives on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobspec.cluster.errors import Conflict, NotManaged, SpecChanged
from jobspec.cluster.resources import CLAIM, JOB, POD, kind_of, ref
from jobspec.cluster.status import FINISHED, job_phase, pod_selector
from jobspec.contract import ANNOTATION_SPEC_HASH, LABEL_MANAGED_BY, MANAGED_BY
from jobspec.errors import ClusterError, ConfigError

if TYPE_CHECKING:  # the client module pulls in urllib3 and tenacity: only for commands that connect
    from jobspec.cluster.client import ClusterClient

REPLACE_WAIT = 180.0  # seconds to wait for a replaced Job's pods to be gone


@dataclass
class SubmitResult:
    name: str
    namespace: str
    outcome: str  # created, unchanged, replaced
    spec_hash: str
    dry_run: bool = False  # server dry run: nothing was persisted
    applied: list[str] = field(default_factory=list)  # kubectl-style refs, in apply order
    kept: list[str] = field(default_factory=list)  # claims that exist already, left alone
    phase: str | None = None  # of the Job that was already there


def the_job(objects: list[dict[str, Any]]) -> dict[str, Any]:
    jobs = [o for o in objects if o.get("kind") == "Job"]
    if len(jobs) != 1:
        raise ConfigError(f"expected exactly one Job among the rendered objects, got {len(jobs)}")
    return jobs[0]


def spec_hash(obj: dict[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)


def is_managed(obj: dict[str, Any]) -> bool:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGED_BY


def in_namespace(objects: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """Copies placed in `namespace`, the Job last (it must not start before what it mounts)."""
    out = []
    for obj in objects:
        kind_of(obj)  # refuses kinds this client does not know
        md = obj.get("metadata") or {}
        if md.get("namespace") not in (None, namespace):
            raise ConfigError(f"{ref(obj)} is rendered for namespace {md['namespace']!r}, not {namespace!r}")
        out.append({**obj, "metadata": {**md, "namespace": namespace}})
    return sorted(out, key=lambda o: o["kind"] == "Job")


def submit(
    client: ClusterClient,
    objects: list[dict[str, Any]],
    namespace: str,
    *,
    replace: bool = False,
    dry_run: bool = False,
    replace_wait: float = REPLACE_WAIT,
) -> SubmitResult:
    """Create or update the job's objects; `dry_run` asks the server (dryRun=All), persisting nothing."""
    objects = in_namespace(objects, namespace)
    job = the_job(objects)
    name, new_hash = job["metadata"]["name"], spec_hash(job)
    if not new_hash:
        raise ConfigError(f"the rendered Job has no {ANNOTATION_SPEC_HASH} annotation; cannot tell re-submits apart")
    result = SubmitResult(name, namespace, "created", new_hash, dry_run=dry_run)

    existing = client.find(JOB, namespace, name)
    if existing is not None:
        result.phase = job_phase(existing)
        if not is_managed(existing):
            raise NotManaged(
                f'job "{name}" exists in namespace "{namespace}" but jobspec did not create it '
                f"(no {LABEL_MANAGED_BY}={MANAGED_BY} label); choose another name or delete it yourself"
            )
        old_hash = spec_hash(existing)
        if not replace:
            if old_hash == new_hash:
                result.outcome = "unchanged"
                return result
            state = f"already ran ({result.phase})" if result.phase in FINISHED else f"is {result.phase}"
            raise SpecChanged(
                f'job "{name}" in namespace "{namespace}" {state} with a different spec '
                f"(spec-hash {str(old_hash)[:12]}, this spec {new_hash[:12]}); "
                f"cancel it first (`jobspec cancel {name} -n {namespace}`) or re-submit with --replace "
                "to delete it and start this spec"
            )
        result.outcome = "replaced"
        client.delete(JOB, namespace, name, propagation="Foreground", dry_run=dry_run)
        if not dry_run:
            old = [ref(o) for o in objects if o is not job and kind_of(o) is not CLAIM]
            wait_gone(client, namespace, name, replace_wait,
                      after=f"nothing of the new spec was applied; {', '.join(old)} keep the old job's "
                      "version until the replace finishes (run the same submit --replace again)")  # fmt: skip

    for obj in objects:
        if dry_run and existing is not None and obj is job:
            continue  # the server still has the old Job (dry run): applying over it would be refused
        if kind_of(obj) is CLAIM and client.find(CLAIM, namespace, obj["metadata"]["name"]) is not None:
            result.kept.append(ref(obj))  # shared, with files on it: never resized, relabelled or taken over
            continue
        try:
            client.apply(obj, dry_run=dry_run, force=replace)
        except Conflict as err:
            raise Conflict(
                f"{err}; another field manager (named above) set these fields to other values, e.g. "
                "`jobspec render | kubectl apply --server-side -f -` of another spec, or `kubectl edit`: re-submit "
                "with --replace to take them over",
                status=err.status,
                op=err.op,
            ) from err
        result.applied.append(ref(obj))
    if dry_run and existing is not None:
        result.applied.append(ref(job))
    return result


def wait_gone(
    client: ClusterClient, namespace: str, name: str, timeout: float, interval: float = 1.0, *, after: str = ""
) -> None:
    """Poll until the Job is gone (Foreground deletion removes its pods first). On timeout the error names
    what is still there (the Job, each pod left with its phase and node) and, in `after`, what the caller
    already deleted or left alone."""
    job = None
    for _ in range(max(1, int(timeout / interval))):
        job = client.find(JOB, namespace, name)
        if job is None:
            return
        client.policy.sleep(interval)
    pods = client.list(POD, namespace, pod_selector(job)) if job is not None else []
    left = [f"pod/{p['metadata']['name']} ({pod_where(p)})" for p in pods[:10]]
    left += [f"and {len(pods) - 10} more pods"] if len(pods) > 10 else []
    raise ClusterError(
        f'job "{name}" in namespace "{namespace}" is still being deleted after {timeout:g} s; still there: '
        f"{', '.join([f'job.batch/{name}', *left])}"
        + (f"; {after}" if after else "")
        + ". A pod on a node that no longer answers stops only when the node returns or its Node object is "
        "deleted, or when someone allowed to delete pods (not the jobspec-submitter Role: ask a cluster admin) "
        f"forces it, once the node is surely down: `kubectl delete pod <pod> -n {namespace} --force --grace-period=0`"
    )


def pod_where(pod: dict[str, Any]) -> str:
    """'Running on node gpu-3, terminating': a pod left behind, in a few words."""
    phase = (pod.get("status") or {}).get("phase") or "Pending"
    node = (pod.get("spec") or {}).get("nodeName")
    gone = ", terminating" if (pod.get("metadata") or {}).get("deletionTimestamp") else ""
    return f"{phase}{f' on node {node}' if node else ''}{gone}"
