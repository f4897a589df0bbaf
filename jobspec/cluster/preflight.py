"""Pre-submit checks: what the rendered objects name that the cluster must already have.

A Job whose pods name a missing PriorityClass, PersistentVolumeClaim or Secret key is accepted by the API
server and then never runs: the Job controller's pod creation is refused, or the pods wait in Pending or
CreateContainerConfigError. `jobspec submit` (and `submit --dry-run=server`) reads, before applying anything:
    namespace       it exists; its `pod-security.kubernetes.io/enforce` level is one the pods meet (podsecurity.py)
    priorityclass   the pods' priorityClassName (scheduling.priority_class)
    queue           the Kueue LocalQueue of the Job's queue label (scheduling.queue), Kueue's API itself, and the
                    ClusterQueue the LocalQueue points to
    claims          each PersistentVolumeClaim a volume names (checkpoints.pvc, data.pvc), but the hub cache's,
                    which submit creates
    secrets         each Secret an env var (secretKeyRef), envFrom or imagePullSecrets names, and the keys named
                    (only key names are read; a value is never kept, logged or printed); optional refs are skipped
    serviceaccount  the pods' serviceAccountName (scheduling.service_account)
    gpu             some schedulable node (matching the pods' nodeSelector) offers the pods' nvidia.com/gpu or
                    amd.com/gpu, and together they hold every pod
Each missing one is a line naming it, the spec field and the fix; all of them together raise `Missing` (exit 2).
A check the submitter may not read (403) is a warning saying so, never a failure. `skip` names checks to leave
out (a cluster that adds GPU nodes on demand has none to see before the job asks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobspec.cluster import podsecurity
from jobspec.cluster.errors import Forbidden, NotFound
from jobspec.cluster.resources import (
    CLAIM,
    CLUSTER_QUEUE,
    LOCAL_QUEUE,
    NAMESPACE,
    NODE,
    PREFLIGHT_CHECKS,
    PRIORITY_CLASS,
    SECRET,
    SERVICE_ACCOUNT,
    Kind,
)
from jobspec.contract import KUEUE_QUEUE_LABEL
from jobspec.errors import ConfigError
from jobspec.render.pod import GPU_RESOURCES
from jobspec.spec.hub import TOKEN_ENV

if TYPE_CHECKING:  # the client module pulls in urllib3 and tenacity: only for commands that connect
    from jobspec.cluster.client import ClusterClient

log = logging.getLogger(__name__)

# The spec field behind a volume or a reference, for the message (render/pod.py, render/hub.py names them).
VOLUME_FIELDS = {"checkpoints": "checkpoints.pvc", "data": "data.pvc", "hf-cache": "hub.cache"}
_UNREAD = object()  # a read refused (403): the check is a warning


class Missing(ConfigError):
    """What the job needs and the cluster lacks (exit 2): one line each, with the fix."""


@dataclass
class Preflight:
    missing: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    found: list[str] = field(default_factory=list)  # what was checked and is there, for --debug

    def raise_if_missing(self, namespace: str) -> None:
        if self.missing:
            lines = "\n".join(f"  - {m}" for m in self.missing)
            raise Missing(
                f'the cluster lacks what this job needs (namespace "{namespace}"); nothing was applied:\n{lines}\n'
                "Fix each, or leave a check out with --skip-check NAME (one of: " + ", ".join(PREFLIGHT_CHECKS) + ")"
            )


@dataclass
class _Refs:
    """What the Job's pod template names, each with the spec field that put it there."""

    priority_class: str | None = None
    service_account: str | None = None
    claims: dict[str, str] = field(default_factory=dict)  # claim -> field
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # secret -> {key or "": field}
    gpus: dict[str, int] = field(default_factory=dict)  # resource -> per pod
    node_selector: dict[str, str] = field(default_factory=dict)
    pods: int = 1
    explicit_env: dict[str, str] = field(default_factory=dict)  # a container's `env` name -> what sets it
    env_from: set[str] = field(default_factory=set)  # Secrets whose every key becomes an env var (envFrom)


def _env_field(name: str, from_secret: bool) -> str:
    """The spec field behind a rendered env var of that name (jobspec/render: model.hub_token becomes HF_TOKEN)."""
    if name == TOKEN_ENV and from_secret:
        return f"model.hub_token or env.{name}"
    return f"env.{name}" if not name.startswith("JOBSPEC_") else f"{name}, set by jobspec"


