"""Render a JobSpec into plain Kubernetes objects: the spec ConfigMap, a headless Service, an Indexed Job.

Pure: no I/O, no cluster, no torch, no kubernetes client; the same spec always gives the same
dicts. `to_yaml` / `to_json` print them for `kubectl apply -f -`; the submitter sends them as-is.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import BaseModel

from jobspec import __version__
from jobspec.contract import (
    ANNOTATION_SPEC_HASH,
    EXIT_CONFIG,
    EXIT_OOM_LAST_TIER,
    EXIT_OOM_RETRY_TIER,
    KUEUE_QUEUE_LABEL,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
    RDZV_PORT,
    RUN_AS_GID,
    RUN_AS_UID,
    SHM_MOUNT,
    SPEC_FILE_NAME,
    SPEC_MOUNT_DIR,
    SPEC_PATH,
    TERMINATION_MESSAGE_PATH,
)
from jobspec.errors import ConfigError
from jobspec.spec import JobSpec, SecretRef, Toleration
from jobspec.units import format_bytes

Obj = dict[str, Any]

IMAGE_REPOSITORY = "ghcr.io/jobspec/runner"
DEFAULT_IMAGES: Mapping[str, str] = MappingProxyType(
    {vendor: f"{IMAGE_REPOSITORY}:{__version__}-{vendor}" for vendor in ("cuda", "rocm", "cpu")}
)
GPU_RESOURCES: Mapping[str, str] = MappingProxyType({"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"})
ROCM_SUPPLEMENTAL_GROUPS = (44, 109)  # video, render: owners of /dev/dri and /dev/kfd on common distros

CONTAINER_NAME = "runner"
WORKDIR = "/workspace"  # the pod's working directory; relative spec paths resolve here
SCRATCH_DIR = "/tmp"  # the only writable place besides the checkpoint dir and /dev/shm
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"

# Environment the runner reads (the rendezvous half of the multi-node contract).
ENV_NODE_RANK = "JOBSPEC_NODE_RANK"
ENV_NNODES = "JOBSPEC_NNODES"
ENV_NPROC_PER_NODE = "JOBSPEC_NPROC_PER_NODE"
ENV_MASTER_ADDR = "JOBSPEC_MASTER_ADDR"
ENV_MASTER_PORT = "JOBSPEC_MASTER_PORT"
ENV_SPEC_HASH = "JOBSPEC_SPEC_HASH"  # lets the runner notice a ConfigMap replaced under a running Job
RESERVED_ENV_PREFIX = "JOBSPEC_"

# expandable_segments cuts fragmentation, so the micro-batch the planner measured keeps fitting.
# torch >= 2.9 reads PYTORCH_ALLOC_CONF first (and then skips the deprecated vendor names, so no
# warning); older torch reads only the vendor name.
_ALLOC_CONF = "expandable_segments:True"
_VENDOR_ENV: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "cuda": {"PYTORCH_ALLOC_CONF": _ALLOC_CONF, "PYTORCH_CUDA_ALLOC_CONF": _ALLOC_CONF},
    "rocm": {"PYTORCH_ALLOC_CONF": _ALLOC_CONF, "PYTORCH_HIP_ALLOC_CONF": _ALLOC_CONF},
    "cpu": {},
})
# The root filesystem is read-only, so every cache that defaults to $HOME or /tmp/<user> must land in
# the /tmp emptyDir: HF hub (via XDG), Triton and Inductor kernels, MIOpen and CUDA JIT caches (via HOME).
_SCRATCH_ENV: Mapping[str, str] = MappingProxyType({
    "HOME": SCRATCH_DIR,
    "XDG_CACHE_HOME": f"{SCRATCH_DIR}/.cache",
    "TRITON_CACHE_DIR": f"{SCRATCH_DIR}/.triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_DIR}/torchinductor",
})


def render(spec: JobSpec) -> list[Obj]:
    """The objects for one job, in apply order: ConfigMap (spec), headless Service, Indexed Job."""
    return [spec_configmap(spec), headless_service(spec), indexed_job(spec)]


def default_image(vendor: str) -> str:
    return DEFAULT_IMAGES[vendor]


def image_for(spec: JobSpec) -> str:
    return spec.image.name or default_image(spec.hardware.vendor)


def configmap_name(spec: JobSpec) -> str:
    return f"{spec.name}-spec"


def master_addr(spec: JobSpec) -> str:
    # Index 0's pod hostname is `<job>-0`; the headless Service (named like the Job) is its subdomain.
    return f"{spec.name}-0.{spec.name}"


# --- objects ------------------------------------------------------------------------------------


def spec_configmap(spec: JobSpec) -> Obj:
    text = yaml.safe_dump(_spec_document(spec), sort_keys=False)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(spec, configmap_name(spec)),
            "data": {SPEC_FILE_NAME: text}}  # fmt: skip


def headless_service(spec: JobSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, spec.name),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: spec.name},
            # Rendezvous happens before any pod is Ready: DNS must list them from the start.
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}],
        },
    }


def indexed_job(spec: JobSpec) -> Obj:
    sched, nodes = spec.scheduling, spec.hardware.nodes
    metadata = _metadata(spec, spec.name)
    job: Obj = {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        # All ranks step in lockstep, so one incident fails every pod once: count failures per index
        # (one tier step costs each index one), and fail the Job as soon as any index runs out.
        "backoffLimitPerIndex": sched.backoff_limit,
        "maxFailedIndexes": 0,
        # Same budget where backoffLimitPerIndex is unavailable (feature gate off): the field is dropped.
        "backoffLimit": sched.backoff_limit * nodes,
        "podFailurePolicy": pod_failure_policy(),
        "podReplacementPolicy": "Failed",  # never two pods for one rank (and required by podFailurePolicy)
    }
    if sched.queue:
        metadata["labels"][KUEUE_QUEUE_LABEL] = sched.queue
        job["suspend"] = True  # Kueue admits the Job by unsuspending it
    if sched.ttl_seconds_after_finished is not None:
        job["ttlSecondsAfterFinished"] = sched.ttl_seconds_after_finished
    if sched.active_deadline_seconds is not None:
        job["activeDeadlineSeconds"] = sched.active_deadline_seconds
    job["template"] = _pod_template(spec)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": job}


def pod_failure_policy() -> Obj:
    """Follows the runner's exit-code contract (jobspec.contract); rules match in order."""
    return {
        "rules": [
            # Preemption, eviction, node drain: not the job's fault, costs no retry.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # Retrying cannot help: a bad spec, or OOM at the last memory tier.
            {"action": "FailJob", "onExitCodes": _exit_codes(EXIT_CONFIG, EXIT_OOM_LAST_TIER)},
            # OOM at micro-batch 1: the replacement pod resumes one tier down (state beside the checkpoints).
            {"action": "Count", "onExitCodes": _exit_codes(EXIT_OOM_RETRY_TIER)},
        ]
    }


