"""The few resource kinds jobspec talks to, and their REST paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from jobspec.errors import ConfigError


@dataclass(frozen=True)
class Kind:
    kind: str
    api_version: str  # "v1", "batch/v1"
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def display(self) -> str:
        """The name kubectl prints: `configmap`, `job.batch`."""
        return f"{self.kind.lower()}.{self.group}" if self.group else self.kind.lower()

    def collection_path(self, namespace: str | None) -> str:
        root = f"/apis/{self.api_version}" if self.group else f"/api/{self.api_version}"
        if namespace is None:
            return f"{root}/{self.plural}"
        return f"{root}/namespaces/{quote(namespace, safe='')}/{self.plural}"

    def object_path(self, namespace: str | None, name: str) -> str:
        """namespace None: a cluster-scoped object (a Namespace, a PriorityClass, a Node)."""
        return f"{self.collection_path(namespace)}/{quote(name, safe='')}"


CONFIGMAP = Kind("ConfigMap", "v1", "configmaps")
SERVICE = Kind("Service", "v1", "services")
JOB = Kind("Job", "batch/v1", "jobs")
POD = Kind("Pod", "v1", "pods")
NETWORK_POLICY = Kind("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies")
CLAIM = Kind("PersistentVolumeClaim", "v1", "persistentvolumeclaims")  # the shared hub cache (render/hub.py)
EVENT = Kind("Event", "v1", "events")  # read by status only (FailedCreate on the Job)
WORKLOAD = Kind("Workload", "kueue.x-k8s.io/v1beta2", "workloads")  # Kueue's admission of a queued Job (status)
# Read only, by the pre-submit checks (preflight.py): what the rendered objects name and the cluster must have.
NAMESPACE = Kind("Namespace", "v1", "namespaces")  # cluster-scoped: its Pod Security labels
SECRET = Kind("Secret", "v1", "secrets")  # only its key names are looked at
SERVICE_ACCOUNT = Kind("ServiceAccount", "v1", "serviceaccounts")
PRIORITY_CLASS = Kind("PriorityClass", "scheduling.k8s.io/v1", "priorityclasses")  # cluster-scoped
LOCAL_QUEUE = Kind("LocalQueue", "kueue.x-k8s.io/v1beta2", "localqueues")
CLUSTER_QUEUE = Kind("ClusterQueue", "kueue.x-k8s.io/v1beta2", "clusterqueues")  # cluster-scoped
NODE = Kind("Node", "v1", "nodes")  # cluster-scoped: GPU resources allocatable
KINDS = {k.kind: k for k in (CLAIM, CONFIGMAP, SERVICE, NETWORK_POLICY, JOB, POD)}
SUBMITTED_KINDS = (CLAIM, CONFIGMAP, SERVICE, NETWORK_POLICY, JOB)

# Deleted in this order by `cancel` (the Job first, so no new pod mounts a missing ConfigMap; the
# NetworkPolicy last: it guards the job's pods while they stop). Never the hub cache's claim: jobs share it.
OWNED_KINDS = (JOB, SERVICE, CONFIGMAP, NETWORK_POLICY)
# What `submit` checks the cluster has before it applies (cluster/preflight.py), by the names `--skip-check` takes;
# here, light to import, so that the CLI's parser offers them without loading the checks (and the renderer)
PREFLIGHT_CHECKS = ("namespace", "podsecurity", "priorityclass", "queue", "claims", "secrets", "serviceaccount", "gpu")


def kind_of(obj: dict[str, Any]) -> Kind:
    kind = KINDS.get(obj.get("kind", ""))
    if kind is None or kind.api_version != obj.get("apiVersion"):
        raise ConfigError(
            f"cannot submit {obj.get('apiVersion')}/{obj.get('kind')}: jobspec submits only "
            + ", ".join(f"{k.api_version} {k.kind}" for k in SUBMITTED_KINDS)
        )
    return kind


def ref(obj: dict[str, Any]) -> str:
    """`job.batch/train-x`, as kubectl names an object."""
    return f"{kind_of(obj).display}/{obj['metadata']['name']}"