def pod_refs(job: dict[str, Any]) -> _Refs:
    spec = job.get("spec") or {}
    pod = ((spec.get("template") or {}).get("spec")) or {}
    refs = _Refs(pod.get("priorityClassName"), pod.get("serviceAccountName"))
    refs.pods = max(int(spec.get("parallelism") or spec.get("completions") or 1), 1)
    refs.node_selector = dict(pod.get("nodeSelector") or {})
    for vol in pod.get("volumes") or []:
        claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
        if claim:
            refs.claims.setdefault(claim, VOLUME_FIELDS.get(vol.get("name"), f"volume {vol.get('name')}"))
        sec = vol.get("secret") or {}
        if sec.get("secretName") and not sec.get("optional"):
            keys = [i.get("key") for i in sec.get("items") or []] or [""]
            for key in keys:
                refs.secrets.setdefault(sec["secretName"], {})[key] = f"volume {vol.get('name')}"
    for pull in pod.get("imagePullSecrets") or []:
        refs.secrets.setdefault(pull.get("name"), {})[""] = "image.pull_secrets"
    for c in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
        for var in c.get("env") or []:
            ref = (var.get("valueFrom") or {}).get("secretKeyRef") or {}
            if ref.get("name") and not ref.get("optional"):
                refs.secrets.setdefault(ref["name"], {})[ref.get("key") or ""] = f"env {var.get('name')}"
            if isinstance(var.get("name"), str):
                refs.explicit_env.setdefault(var["name"], _env_field(var["name"], bool(ref)))
        for src in c.get("envFrom") or []:
            ref = src.get("secretRef") or {}
            if ref.get("name") and not ref.get("optional"):
                refs.secrets.setdefault(ref["name"], {}).setdefault("", "env_from_secrets")
            if ref.get("name"):
                refs.env_from.add(ref["name"])
        resources = c.get("resources") or {}
        for res in GPU_RESOURCES.values():
            count = (resources.get("limits") or {}).get(res) or (resources.get("requests") or {}).get(res)
            if count:
                refs.gpus[res] = refs.gpus.get(res, 0) + int(count)
    return refs


