"""Hand-written objects of the shape `jobspec.render.render` returns: ConfigMap, Service, Job, and a
NetworkPolicy last (render puts it before the Job; submit applies the Job last whatever the order)."""

from __future__ import annotations

from typing import Any

from jobspec.contract import ANNOTATION_SPEC_HASH, KUEUE_QUEUE_LABEL, LABEL_JOB, LABEL_MANAGED_BY, MANAGED_BY


def make_objects(
    name: str = "train", namespace: str | None = "ml", spec_hash: str = "hash-1", queue: str | None = None
) -> list[dict[str, Any]]:
    labels = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_JOB: name}
    if queue:
        labels[KUEUE_QUEUE_LABEL] = queue

    def meta(obj_name: str) -> dict[str, Any]:
        md: dict[str, Any] = {
            "name": obj_name,
            "labels": dict(labels),
            "annotations": {ANNOTATION_SPEC_HASH: spec_hash},
        }
        if namespace is not None:
            md["namespace"] = namespace
        return md

    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(f"{name}-spec"),
            "data": {"spec.yaml": f"name: {name}\n"},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(name),
            "spec": {"clusterIP": "None", "selector": {LABEL_JOB: name}, "ports": [{"name": "rdzv", "port": 29500}]},
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": meta(name),
            "spec": {
                "completionMode": "Indexed",
                "completions": 2,
                "parallelism": 2,
                "backoffLimit": 2,
                "template": {
                    "metadata": {"labels": dict(labels)},
                    "spec": {
                        "restartPolicy": "Never",
                        "subdomain": name,
                        "containers": [{"name": "runner", "image": "runner:cpu", "args": ["/etc/jobspec/spec.yaml"]}],
                    },
                },
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta(name),
            "spec": {
                "podSelector": {"matchLabels": {LABEL_JOB: name}},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {"from": [{"podSelector": {"matchLabels": {LABEL_JOB: name}}}], "ports": [{"protocol": "TCP"}]}
                ],
            },
        },
    ]


def prerequisite(kind: str, name: str, namespace: str = "", **body: Any) -> dict[str, Any]:
    """An object the pre-submit checks look for (a claim, a Secret, a Node, ...), for FakeApi.put."""
    api_version = {"PriorityClass": "scheduling.k8s.io/v1", "LocalQueue": "kueue.x-k8s.io/v1beta2",
                   "ClusterQueue": "kueue.x-k8s.io/v1beta2"}.get(kind, "v1")  # fmt: skip
    metadata = {"name": name, "namespace": namespace, **body.pop("metadata", {})}
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **body}


def gpu_node(name: str, resource: str = "nvidia.com/gpu", count: int = 8, **labels: str) -> dict[str, Any]:
    return prerequisite("Node", name, metadata={"labels": labels}, status={"allocatable": {resource: str(count)}})
