"""The pod of the Indexed Job: one runner container, Pod Security "restricted", GPUs by vendor."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from jobspec.contract import (
    HF_CACHE_MOUNT,
    RDZV_PORT,
    RUN_AS_GID,
    RUN_AS_UID,
    SCRATCH_DIR,
    SHM_MOUNT,
    SPEC_FILE_NAME,
    SPEC_MOUNT_DIR,
    SPEC_PATH,
    TERMINATION_MESSAGE_PATH,
    WORKDIR,
)
from jobspec.errors import ConfigError
from jobspec.render.env import GCS_KEY_DIR, GCS_KEY_PATH, container_env
from jobspec.render.hub import cache_volume
from jobspec.render.images import image_for, pull_policy
from jobspec.spec.benchmarks import shipped_entries, shipped_fields, shipped_paths
from jobspec.spec.models import DEFAULT_MEMORY_PER_RANK, JobSpec, Toleration
from jobspec.spec.units import format_bytes

Obj = dict[str, Any]
GiB = 1024**3

CONTAINER_NAME = "runner"
GPU_RESOURCES: Mapping[str, str] = MappingProxyType({"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"})
# Set by the node lifecycle controller once a node has missed its heartbeats for node-monitor-grace-period.
NODE_LOSS_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
# kube-controller-manager's defaults, which docs/how-to/lost-node.md adds up: --node-monitor-grace-period is 50 s since
# Kubernetes 1.32 (40 s before; kubernetes/kubernetes#126287), --node-monitor-period 5 s.
NODE_MONITOR_GRACE_PERIOD_S = 50
NODE_MONITOR_PERIOD_S = 5
ROCM_SUPPLEMENTAL_GROUPS = (44, 109)  # video, render: owners of /dev/dri and /dev/kfd on common distros

# Requests per rank (a GPU; a process for vendor cpu) when hardware.cpu / hardware.memory are unset.
# Without cpu and memory requests a pod is BestEffort (a GPU request does not count): the first evicted
# under node pressure. Requests, not limits: small enough for the smallest GPU nodes (4 vCPUs, 16 GiB,
# one GPU), and the pod may use more when the node has it. Offload tiers need more: set hardware.memory.
DEFAULT_CPU_PER_RANK: Mapping[str, int] = MappingProxyType({"cuda": 2, "rocm": 2, "cpu": 1})
# (The memory default lives with the spec's hardware section: `jobspec plan` compares offload tiers' host memory to it.)


def configmap_name(spec: JobSpec) -> str:
    return f"{spec.name}-spec"


def pod_spec(spec: JobSpec) -> Obj:
    sched = spec.scheduling
    volumes, mounts = _volumes(spec)
    pod: Obj = {
        "restartPolicy": "Never",
        # With subdomain set, an Indexed Job's pods get hostname `<job>-<index>`, resolvable in the Service.
        "subdomain": spec.name,
        "enableServiceLinks": False,  # no env var per Service in the namespace
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": sched.termination_grace_seconds,  # SIGTERM -> checkpoint -> exit
        "securityContext": _pod_security_context(spec),
        "containers": [_container(spec, mounts)],
        "volumes": volumes,
    }
    if sched.service_account:
        pod["serviceAccountName"] = sched.service_account
    if sched.priority_class:
        pod["priorityClassName"] = sched.priority_class
    if sched.node_selector:
        pod["nodeSelector"] = dict(sched.node_selector)
    pod["tolerations"] = [_toleration(t) for t in sched.tolerations] + _node_loss_tolerations(spec)
    if spec.image.pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in spec.image.pull_secrets]
    return pod


def _pod_security_context(spec: JobSpec) -> Obj:
    # Pod Security "restricted", pod half: non-root, seccomp RuntimeDefault.
    context: Obj = {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_UID,
        "runAsGroup": RUN_AS_GID,
        "fsGroup": RUN_AS_GID,
        # Without this every pod start chowns the whole checkpoint PVC: minutes once it holds checkpoints.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    groups = spec.hardware.supplemental_groups
    if groups is None and spec.hardware.vendor == "rocm":
        groups = list(ROCM_SUPPLEMENTAL_GROUPS)  # a non-root user needs them to open /dev/kfd and /dev/dri
    if groups:
        context["supplementalGroups"] = list(groups)
    return context


def _container_security_context() -> Obj:
    # Pod Security "restricted", container half: no escalation, no capabilities.
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        # The runner writes only to the checkpoint dir, /dev/shm and the /tmp emptyDir (caches are sent
        # there by env.SCRATCH_ENV), so a read-only root costs nothing and a stray write fails loudly
        # instead of filling the node's container layer.
        "readOnlyRootFilesystem": True,
    }


def _container(spec: JobSpec, mounts: list[Obj]) -> Obj:
    image = image_for(spec)  # reads the record of pushed images once
    container: Obj = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": pull_policy(spec, image),
        "args": [SPEC_PATH],  # the image's ENTRYPOINT is `python -m runner`
        "workingDir": WORKDIR,
        "env": container_env(spec),
        "ports": [{"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,  # the runner writes its failure reason here
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.env_from_secrets:
        container["envFrom"] = [{"secretRef": {"name": name}} for name in spec.env_from_secrets]
    return container


def _resources(spec: JobSpec) -> Obj:
    """QoS Burstable, never BestEffort: cpu and memory are always requested. Never Guaranteed either,
    which needs a CPU limit: throttling stalls dataloaders and collectives."""
    hw = spec.hardware
    ranks = hw.gpus.count
    requests: Obj = {"cpu": hw.cpu if hw.cpu is not None else str(DEFAULT_CPU_PER_RANK[hw.vendor] * ranks)}
    limits: Obj = {}
    if hw.memory is not None:
        # request = limit: the pod is evicted only after those using more than they asked for; the /dev/shm
        # emptyDir counts against it.
        requests["memory"] = limits["memory"] = format_bytes(hw.memory)
    else:  # a default guess is no limit: it would OOM-kill a run that the node could have carried
        requests["memory"] = format_bytes(DEFAULT_MEMORY_PER_RANK[hw.vendor] * ranks)
    if hw.vendor in GPU_RESOURCES:
        requests[GPU_RESOURCES[hw.vendor]] = limits[GPU_RESOURCES[hw.vendor]] = hw.gpus.count
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def checkpoint_mount_path(spec: JobSpec) -> str:
    """Where the run directory is in the pod: `checkpoints.dir` (or `checkpoints.local_dir` when that is an object
    store, where an emptyDir stages the checkpoints); a relative dir resolves against WORKDIR, the runner's cwd."""
    return posixpath.normpath(posixpath.join(WORKDIR, spec.run_dir))