class _Checker:
    def __init__(self, client: ClusterClient, namespace: str, result: Preflight) -> None:
        self.client, self.ns, self.result = client, namespace, result

    def read(self, what: str, call: Callable[[], Any]) -> Any:
        """`call`'s answer; None when it is not there (404); _UNREAD (and a warning) when RBAC refuses."""
        try:
            return call()
        except Forbidden as err:
            self.result.warnings.append(
                f"{what} not checked: the submitter may not read it (`{err.op.can_i()}` says no); "
                "k8s/base/submitter-rbac.yaml grants it"
            )
            return _UNREAD

    def find(self, what: str, kind: Kind, namespace: str | None, name: str) -> Any:
        """The object; None when it does not exist; _UNREAD when refused; the NotFound itself when the server
        has no such resource at all (its CRD is not installed)."""
        try:
            return self.read(what, lambda: self.client.get(kind, namespace, name))
        except NotFound as err:
            return None if err.object_missing else err

    def missing(self, text: str) -> None:
        self.result.missing.append(text)

    def require(self, what: str, kind: Kind, namespace: str | None, name: str, *, absent: str, found: str) -> None:
        """`absent` (the problem and its fix) when the object is not there, `found` noted when it is; nothing when
        RBAC refuses the read (`read` warned)."""
        obj = self.find(what, kind, namespace, name)
        if obj is None or isinstance(obj, NotFound):
            self.missing(absent)
        elif obj is not _UNREAD:
            self.result.found.append(found)

    # -- the checks ---------------------------------------------------------------------------

    def namespace(self, pod: dict[str, Any], *, pod_security: bool = True) -> bool:
        ns = self.find(f'namespace "{self.ns}"', NAMESPACE, None, self.ns)
        if ns is None or isinstance(ns, NotFound):
            self.missing(
                f'namespace "{self.ns}" does not exist: `kubectl create namespace {self.ns}` '
                "(`kubectl apply -k k8s/` makes namespace jobspec, its RBAC and PriorityClasses), or submit "
                "with -n NAMESPACE"
            )
            return False
        if ns is not _UNREAD and pod_security:
            self.pod_security(ns, pod)
        return True

    def pod_security(self, ns: dict[str, Any], pod: dict[str, Any]) -> None:
        enforced = ((ns.get("metadata") or {}).get("labels") or {}).get(podsecurity.ENFORCE_LABEL)
        if enforced is None:
            self.result.found.append(f'namespace "{self.ns}" (no Pod Security enforce label)')
            return
        if enforced not in podsecurity.LEVELS:
            self.result.warnings.append(
                f'namespace "{self.ns}": {podsecurity.ENFORCE_LABEL}={enforced!r} is '
                "no Pod Security level (privileged, baseline, restricted); not checked"
            )
            return
        level, why = podsecurity.pod_level(pod)
        if podsecurity.meets(level, enforced):
            self.result.found.append(f'namespace "{self.ns}" enforces Pod Security {enforced}; the pods meet {level}')
            return
        self.missing(
            f'namespace "{self.ns}" enforces Pod Security "{enforced}" ({podsecurity.ENFORCE_LABEL}), '
            f'which the job\'s pods do not meet (they meet "{level}": {"; ".join(why[:5])}): every pod '
            f'would be refused. Submit to a namespace at "{level}" or lower, or ask its admin to relabel it'
        )

    def priority_class(self, name: str) -> None:
        self.require(
            f'PriorityClass "{name}"', PRIORITY_CLASS, None, name, found=f"priorityclass {name}",
            absent=f'PriorityClass "{name}" (scheduling.priority_class) does not exist: the Job controller '
            "could create no pod. `kubectl apply -f k8s/base/priority-classes.yaml` makes training and "
            "training-low; or name one of `kubectl get priorityclass`, or drop the field",
        )  # fmt: skip

    def queue(self, name: str) -> None:
        lq = self.find(f'LocalQueue "{name}"', LOCAL_QUEUE, self.ns, name)
        if isinstance(lq, NotFound):
            self.missing(
                f'LocalQueue "{name}" (scheduling.queue): the cluster serves no Kueue '
                f"{LOCAL_QUEUE.api_version} API, so nothing would ever admit the suspended Job. Install "
                "Kueue (v0.15 or later) and `kubectl apply -k k8s/overlays/kueue/`, or drop scheduling.queue"
            )
            return
        if lq is None:
            self.missing(
                f'LocalQueue "{name}" (scheduling.queue) does not exist in namespace "{self.ns}": the Job '
                "would stay suspended. `kubectl apply -k k8s/overlays/kueue/` makes gpu-queue; or name one of "
                f"`kubectl get localqueue -n {self.ns}`"
            )
            return
        if lq is _UNREAD:
            return
        cq_name = (lq.get("spec") or {}).get("clusterQueue")
        if not isinstance(cq_name, str) or not cq_name:
            return
        self.require(
            f'ClusterQueue "{cq_name}"', CLUSTER_QUEUE, None, cq_name, found=f"localqueue {name} -> clusterqueue "
            f"{cq_name}", absent=f'LocalQueue "{name}" points to ClusterQueue "{cq_name}", which does not exist: '
            "Kueue admits nothing from it. Create it (k8s/components/kueue/cluster-queue.yaml) or point the "
            "LocalQueue at one of `kubectl get clusterqueue`",
        )  # fmt: skip

    def claims(self, claims: dict[str, str], created: Iterable[str]) -> None:
        for claim, spec_field in claims.items():
            if claim in created:
                continue  # the hub cache: submit creates it when missing
            what = f'PersistentVolumeClaim "{claim}"'
            found = self.find(what, CLAIM, self.ns, claim)
            if found is None or isinstance(found, NotFound):
                self.missing(f'{what} ({spec_field}) does not exist in namespace "{self.ns}": the pods would wait in '
                             "Pending. Create it (ReadWriteMany when several nodes share it), or name one of "
                             f"`kubectl get pvc -n {self.ns}`")  # fmt: skip
            elif found is not _UNREAD and (found.get("metadata") or {}).get("deletionTimestamp"):
                since = found["metadata"]["deletionTimestamp"]
                self.missing(f"{what} ({spec_field}) is being deleted (since {since}; it stays only while a pod "
                             "still mounts it): the pods would wait in Pending once it is gone. Wait until "
                             f"`kubectl get pvc {claim} -n {self.ns}` finds nothing and create it again, or name "
                             "another claim")  # fmt: skip
            elif found is not _UNREAD:
                self.result.found.append(f"pvc {claim}")

    def secrets(self, secrets: dict[str, dict[str, str]], refs: _Refs | None = None) -> None:
        for name, wanted in secrets.items():
            what = f'Secret "{name}"'
            secret = self.find(what, SECRET, self.ns, name)
            if secret is None or isinstance(secret, NotFound):
                fields = ", ".join(sorted(set(wanted.values())))
                keys = [k for k in wanted if k]
                literal = " ".join(f"--from-literal={k}=..." for k in keys) or "--from-literal=KEY=..."
                self.missing(
                    f'{what} ({fields}) does not exist in namespace "{self.ns}": the pods would not start. '
                    f"`kubectl create secret generic {name} -n {self.ns} {literal}`"
                )
                continue
            if secret is _UNREAD:
                continue
            have = set(secret.get("data") or {}) | set(secret.get("stringData") or {})  # key names only
            secret.clear()  # the values: never kept past this line
            if refs is not None and name in refs.env_from:
                for key in sorted(have & set(refs.explicit_env)):  # Kubernetes keeps `env`, drops the Secret's
                    self.missing(
                        f'{what} (env_from_secrets) has a key "{key}" that the spec sets as well '
                        f"({refs.explicit_env[key]}): the pods would take one and drop the other without a word. "
                        f'Set it in one place: remove the key from the Secret, or drop {refs.explicit_env[key]}'
                    )
            for key, spec_field in wanted.items():
                if key and key not in have:
                    self.missing(
                        f'{what} has no key "{key}" ({spec_field}); its keys: '
                        f"{', '.join(sorted(have)[:20]) or 'none'}. Add the key to the Secret, or name one "
                        "of its keys in the spec"
                    )
            self.result.found.append(f"secret {name} (keys {', '.join(sorted(k for k in wanted if k)) or '-'})")

    def service_account(self, name: str) -> None:
        self.require(
            f'ServiceAccount "{name}"', SERVICE_ACCOUNT, self.ns, name, found=f"serviceaccount {name}",
            absent=f'ServiceAccount "{name}" (scheduling.service_account) does not exist in namespace '
            f'"{self.ns}": the Job controller could create no pod. `kubectl apply -k k8s/` makes '
            f"jobspec-runner; or `kubectl create serviceaccount {name} -n {self.ns}`",
        )  # fmt: skip

    def gpus(self, refs: _Refs) -> None:
        nodes = self.read("GPU resources on the nodes", lambda: self.client.list(NODE, None))
        if nodes is _UNREAD:
            return
        if not nodes:
            self.result.warnings.append(
                "GPU resources not checked: the cluster lists no node (one that adds nodes on demand?)"
            )
            return
        chosen = [
            n for n in nodes if _matches(n, refs.node_selector) and not (n.get("spec") or {}).get("unschedulable")
        ]
        where = f" matching nodeSelector {refs.node_selector}" if refs.node_selector else ""
        for res, need in refs.gpus.items():
            counts = sorted((_allocatable(n, res) for n in chosen), reverse=True)
            fits = sum(c // need for c in counts)
            if fits >= refs.pods:
                self.result.found.append(f"{res}: {fits} pod(s) of {need} fit on {len(chosen)} node(s)")
                continue
            cordoned = sorted(
                str((n.get("metadata") or {}).get("name")) for n in nodes
                if _matches(n, refs.node_selector) and (n.get("spec") or {}).get("unschedulable")
                and _allocatable(n, res) >= need
            )  # fmt: skip
            if not any(counts) and cordoned:
                shown = ", ".join(cordoned[:5]) + (f" and {len(cordoned) - 5} more" if len(cordoned) > 5 else "")
                said = (
                    f"every node{where} that offers {need} {res} is cordoned (spec.unschedulable: {shown}): being "
                    "drained or held for maintenance. Wait for it, or `kubectl uncordon NODE` when that is over"
                )
            elif not any(counts):
                said = (
                    f"no schedulable node{where} offers {res} ({len(nodes)} nodes listed, {len(chosen)} "
                    "schedulable and matching): check that the device plugin (GPU operator) runs on the GPU nodes"
                )
            else:
                said = (
                    f"the job's {refs.pods} pod(s) of {need} {res} (hardware.gpus x hardware.nodes) do not "
                    f"fit the schedulable nodes{where}: {fits} would (most allocatable on one node: {counts[0]})"
                )
            self.missing(
                f"{said}. Change hardware.gpus/hardware.nodes or scheduling.node_selector; a cluster that "
                "adds GPU nodes on demand: --skip-check gpu"
            )


def _matches(node: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _allocatable(node: dict[str, Any], resource: str) -> int:
    raw = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
    return int(raw) if isinstance(raw, str) and raw.isdigit() and len(raw) < 7 else 0


def preflight(
    client: ClusterClient, objects: list[dict[str, Any]], namespace: str, *, skip: Iterable[str] = ()
) -> Preflight:
    """Read what the rendered objects (placed in `namespace`) name; never writes."""
    skip = set(skip)
    result = Preflight()
    job = next(o for o in objects if o.get("kind") == "Job")
    pod = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
    refs = pod_refs(job)
    check = _Checker(client, namespace, result)
    if "namespace" not in skip and not check.namespace(pod, pod_security="podsecurity" not in skip):
        return result  # nothing else can be there
    if "priorityclass" not in skip and refs.priority_class:
        check.priority_class(refs.priority_class)
    queue = ((job.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    if "queue" not in skip and queue:
        check.queue(queue)
    if "claims" not in skip:
        created = {o["metadata"]["name"] for o in objects if o.get("kind") == CLAIM.kind}
        check.claims(refs.claims, created)
    if "secrets" not in skip:
        check.secrets(refs.secrets, refs)
    if "serviceaccount" not in skip and refs.service_account:
        check.service_account(refs.service_account)
    if "gpu" not in skip and refs.gpus:
        check.gpus(refs)
    for line in result.found:
        log.debug("preflight: %s", line)
    return result
