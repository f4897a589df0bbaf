"""Render a JobSpec into plain Kubernetes objects: the spec ConfigMap, a headless Service, a NetworkPolicy
(unless `scheduling.network_policy: false`), an Indexed Job, and the shared hub cache's PersistentVolumeClaim
when the model or data come from the hub (render/hub.py).

Pure: no I/O, no cluster, no torch, no kubernetes client; the same spec always gives equal dicts.
`to_yaml` / `to_json` print them for `kubectl apply -f -`; the submitter sends the dicts as they are.

    objs = render(load_spec("examples/sft_fast.yaml"))
    print(to_yaml(objs))
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from jobspec.contract import ANNOTATION_SPEC_HASH
from jobspec.render.env import (
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_NNODES,
    ENV_NODE_RANK,
    ENV_NPROC_PER_NODE,
    ENV_SPEC_HASH,
    SCRATCH_DIR,
    master_addr,
)
from jobspec.render.hub import cache_claim
from jobspec.render.images import DEFAULT_IMAGES, IMAGE_REPOSITORY, default_image, image_for
from jobspec.render.objects import (
    headless_service,
    indexed_job,
    network_policy,
    pod_failure_policy,
    spec_configmap,
)
from jobspec.render.output import to_json, to_yaml
from jobspec.render.pod import (
    CONTAINER_NAME,
    DEFAULT_CPU_PER_RANK,
    DEFAULT_MEMORY_PER_RANK,
    GPU_RESOURCES,
    ROCM_SUPPLEMENTAL_GROUPS,
    WORKDIR,
    checkpoint_mount_path,
    configmap_name,
)
from jobspec.spec.models import JobSpec

__all__ = [
    "CONTAINER_NAME",
    "DEFAULT_CPU_PER_RANK",
    "DEFAULT_IMAGES",
    "DEFAULT_MEMORY_PER_RANK",
    "ENV_MASTER_ADDR",
    "ENV_MASTER_PORT",
    "ENV_NNODES",
    "ENV_NODE_RANK",
    "ENV_NPROC_PER_NODE",
    "ENV_SPEC_HASH",
    "GPU_RESOURCES",
    "IMAGE_REPOSITORY",
    "ROCM_SUPPLEMENTAL_GROUPS",
    "SCRATCH_DIR",
    "WORKDIR",
    "checkpoint_mount_path",
    "configmap_name",
    "default_image",
    "headless_service",
    "image_for",
    "indexed_job",
    "master_addr",
    "network_policy",
    "pod_failure_policy",
    "render",
    "spec_configmap",
    "to_json",
    "to_yaml",
]


def render(spec: JobSpec, task_files: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The objects for one job, in apply order: the hub cache's PersistentVolumeClaim (`model.hub_cache`,
    when the model or data come from the hub), ConfigMap (the spec), headless Service, NetworkPolicy,
    Indexed Job. The policy comes before the Job, so that no pod is ever reachable from outside its job.
    They are in the spec's `namespace` when it names one, else in none (the one they are applied to).

    `task_files`: the text of each relative `eval.benchmarks` task file by its path (read beside the spec file by
    jobspec.spec.benchmarks.ship_task_files): the ConfigMap carries them and the pod mounts them beside the spec.

    Raises ConfigError for a spec that validates but cannot become a pod: a checkpoints.dir on top of
    one of the pod's own mounts (the same path is fine on one machine, so the spec allows it), a relative task
    file outside the spec's directory or whose text `task_files` lacks.
    """
    policy = [network_policy(spec)] if spec.scheduling.network_policy else []
    claim = [c] if (c := cache_claim(spec)) is not None else []  # the hub cache, before the Job that mounts it
    objs = [*claim, spec_configmap(spec, task_files), headless_service(spec), *policy, indexed_job(spec)]
    if "namespace" not in spec.model_fields_set:
        # No namespace written (nor --set): the objects name none, so `kubectl apply` puts them in the kubeconfig
        # context's namespace, as for any manifest; `jobspec submit` places them itself (-n, the context, "default").
        for obj in objs:
            obj["metadata"].pop("namespace", None)
    if task_files:
        _stamp_shipped(objs, spec.spec_hash(), shipped_hash(spec, task_files))
    return objs


def shipped_hash(spec: JobSpec, task_files: Mapping[str, str]) -> str:
    """The spec-hash of a job that ships files beside its spec: the spec's and every shipped file's path and text,
    so that `jobspec submit` sees an edited task file as a changed job (not "unchanged", which applies nothing)."""
    digest = hashlib.sha256(spec.spec_hash().encode())
    for path in sorted(task_files):
        for part in (path, task_files[path]):
            digest.update(len(part.encode()).to_bytes(8, "big") + part.encode())
    return digest.hexdigest()[:16]


def _stamp_shipped(node: Any, spec_hash: str, job_hash: str) -> None:
    """The spec-hash annotations and env value of rendered objects replaced by `job_hash`, in place."""
    if isinstance(node, list):
        for item in node:
            _stamp_shipped(item, spec_hash, job_hash)
    elif isinstance(node, dict):
        for key, value in node.items():
            ours = key == ANNOTATION_SPEC_HASH or (key == "value" and node.get("name") == ENV_SPEC_HASH)
            if ours and value == spec_hash:
                node[key] = job_hash
            else:
                _stamp_shipped(value, spec_hash, job_hash)
