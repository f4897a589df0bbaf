"""The runner container's environment: cache locations, allocator settings, the user's env, rendezvous."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from jobspec.contract import (
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_NNODES,
    ENV_NODE_RANK,
    ENV_NPROC_PER_NODE,
    ENV_SPEC_HASH,
    RDZV_PORT,
    SCRATCH_DIR,
)
from jobspec.render.hub import hub_env
from jobspec.spec.models import JobSpec, SecretRef

COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"

# expandable_segments cuts fragmentation, so the micro-batch the planner measured keeps fitting.
# torch >= 2.9 reads PYTORCH_ALLOC_CONF first and then skips the deprecated vendor names (no
# warning); older torch reads only the vendor name. No NCCL_* / HSA_* defaults: NCCL and RCCL pick
# interfaces and transports themselves, and a wrong guess is worse than none (users add them in `env`).
_ALLOC_CONF = "expandable_segments:True"
VENDOR_ENV: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "cuda": {"PYTORCH_ALLOC_CONF": _ALLOC_CONF, "PYTORCH_CUDA_ALLOC_CONF": _ALLOC_CONF},
    "rocm": {"PYTORCH_ALLOC_CONF": _ALLOC_CONF, "PYTORCH_HIP_ALLOC_CONF": _ALLOC_CONF},
    "cpu": {},
})  # fmt: skip

# The root filesystem is read-only, so caches that default to $HOME or /tmp/<user> go to the /tmp
# emptyDir: the HF hub (via XDG_CACHE_HOME), Triton and Inductor kernels, MIOpen and the CUDA JIT cache
# (via HOME). A hub model or dataset puts HF_HOME on its own volume (render/hub.py). The user's `env`
# overrides any of these.
SCRATCH_ENV: Mapping[str, str] = MappingProxyType({
    "HOME": SCRATCH_DIR,
    "XDG_CACHE_HOME": f"{SCRATCH_DIR}/.cache",
    "TRITON_CACHE_DIR": f"{SCRATCH_DIR}/.triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_DIR}/torchinductor",
})  # fmt: skip


# gcs_credentials: the service-account key's Secret, mounted read-only here (render/pod.py), the file Google's
# application default credentials read (gcsfs, google-auth): the key is never in the manifest or the environment.
GCS_KEY_DIR = "/var/run/secrets/jobspec/gcs"
GCS_KEY_PATH = f"{GCS_KEY_DIR}/key.json"


def master_addr(spec: JobSpec) -> str:
    # Index 0's pod hostname is `<job>-0`; the headless Service, named like the Job, is its subdomain.
    return f"{spec.name}-0.{spec.name}"


def container_env(spec: JobSpec) -> list[dict[str, Any]]:
    """Runtime defaults, then the user's env (wins over defaults), then the rendezvous contract."""
    env = {name: _plain(name, value) for name, value in {**SCRATCH_ENV, **VENDOR_ENV[spec.hardware.vendor]}.items()}
    env.update({name: _user_var(name, value) for name, value in tracker_env(spec).items()})
    env.update({name: _user_var(name, value) for name, value in hub_env(spec).items()})
    if spec.gcs_credentials is not None:
        env["GOOGLE_APPLICATION_CREDENTIALS"] = _plain("GOOGLE_APPLICATION_CREDENTIALS", GCS_KEY_PATH)
    env.update({name: _user_var(name, value) for name, value in spec.env.items()})
    index_path = f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"
    env[ENV_NODE_RANK] = {"name": ENV_NODE_RANK, "valueFrom": {"fieldRef": {"fieldPath": index_path}}}
    contract = {
        ENV_NNODES: str(spec.hardware.nodes),
        ENV_NPROC_PER_NODE: str(spec.hardware.gpus.count),
        ENV_MASTER_ADDR: master_addr(spec),
        ENV_MASTER_PORT: str(RDZV_PORT),
        ENV_SPEC_HASH: spec.spec_hash(),
    }
    env.update({name: _plain(name, value) for name, value in contract.items()})
    return list(env.values())


def tracker_env(spec: JobSpec) -> dict[str, str | SecretRef]:
    """The trackers' credentials (secret references) and settings, under the names their clients read."""
    t, env = spec.tracking, {}
    if t.wandb is not None:
        env["WANDB_PROJECT"] = t.wandb.project
        if t.wandb.entity:
            env["WANDB_ENTITY"] = t.wandb.entity
        if t.wandb.api_key is not None:
            env["WANDB_API_KEY"] = t.wandb.api_key
    if t.mlflow is not None:
        if t.mlflow.tracking_uri:
            env["MLFLOW_TRACKING_URI"] = t.mlflow.tracking_uri
        secrets = {"MLFLOW_TRACKING_TOKEN": t.mlflow.token, "MLFLOW_TRACKING_USERNAME": t.mlflow.username,
                   "MLFLOW_TRACKING_PASSWORD": t.mlflow.password}  # fmt: skip
        env.update({name: ref for name, ref in secrets.items() if ref is not None})
    return env


def _plain(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _user_var(name: str, value: str | SecretRef) -> dict[str, Any]:
    if isinstance(value, SecretRef):  # by reference only: the value never enters the manifest
        ref: dict[str, Any] = {"name": value.secret, "key": value.key}
        if value.optional:
            ref["optional"] = True
        return {"name": name, "valueFrom": {"secretKeyRef": ref}}
    return _plain(name, value)
