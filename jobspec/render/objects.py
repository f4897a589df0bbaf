"""The objects of a job: the spec ConfigMap, the headless Service, the NetworkPolicy and the Indexed Job."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from jobspec.contract import (
    ANNOTATION_SPEC_HASH,
    EXIT_CONFIG,
    EXIT_OOM_LAST_TIER,
    EXIT_OOM_RETRY_TIER,
    EXIT_STORAGE,
    KUEUE_QUEUE_LABEL,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
    RDZV_PORT,
    SPEC_FILE_NAME,
)
from jobspec.errors import ConfigError
from jobspec.render.pod import CONTAINER_NAME, configmap_name, pod_spec
from jobspec.spec.benchmarks import is_task_file, shipped_entries, shipped_fields, shipped_paths
from jobspec.spec.models import JobSpec

Obj = dict[str, Any]


def spec_configmap(spec: JobSpec, task_files: Mapping[str, str] | None = None) -> Obj:
    """The spec as YAML under `spec.yaml`; the pod mounts it and the runner reads back an equal spec. Beside it, each
    relative `eval.benchmarks` task file (`task_files`: its path -> its text, jobspec.spec.benchmarks.ship_task_files)
    under its own key, which the pod mounts at the same path relative to the spec."""
    data = {SPEC_FILE_NAME: yaml.safe_dump(spec_document(spec), sort_keys=False)}
    for key, path in shipped_paths(shipped_entries(spec), fields=shipped_fields(spec)):
        if task_files is None or path not in task_files:
            what = "eval.benchmarks: {} is a task file" if is_task_file(path) else "training.grpo.rewards: {} is a file"
            raise ConfigError(f"{what.format(path)} relative to the spec file, and its text was not given to render: "
                              "render the spec file (`jobspec render SPEC_FILE`), which reads it beside the "
                              "spec")  # fmt: skip
        data[key] = task_files[path]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(spec, configmap_name(spec)), "data": data}


def headless_service(spec: JobSpec) -> Obj:
    """DNS for the pods (`<job>-<index>.<job>`), so every rank finds rank 0."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, spec.name),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: spec.name},
            # Rendezvous happens before any pod is Ready, so DNS must list pods from the start.
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}],
        },
    }


def network_policy(spec: JobSpec) -> Obj:
    """Ingress to the job's pods from the job's own pods only, on every TCP port; egress stays open.

    torch's TCPStore (the rendezvous port) has no authentication, and NCCL's bootstrap and socket transport
    and gloo listen on ephemeral ports, so no fixed port list can work: the pods of one job reach each
    other on any TCP port, and nothing else reaches them on any port (they serve nothing: no probes, no
    metrics endpoint). The kubelet's own traffic from the node is always allowed by NetworkPolicy.
    """

    def same_job() -> Obj:  # a fresh dict each time: no object shared inside the output
        return {"matchLabels": {LABEL_JOB: spec.name}}

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(spec, spec.name),
        "spec": {
            "podSelector": same_job(),
            "policyTypes": ["Ingress"],  # Egress not listed: the hub, trackers and data stay reachable
            # podSelector without namespaceSelector: pods of this namespace only.
            "ingress": [{"from": [{"podSelector": same_job()}], "ports": [{"protocol": "TCP"}]}],  # no port: all
        },
    }


def indexed_job(spec: JobSpec) -> Obj:
    """One pod per node; the completion index is the node rank."""
    sched, nodes = spec.scheduling, spec.hardware.nodes
    metadata = _metadata(spec, spec.name)
    job: Obj = {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        # Ranks run in lockstep, so one incident (a tier step, a crash) fails every pod once: budget
        # failures per index, and fail the Job as soon as any index has spent its budget.
        "backoffLimitPerIndex": sched.backoff_limit,
        "maxFailedIndexes": 0,
        # The same budget over all indexes, for clusters that drop backoffLimitPerIndex (feature gate off).
        "backoffLimit": sched.backoff_limit * nodes,
        "podFailurePolicy": pod_failure_policy(),
        "podReplacementPolicy": "Failed",  # never two pods for one rank; podFailurePolicy requires it too
    }
    if sched.queue:
        metadata["labels"][KUEUE_QUEUE_LABEL] = sched.queue
        job["suspend"] = True  # Kueue admits the Job by unsuspending it
    if sched.ttl_seconds_after_finished is not None:
        job["ttlSecondsAfterFinished"] = sched.ttl_seconds_after_finished
    if sched.active_deadline_seconds is not None:
        job["activeDeadlineSeconds"] = sched.active_deadline_seconds
    job["template"] = {"metadata": {"labels": _labels(spec), "annotations": _annotations(spec)}, "spec": pod_spec(spec)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": job}


def pod_failure_policy() -> Obj:
    """The runner's exit-code contract (jobspec.contract) as Job rules; the first matching rule wins."""
    return {
        "rules": [
            # Preemption, eviction, node drain: not the job's fault, costs no retry.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # Retrying cannot help: a bad spec (or a run directory held by another run, or without an intact
            # checkpoint), a full or read-only checkpoint volume, or OOM at the last memory tier.
            {"action": "FailJob", "onExitCodes": _exit_codes(EXIT_CONFIG, EXIT_STORAGE, EXIT_OOM_LAST_TIER)},
            # OOM at micro-batch 1: the replacement pod resumes one tier down (state kept by the checkpoints).
            {"action": "Count", "onExitCodes": _exit_codes(EXIT_OOM_RETRY_TIER)},
        ]
    }


def _exit_codes(*codes: int) -> Obj:
    return {"containerName": CONTAINER_NAME, "operator": "In", "values": sorted(codes)}  # the API wants them sorted


def _metadata(spec: JobSpec, name: str) -> Obj:
    return {"name": name, "namespace": spec.namespace, "labels": _labels(spec), "annotations": _annotations(spec)}


def _labels(spec: JobSpec) -> Obj:
    # Ours last: a user label must not break the Service selector or the CLI's lookups.
    return {**spec.scheduling.labels, LABEL_MANAGED_BY: MANAGED_BY, LABEL_NAME: "jobspec", LABEL_JOB: spec.name}


def _annotations(spec: JobSpec) -> Obj:
    return {**spec.scheduling.annotations, ANNOTATION_SPEC_HASH: spec.spec_hash()}


def spec_document(spec: JobSpec) -> Obj:
    """The spec as the pod's runner reads it back: `load_spec` of this gives an equal spec."""
    return spec.to_yaml_dict()