def _exit_codes(*codes: int) -> Obj:
    return {"containerName": CONTAINER_NAME, "operator": "In", "values": sorted(codes)}  # API wants them sorted


# --- pod ----------------------------------------------------------------------------------------


def _pod_template(spec: JobSpec) -> Obj:
    sched = spec.scheduling
    volumes, mounts = _volumes(spec)
    pod: Obj = {
        "restartPolicy": "Never",
        # With subdomain set, an Indexed Job's pods get hostname `<job>-<index>`, resolvable in the Service.
        "subdomain": spec.name,
        "enableServiceLinks": False,  # no env var per Service in the namespace
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": sched.termination_grace_seconds,
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
    if sched.tolerations:
        pod["tolerations"] = [_toleration(t) for t in sched.tolerations]
    if spec.image.pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in spec.image.pull_secrets]
    return {"metadata": {"labels": _labels(spec), "annotations": _annotations(spec)}, "spec": pod}


def _pod_security_context(spec: JobSpec) -> Obj:
    # Pod Security "restricted": non-root, seccomp RuntimeDefault (container half in _container_security_context).
    context: Obj = {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_UID,
        "runAsGroup": RUN_AS_GID,
        "fsGroup": RUN_AS_GID,
        # Without this every pod start chowns the whole checkpoint PVC, which takes minutes once it is full.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    groups = spec.hardware.supplemental_groups
    if groups is None and spec.hardware.vendor == "rocm":
        groups = list(ROCM_SUPPLEMENTAL_GROUPS)  # /dev/kfd and /dev/dri for a non-root user
    if groups:
        context["supplementalGroups"] = list(groups)
    return context


def _container_security_context() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        # Read-only root: the runner writes only to the checkpoint dir, /dev/shm and the /tmp emptyDir
        # (caches are pointed there by _SCRATCH_ENV), so a stray write fails loudly instead of filling
        # the node's container layer.
        "readOnlyRootFilesystem": True,
    }