def _volumes(spec: JobSpec) -> tuple[list[Obj], list[Obj]]:
    """Volumes and their mounts, of the types Pod Security "restricted" allows (configMap, emptyDir, PVC, secret)."""
    checkpoint_dir = checkpoint_mount_path(spec)
    if checkpoint_dir in (SPEC_MOUNT_DIR, SHM_MOUNT, SCRATCH_DIR, HF_CACHE_MOUNT):
        raise ConfigError(
            f"checkpoints.{'local_dir' if spec.remote_dir else 'dir'}: {spec.run_dir!r} would hide the pod's own "
            f"{checkpoint_dir} mount; "
            "use a directory of its own, e.g. /checkpoints"
        )
    pvc = spec.checkpoints.pvc
    # Without a PVC the checkpoints live (and die) with the pod, but the run directory stays writable.
    checkpoints = {"persistentVolumeClaim": {"claimName": pvc}} if pvc else {"emptyDir": {}}
    spec_volume: Obj = {"name": configmap_name(spec)}
    shipped = shipped_paths(shipped_entries(spec), fields=shipped_fields(spec))
    if shipped:  # the task files at their paths relative to the spec (a key alone cannot hold a `/`)
        spec_volume["items"] = [{"key": SPEC_FILE_NAME, "path": SPEC_FILE_NAME},
                                *({"key": key, "path": path} for key, path in shipped)]  # fmt: skip
    volumes = [
        {"name": "spec", "configMap": spec_volume},
        # Docker's 64 MB /dev/shm breaks DataLoader workers and NCCL: memory-backed, with a limit.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(spec.hardware.shm_size)}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "checkpoints", **checkpoints},
    ]
    mounts = [
        {"name": "spec", "mountPath": SPEC_MOUNT_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": SHM_MOUNT},
        {"name": "scratch", "mountPath": SCRATCH_DIR},
        {"name": "checkpoints", "mountPath": checkpoint_dir},
    ]
    if pvc and spec.checkpoint_sub_path:  # each job its own directory on a shared volume
        mounts[-1]["subPath"] = spec.checkpoint_sub_path
    if spec.data.pvc:  # training data, read-only: a bug in the runner cannot damage the data set
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": spec.data.pvc, "readOnly": True}})
        mounts.append({"name": "data", "mountPath": spec.data.mount_path, "readOnly": True})
    key = spec.gcs_credentials
    if key is not None:  # a service-account key for gs://, as a file (GOOGLE_APPLICATION_CREDENTIALS names it)
        secret: Obj = {"secretName": key.secret, "items": [{"key": key.key, "path": posixpath.basename(GCS_KEY_PATH)}],
                       "defaultMode": 0o440, **({"optional": True} if key.optional else {})}  # fmt: skip
        volumes.append({"name": "gcs-credentials", "secret": secret})
        mounts.append({"name": "gcs-credentials", "mountPath": GCS_KEY_DIR, "readOnly": True})
    cache = cache_volume(spec)  # HF_HOME, when the model or data come from the hub
    if cache is not None:
        volumes.append(cache[0])
        mounts.append(cache[1])
    return volumes, mounts


def _node_loss_tolerations(spec: JobSpec) -> list[Obj]:
    """Evicted `scheduling.node_loss_toleration_seconds` after the node is marked lost, not Kubernetes' default 300 s
    (docs/how-to/lost-node.md). A spec's own NoExecute toleration of one of these keys wins."""
    own = {t.key for t in spec.scheduling.tolerations if t.effect in (None, "NoExecute")}
    seconds = spec.scheduling.node_loss_toleration_seconds
    return [{"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
            for key in NODE_LOSS_TAINTS if key not in own]  # fmt: skip


def _toleration(t: Toleration) -> Obj:
    fields = {
        "key": t.key,
        "operator": t.operator,
        "value": t.value,
        "effect": t.effect,
        "tolerationSeconds": t.toleration_seconds,
    }
    return {name: value for name, value in fields.items() if value is not None}
