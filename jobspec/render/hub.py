"""The Hugging Face cache of the pod (`model.hub_cache`): a PersistentVolumeClaim at HF_HOME whenever the
model, the data or an `eval.benchmarks` task's data set come from the hub, so that a restart, a replaced pod and the
next job read the files the first download left there (Kubeflow Trainer's model initializer does the same on its
volume).

`claim: auto` renders a claim named by access mode (`jobspec-hf-cache-rwx` ...), shared by every job of the
namespace: it has no owner and no job label, so neither the Job's garbage collection nor `jobspec cancel`
removes it, and `jobspec submit` creates it only when it is missing (the first job's size and class stay).
A named claim is the user's: mounted, never rendered. `claim: none` is an emptyDir that dies with the pod.
Presets and local paths mount nothing: nothing comes from the hub.
"""

from __future__ import annotations

from typing import Any

from jobspec.contract import HF_CACHE_MOUNT, LABEL_MANAGED_BY, LABEL_NAME, MANAGED_BY
from jobspec.errors import ConfigError
from jobspec.spec.benchmarks import hub_tasks
from jobspec.spec.hub import hub_sources
from jobspec.spec.models import HUB_CACHE_CLAIM, JobSpec, SecretRef
from jobspec.spec.units import format_bytes

Obj = dict[str, Any]
VOLUME = "hf-cache"
_SUFFIX = {"ReadWriteMany": "rwx", "ReadWriteOnce": "rwo", "ReadWriteOncePod": "rwop"}


def mounts_cache(spec: JobSpec) -> bool:
    """The pod gets a hub cache volume: something comes from the hub (a benchmark task's data set too)."""
    return bool(hub_sources(spec)) or bool(spec.output.export and hub_tasks(spec.eval.benchmarks))


def access_mode(spec: JobSpec) -> str:
    """The access mode of the claim jobspec creates: every node of a multi-node job mounts it."""
    mode = spec.model.hub_cache.access_mode
    if mode == "auto":
        return "ReadWriteMany" if spec.hardware.nodes > 1 else "ReadWriteOnce"
    if spec.hardware.nodes > 1 and mode != "ReadWriteMany":
        raise ConfigError(
            f"model.hub_cache.access_mode {mode} with hardware.nodes {spec.hardware.nodes}: the pods of the other "
            "nodes could not mount the cache; use ReadWriteMany (a storage class that offers it: NFS, CephFS, "
            "EFS, Filestore...) or `model.hub_cache: none`"
        )
    return mode


def claim_name(spec: JobSpec) -> str | None:
    """The claim the pod mounts at HF_HOME; None for an emptyDir."""
    claim = spec.model.hub_cache.claim
    if claim == "none":
        return None
    return f"{HUB_CACHE_CLAIM}-{_SUFFIX[access_mode(spec)]}" if claim == "auto" else claim


def cache_claim(spec: JobSpec) -> Obj | None:
    """The PersistentVolumeClaim to render: only for `claim: auto` when something comes from the hub."""
    if not mounts_cache(spec) or spec.model.hub_cache.claim != "auto":
        return None
    cache = spec.model.hub_cache
    claim_spec: Obj = {
        "accessModes": [access_mode(spec)],
        "volumeMode": "Filesystem",
        "resources": {"requests": {"storage": format_bytes(cache.size)}},
    }
    if cache.storage_class is not None:
        claim_spec["storageClassName"] = cache.storage_class
    # No job label and no spec-hash: the claim belongs to no job (cancel and the Job's TTL leave it).
    labels = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_NAME: "jobspec"}
    metadata = {"name": claim_name(spec), "namespace": spec.namespace, "labels": labels}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": claim_spec}


def cache_volume(spec: JobSpec) -> tuple[Obj, Obj] | None:
    """(volume, mount) of the cache at HF_CACHE_MOUNT, or None when nothing comes from the hub."""
    if not mounts_cache(spec):
        return None
    claim = claim_name(spec)
    source: Obj = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    return {"name": VOLUME, **source}, {"name": VOLUME, "mountPath": HF_CACHE_MOUNT}


def hub_env(spec: JobSpec) -> dict[str, str | SecretRef]:
    """HF_HOME on the cache volume, and the hub token by reference (huggingface_hub reads HF_TOKEN)."""
    env: dict[str, str | SecretRef] = {"HF_HOME": HF_CACHE_MOUNT} if mounts_cache(spec) else {}
    if spec.model.hub_token is not None:
        env["HF_TOKEN"] = spec.model.hub_token
    return env