def _container(spec: JobSpec, mounts: list[Obj]) -> Obj:
    container: Obj = {
        "name": CONTAINER_NAME,
        "image": image_for(spec),
        "imagePullPolicy": spec.image.pull_policy,
        "args": [SPEC_PATH],  # the image's ENTRYPOINT is `python -m runner`
        "workingDir": WORKDIR,
        "env": _env(spec),
        "ports": [{"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.env_from_secrets:
        container["envFrom"] = [{"secretRef": {"name": name}} for name in spec.env_from_secrets]
    return container


def _env(spec: JobSpec) -> list[Obj]:
    """Runtime defaults, then the user's env (wins over defaults), then the rendezvous contract."""
    reserved = sorted(k for k in spec.env if k.startswith(RESERVED_ENV_PREFIX))
    if reserved:
        raise ConfigError(
            f"env.{reserved[0]}: names starting with {RESERVED_ENV_PREFIX} are set by jobspec; rename the variable"
        )
    plain = {**_SCRATCH_ENV, **_VENDOR_ENV[spec.hardware.vendor]}
    env: dict[str, Obj] = {name: {"name": name, "value": value} for name, value in plain.items()}
    for name, value in spec.env.items():
        env[name] = _env_var(name, value)
    env[ENV_NODE_RANK] = {
        "name": ENV_NODE_RANK,
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
    }
    contract = {
        ENV_NNODES: str(spec.hardware.nodes),
        ENV_NPROC_PER_NODE: str(spec.hardware.gpus.count),
        ENV_MASTER_ADDR: master_addr(spec),
        ENV_MASTER_PORT: str(RDZV_PORT),
        ENV_SPEC_HASH: spec.spec_hash(),
    }
    env.update({name: {"name": name, "value": value} for name, value in contract.items()})
    return list(env.values())


def _env_var(name: str, value: str | SecretRef) -> Obj:
    if isinstance(value, SecretRef):  # by reference only: the value never enters the manifest
        ref: Obj = {"name": value.secret, "key": value.key}
        if value.optional:
            ref["optional"] = True
        return {"name": name, "valueFrom": {"secretKeyRef": ref}}
    return {"name": name, "value": value}


def _resources(spec: JobSpec) -> Obj:
    hw = spec.hardware
    requests: Obj = {}
    limits: Obj = {}
    if hw.cpu is not None:
        requests["cpu"] = hw.cpu  # no CPU limit: throttling stalls dataloaders and collectives
    if hw.memory is not None:
        # request = limit: the kubelet never reclaims from us (the /dev/shm emptyDir counts against it too).
        requests["memory"] = limits["memory"] = format_bytes(hw.memory)
    if hw.vendor in GPU_RESOURCES:
        requests[GPU_RESOURCES[hw.vendor]] = limits[GPU_RESOURCES[hw.vendor]] = hw.gpus.count
    resources: Obj = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _volumes(spec: JobSpec) -> tuple[list[Obj], list[Obj]]:
    """Volumes and their mounts; only types Pod Security "restricted" allows (configMap, emptyDir, PVC)."""
    checkpoint_dir = checkpoint_mount_path(spec)
    fixed = {SPEC_MOUNT_DIR, SHM_MOUNT, SCRATCH_DIR}
    if checkpoint_dir in fixed:
        raise ConfigError(
            f"checkpoints.dir: {spec.checkpoints.dir!r} would replace the pod's {checkpoint_dir} mount; "
            "use a directory of its own, e.g. /checkpoints"
        )
    pvc = spec.checkpoints.pvc
    volumes = [
        {"name": "spec", "configMap": {"name": configmap_name(spec)}},
        # Docker's 64 MB /dev/shm breaks DataLoader workers and NCCL; memory-backed with a limit.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(spec.hardware.shm_size)}},
        {"name": "scratch", "emptyDir": {}},
        # Without a PVC the checkpoints live (and die) with the pod, but the directory is still writable.
        {"name": "checkpoints", **({"persistentVolumeClaim": {"claimName": pvc}} if pvc else {"emptyDir": {}})},
    ]
    mounts = [
        {"name": "spec", "mountPath": SPEC_MOUNT_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": SHM_MOUNT},
        {"name": "scratch", "mountPath": SCRATCH_DIR},
        {"name": "checkpoints", "mountPath": checkpoint_dir},
    ]
    return volumes, mounts


def checkpoint_mount_path(spec: JobSpec) -> str:
    """Where `checkpoints.dir` lands in the pod: relative dirs resolve against WORKDIR (the runner's cwd)."""
    return posixpath.normpath(posixpath.join(WORKDIR, spec.checkpoints.dir))


def _toleration(t: Toleration) -> Obj:
    fields = {"key": t.key, "operator": t.operator, "value": t.value, "effect": t.effect,
              "tolerationSeconds": t.toleration_seconds}  # fmt: skip
    return {k: v for k, v in fields.items() if v is not None}


# --- metadata and the spec document -------------------------------------------------------------


def _metadata(spec: JobSpec, name: str) -> Obj:
    return {"name": name, "namespace": spec.namespace, "labels": _labels(spec), "annotations": _annotations(spec)}


def _labels(spec: JobSpec) -> Obj:
    # Ours last: a user label must not break the Service selector or `jobspec status`.
    return {**spec.scheduling.labels, LABEL_MANAGED_BY: MANAGED_BY, LABEL_NAME: "jobspec", LABEL_JOB: spec.name}


def _annotations(spec: JobSpec) -> Obj:
    return {**spec.scheduling.annotations, ANNOTATION_SPEC_HASH: spec.spec_hash()}


def _spec_document(spec: JobSpec) -> Obj:
    doc = spec.to_yaml_dict()
    _restore_nulls(spec, doc)
    return doc


def _restore_nulls(model: BaseModel, doc: Obj) -> None:
    # to_yaml_dict() drops every None, so an explicit `null` overriding a non-None default
    # (training.max_grad_norm, scheduling.ttl_seconds_after_finished) would read back as the default.
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if value is None:
            if field.is_required() or field.get_default(call_default_factory=True) is not None:
                doc[name] = None
        elif isinstance(value, BaseModel) and isinstance(doc.get(name), dict):
            _restore_nulls(value, doc[name])
        elif isinstance(value, list) and isinstance(doc.get(name), list):
            for item, sub in zip(value, doc[name]):
                if isinstance(item, BaseModel) and isinstance(sub, dict):
                    _restore_nulls(item, sub)


# --- output -------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded spec) as `|` blocks, so the ConfigMap stays readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def to_yaml(objs: list[Obj]) -> str:
    """Multi-document YAML (`---` between objects), for `kubectl apply -f -`."""
    return "---\n".join(yaml.dump(obj, Dumper=_Dumper, sort_keys=False) for obj in objs)


def to_json(objs: list[Obj]) -> str:
    """One `v1 List`, for `kubectl apply -f -` and tools that want JSON."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}, indent=2) + "\n"
