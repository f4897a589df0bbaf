"""The renderer: every example becomes schema-valid Kubernetes objects that keep the design's contracts."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes_validate.utils import all_versions, latest_version, major_minor
from packaging.version import Version

from jobspec import __version__
from jobspec.contract import (
    ANNOTATION_SPEC_HASH,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OOM_LAST_TIER,
    EXIT_OOM_RETRY_TIER,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
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
from jobspec.render import (
    CONTAINER_NAME,
    DEFAULT_IMAGES,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_NNODES,
    ENV_NODE_RANK,
    ENV_NPROC_PER_NODE,
    ENV_SPEC_HASH,
    ROCM_SUPPLEMENTAL_GROUPS,
    WORKDIR,
    render,
    shipped_hash,
    to_json,
    to_yaml,
)
from jobspec.render.pod import NODE_MONITOR_GRACE_PERIOD_S, NODE_MONITOR_PERIOD_S
from jobspec.spec.benchmarks import ship_task_files, shipped_entries, shipped_fields
from jobspec.spec.loader import load_spec, parse_spec
from jobspec.spec.models import JobSpec
from jobspec.spec.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))  # examples/families/ and examples/objectives/ too
SFT = ROOT / "examples" / "sft_fast.yaml"
ROCM = ROOT / "examples" / "rocm.yaml"
MULTINODE = ROOT / "examples" / "multinode.yaml"
QUICKSTART = ROOT / "examples" / "quickstart.yaml"

# The oldest minor with every Job field we use on by default (backoffLimitPerIndex and
# podReplacementPolicy went beta in 1.29), and the newest schema the installed package ships.
OLDEST_K8S = "1.30.0"
K8S_VERSIONS = sorted({OLDEST_K8S, latest_version()}, key=Version)

# Every optional field of the spec that changes the manifest, on top of sft_fast.yaml.
KITCHEN_SINK = (
    "scheduling.queue=team-a",
    "scheduling.priority_class=high",
    "scheduling.service_account=trainer",
    "scheduling.active_deadline_seconds=86400",
    "scheduling.tolerations=[{key: gpu, operator: Equal, value: 'yes', effect: NoExecute, toleration_seconds: 60}]",
    "scheduling.node_selector={pool: gpu}",
    "scheduling.labels={team: nlp}",
    "scheduling.annotations={owner: nlp@example.com}",
    "image.pull_secrets=[regcred]",
    "image.pull_policy=Always",
    "env.WANDB_API_KEY={secret: wandb, key: api-key, optional: true}",
    "env_from_secrets=[s3-creds]",
    "hardware.nodes=2",
)

# Common credential shapes; the self-check below proves each one can match.
TOKEN_PATTERNS = {
    r"hf_[A-Za-z0-9]{20,}": "hf_" + "a1B2" * 8,
    r"gh[pousr]_[A-Za-z0-9]{20,}": "ghp_" + "a1B2" * 8,
    r"sk-[A-Za-z0-9_-]{20,}": "sk-" + "a1B2" * 8,
    r"AKIA[0-9A-Z]{16}": "AKIA" + "ABCD1234" * 2,
    r"xox[abpr]-[A-Za-z0-9-]{10,}": "xoxb-" + "1234-abcd" * 2,
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----": "-----BEGIN RSA PRIVATE KEY-----",
    r"eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0",
}

# Pod Security "restricted" volume types.
RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


def rendered(path: Path = SFT, *overrides: str) -> dict[str, dict[str, Any]]:
    return by_kind(render(load_spec(path, overrides)))


def pod_of(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return objs["Job"]["spec"]["template"]["spec"]


def container_of(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = pod_of(objs)["containers"]
    return container


def env_of(objs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container_of(objs)["env"]}


def mounts_of(objs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod_of(objs)["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container_of(objs)["volumeMounts"]}


def shipped(example: Path) -> dict[str, str]:
    """The files an example ships beside its spec (a reward file), as `jobspec render FILE` reads them."""
    spec = load_spec(example)
    return ship_task_files(shipped_entries(spec), example.parent, fields=shipped_fields(spec))


def render_example(example: Path) -> list[dict[str, Any]]:
    """An example rendered as `jobspec render FILE` renders it: with the files it ships."""
    return render(load_spec(example), shipped(example))


# --- schemas ------------------------------------------------------------------------------------


def test_versions_cover_oldest_supported_and_newest_shipped() -> None:
    assert OLDEST_K8S in all_versions() and len(K8S_VERSIONS) >= 2
    assert K8S_VERSIONS[-1] == max(all_versions(), key=Version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_example_renders_to_strictly_valid_objects(example: Path, version: str) -> None:
    for obj in render_example(example):
        # Returns the schema version it used: it must be the one asked for, not an older fallback.
        assert kubernetes_validate.validate(obj, version, strict=True) == major_minor(version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_optional_field_renders_valid(version: str) -> None:
    for overrides in (KITCHEN_SINK, ("hardware.vendor=rocm", "hardware.gpus=MI300X:8", "hardware.memory=null")):
        for obj in render(load_spec(SFT, overrides)):
            assert kubernetes_validate.validate(obj, version, strict=True) == major_minor(version)


def test_strict_validation_catches_a_misspelt_field() -> None:
    job = rendered()["Job"]
    job["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, latest_version(), strict=True)


# --- objects, names, labels ----------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_objects_come_in_apply_order_with_labels_and_hash(example: Path) -> None:
    spec = load_spec(example)
    objs = render_example(example)
    # a hub model's shared cache claim comes first (examples/hub_lora.yaml): the pods mount it
    claims = [("PersistentVolumeClaim", o["metadata"]["name"]) for o in objs if o["kind"] == "PersistentVolumeClaim"]
    hub = bool(spec.model.path) and "/" in spec.model.path and not spec.model.path.startswith("/")
    assert len(claims) == (1 if hub else 0)
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        *claims,
        ("ConfigMap", f"{spec.name}-spec"),
        ("Service", spec.name),
        ("NetworkPolicy", spec.name),  # before the Job: no pod is ever open to other jobs
        ("Job", spec.name),
    ]
    template = objs[-1]["spec"]["template"]["metadata"]
    own = [o["metadata"] for o in objs if o["kind"] != "PersistentVolumeClaim"]  # the hub cache claim is shared
    for meta in [*own, template]:
        assert meta.get("namespace", spec.namespace) == spec.namespace
        labels = meta["labels"]
        assert labels[LABEL_MANAGED_BY] == MANAGED_BY and labels[LABEL_NAME] == "jobspec"
        assert labels[LABEL_JOB] == spec.name
        files = shipped(example)
        assert meta["annotations"][ANNOTATION_SPEC_HASH] == (shipped_hash(spec, files) if files else spec.spec_hash())


def test_user_labels_and_annotations_everywhere_but_ours_win() -> None:
    objs = rendered(SFT, f"scheduling.labels={{team: nlp, {LABEL_JOB}: other}}", "scheduling.annotations={a: b}")
    for meta in [o["metadata"] for o in objs.values()] + [objs["Job"]["spec"]["template"]["metadata"]]:
        assert meta["labels"]["team"] == "nlp" and meta["labels"][LABEL_JOB] == "sft-fast"
        assert meta["annotations"]["a"] == "b"


# --- Pod Security "restricted" --------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_pod_meets_pod_security_restricted(example: Path) -> None:
    pod = pod_of(by_kind(render_example(example)))
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == RUN_AS_UID != 0 and context["runAsGroup"] == RUN_AS_GID
    assert context["fsGroup"] == RUN_AS_GID
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    for key in ("hostNetwork", "hostPID", "hostIPC", "hostUsers"):
        assert key not in pod
    assert "sysctls" not in context and "seLinuxOptions" not in context
    for volume in pod["volumes"]:
        kinds = set(volume) - {"name"}
        assert kinds <= RESTRICTED_VOLUME_TYPES, volume
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"] + pod.get("initContainers", []):
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc.get("privileged", False) is False and sc["runAsNonRoot"] is True
        assert sc.get("seccompProfile", {"type": "RuntimeDefault"})["type"] == "RuntimeDefault"
        assert sc["readOnlyRootFilesystem"] is True
        assert all("hostPort" not in port for port in container.get("ports", []))


# --- secrets --------------------------------------------------------------------------------------


def test_secret_env_is_rendered_by_reference_only() -> None:
    objs = rendered(
        SFT, "env.HF_TOKEN={secret: hf, key: token}", "env.WANDB_API_KEY={secret: wb, key: k, optional: true}"
    )
    env = env_of(objs)
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "wb", "key": "k", "optional": True}
    assert "value" not in env["HF_TOKEN"] and "value" not in env["WANDB_API_KEY"]
    assert env["HF_HOME"] == {"name": "HF_HOME", "value": "/checkpoints/hf-cache"}  # plain values stay plain
    # The spec copy in the ConfigMap holds the same reference, nothing more.
    stored = yaml.safe_load(objs["ConfigMap"]["data"][SPEC_FILE_NAME])
    assert stored["env"]["HF_TOKEN"] == {"secret": "hf", "key": "token"}  # defaults left out


def test_env_from_secrets_becomes_secret_refs() -> None:
    container = container_of(rendered(SFT, "env_from_secrets=[s3-creds, wandb]"))
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}, {"secretRef": {"name": "wandb"}}]
    assert "envFrom" not in container_of(rendered(SFT))


@pytest.mark.parametrize("pattern,sample", TOKEN_PATTERNS.items())
def test_token_patterns_can_match(pattern: str, sample: str) -> None:
    assert re.search(pattern, f"x: {sample}\n")


@pytest.mark.parametrize("example", [*EXAMPLES, "kitchen-sink"], ids=lambda p: getattr(p, "stem", p))
def test_no_credential_shaped_string_in_any_manifest(example: Path | str) -> None:
    objs = render(load_spec(SFT, KITCHEN_SINK)) if example == "kitchen-sink" else render_example(Path(example))
    for text in (to_yaml(objs), to_json(objs)):
        for pattern in TOKEN_PATTERNS:
            assert not re.search(pattern, text), pattern


_env_name = st.from_regex(r"[A-Z][A-Z0-9_]{0,11}", fullmatch=True).filter(lambda n: not n.startswith("JOBSPEC_"))
_dns = st.from_regex(r"[a-z][a-z0-9]{0,10}", fullmatch=True)
_ref = st.fixed_dictionaries({"secret": _dns, "key": _dns, "optional": st.booleans()})


@settings(max_examples=40, deadline=None)
@given(refs=st.dictionaries(_env_name, _ref, max_size=5))
def test_any_secret_refs_render_as_references(refs: dict[str, dict[str, Any]]) -> None:
    data = load_spec(SFT).to_yaml_dict()
    data["env"] = refs
    objs = by_kind(render(JobSpec.model_validate(data)))
    env = env_of(objs)
    for name, ref in refs.items():
        expected = {"name": ref["secret"], "key": ref["key"], **({"optional": True} if ref["optional"] else {})}
        assert env[name] == {"name": name, "valueFrom": {"secretKeyRef": expected}}


# --- vendors, images, resources --------------------------------------------------------------------


def test_cuda_requests_nvidia_gpus() -> None:
    objs = rendered(SFT)
    resources = container_of(objs)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 2
    assert "amd.com/gpu" not in json.dumps(resources)
    assert "supplementalGroups" not in pod_of(objs)["securityContext"]
    env = env_of(objs)
    assert env["PYTORCH_CUDA_ALLOC_CONF"]["value"] == env["PYTORCH_ALLOC_CONF"]["value"] == "expandable_segments:True"
    assert "PYTORCH_HIP_ALLOC_CONF" not in env


def test_rocm_requests_amd_gpus_and_device_groups() -> None:
    objs = rendered(ROCM)
    resources = container_of(objs)["resources"]
    assert resources["requests"]["amd.com/gpu"] == resources["limits"]["amd.com/gpu"] == 1
    assert "nvidia.com/gpu" not in json.dumps(resources)
    assert pod_of(objs)["securityContext"]["supplementalGroups"] == [44, 109]
    env = env_of(objs)
    assert env["PYTORCH_HIP_ALLOC_CONF"]["value"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and not any(n.startswith("NCCL_") for n in env)


@pytest.mark.parametrize(
    "groups,expected",
    [("null", list(ROCM_SUPPLEMENTAL_GROUPS)), ("[39, 44]", [39, 44]), ("[]", None)],
)
def test_rocm_supplemental_groups_default_and_override(groups: str, expected: list[int] | None) -> None:
    context = pod_of(rendered(ROCM, f"hardware.supplemental_groups={groups}"))["securityContext"]
    assert context.get("supplementalGroups") == expected


def test_cpu_vendor_requests_no_accelerator() -> None:
    objs = rendered(QUICKSTART)
    resources = container_of(objs)["resources"]
    assert not any("gpu" in key for part in resources.values() for key in part)
    assert not any("ALLOC_CONF" in name for name in env_of(objs))
    assert container_of(objs)["image"] == DEFAULT_IMAGES["cpu"]


@pytest.mark.parametrize("path,vendor", [(SFT, "cuda"), (ROCM, "rocm"), (QUICKSTART, "cpu")])
def test_default_image_by_vendor(path: Path, vendor: str) -> None:
    image = container_of(rendered(path))["image"]
    assert image == DEFAULT_IMAGES[vendor] == f"ghcr.io/jobspec/runner:{__version__}-{vendor}"


def test_image_override_pull_policy_and_secrets() -> None:
    objs = rendered(SFT, "image.name=registry.example.com/me/trainer:1", "image.pull_policy=Always",
                    "image.pull_secrets=[regcred]")  # fmt: skip
    container = container_of(objs)
    assert container["image"] == "registry.example.com/me/trainer:1" and container["imagePullPolicy"] == "Always"
    assert pod_of(objs)["imagePullSecrets"] == [{"name": "regcred"}]
    assert "imagePullSecrets" not in pod_of(rendered(SFT))


def test_cpu_request_and_memory_request_equals_limit() -> None:
    resources = container_of(rendered(SFT))["resources"]
    assert resources["requests"]["cpu"] == "8" and "cpu" not in resources["limits"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "32Gi"
    bare = container_of(rendered(SFT, "hardware.cpu=null", "hardware.memory=null"))["resources"]
    # Defaults per GPU (2 CPUs, 8Gi), requests only: the pod is Burstable, not BestEffort.
    assert bare == {"requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 2}}


# --- multi-node, Kueue, failure policy ---------------------------------------------------------------


@pytest.mark.parametrize("path", [MULTINODE, SFT], ids=lambda p: p.stem)
def test_indexed_job_wires_rendezvous_through_the_headless_service(path: Path) -> None:
    spec = load_spec(path)
    objs = by_kind(render(spec))
    job, service = objs["Job"]["spec"], objs["Service"]
    nodes = spec.hardware.nodes
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == nodes
    assert job["template"]["spec"]["subdomain"] == service["metadata"]["name"] == spec.name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"] == [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}]
    assert service["spec"]["selector"].items() <= job["template"]["metadata"]["labels"].items()
    env = env_of(objs)
    assert env[ENV_NODE_RANK]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert env[ENV_NNODES]["value"] == str(nodes)
    assert env[ENV_NPROC_PER_NODE]["value"] == str(spec.hardware.gpus.count)
    assert env[ENV_MASTER_ADDR]["value"] == f"{spec.name}-0.{spec.name}"
    assert env[ENV_MASTER_PORT]["value"] == str(RDZV_PORT)
    assert env[ENV_SPEC_HASH]["value"] == spec.spec_hash()
    assert container_of(objs)["args"] == [SPEC_PATH] and "command" not in container_of(objs)


def test_kueue_queue_labels_and_suspends_the_job() -> None:
    queued = rendered(MULTINODE)["Job"]
    assert queued["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "gpu-queue" and queued["spec"]["suspend"] is True
    plain = rendered(SFT)["Job"]
    assert KUEUE_QUEUE_LABEL not in plain["metadata"]["labels"] and "suspend" not in plain["spec"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_pod_failure_policy_follows_the_exit_code_contract(example: Path) -> None:
    spec = load_spec(example)
    job = by_kind(render_example(example))["Job"]["spec"]
    ignore, fail, count = job["podFailurePolicy"]["rules"]
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert fail["action"] == "FailJob"
    assert fail["onExitCodes"]["values"] == sorted([EXIT_CONFIG, EXIT_STORAGE, EXIT_OOM_LAST_TIER])
    assert count["action"] == "Count" and count["onExitCodes"]["values"] == [EXIT_OOM_RETRY_TIER]
    for rule in (fail, count):
        codes = rule["onExitCodes"]
        assert codes["operator"] == "In" and codes["containerName"] == CONTAINER_NAME
        assert 0 not in codes["values"] and codes["values"] == sorted(set(codes["values"]))  # API rules
    listed = set(fail["onExitCodes"]["values"]) | set(count["onExitCodes"]["values"])
    assert EXIT_FAILED not in listed and EXIT_PREEMPTED not in listed  # default counting: retried
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # required by podFailurePolicy
    assert job["podReplacementPolicy"] == "Failed"
    # Budget per index (all ranks fail together); the Job fails when any index is out of budget.
    assert job["backoffLimitPerIndex"] == spec.scheduling.backoff_limit and job["maxFailedIndexes"] == 0
    assert job["backoffLimit"] == spec.scheduling.backoff_limit * spec.hardware.nodes


def test_scheduling_fields_reach_the_job() -> None:
    objs = rendered(SFT, *KITCHEN_SINK)
    job, pod = objs["Job"]["spec"], pod_of(objs)
    assert pod["tolerations"] == [
        {"key": "gpu", "operator": "Equal", "value": "yes", "effect": "NoExecute", "tolerationSeconds": 60},
        *NODE_LOSS_TOLERATIONS,
    ]
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["priorityClassName"] == "high"
    assert pod["serviceAccountName"] == "trainer" and pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 120
    assert job["activeDeadlineSeconds"] == 86400 and job["ttlSecondsAfterFinished"] == 7 * 24 * 3600
    assert "ttlSecondsAfterFinished" not in rendered(SFT, "scheduling.ttl_seconds_after_finished=null")["Job"]["spec"]
    assert pod_of(rendered(MULTINODE))["terminationGracePeriodSeconds"] == 180
    bare = pod_of(rendered(SFT))
    assert not {"nodeSelector", "priorityClassName", "serviceAccountName"} & set(bare)
    assert bare["tolerations"] == NODE_LOSS_TOLERATIONS


NODE_LOSS_TOLERATIONS = [
    {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
]


def test_pods_leave_a_lost_node_after_node_loss_toleration_seconds() -> None:
    fast = pod_of(rendered(MULTINODE, "scheduling.node_loss_toleration_seconds=5"))["tolerations"]
    assert [(t["key"], t["tolerationSeconds"]) for t in fast if t["key"].startswith("node.kubernetes.io/")] == [
        ("node.kubernetes.io/not-ready", 5),
        ("node.kubernetes.io/unreachable", 5),
    ]
    own = "scheduling.tolerations=[{key: node.kubernetes.io/unreachable, operator: Exists, effect: NoExecute}]"
    mine = pod_of(rendered(MULTINODE, own))["tolerations"]  # the spec's own wins: no second one for that key
    assert [t["key"] for t in mine] == ["node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"]
    assert "tolerationSeconds" not in mine[0]  # tolerated for ever, as the spec says (it replaces the list)
    for bad in ("-1", "301"):
        with pytest.raises(ConfigError, match=r"scheduling\.node_loss_toleration_seconds"):
            load_spec(MULTINODE, [f"scheduling.node_loss_toleration_seconds={bad}"])


def test_the_lost_node_arithmetic_in_the_docs() -> None:
    """docs/how-to/lost-node.md: the table's rows add up, its toleration row is the default the renderer uses, and
    the sum with Kubernetes' default toleration is stated right."""
    section = (Path(__file__).resolve().parents[1] / "docs" / "how-to" / "lost-node.md").read_text()
    rows = re.findall(r"^\| (.+?) \| (\d+) \|$", section, re.M)
    *steps, (_, total) = rows
    seconds = {label.split(":")[0].strip("`"): int(n) for label, n in steps}
    assert sum(seconds.values()) == int(total) == 120
    default = JobSpec.model_fields["scheduling"].default.node_loss_toleration_seconds
    assert seconds["node_loss_toleration_seconds"] == default == NODE_LOSS_TOLERATIONS[0]["tolerationSeconds"]
    assert seconds["node-monitor-grace-period"] == NODE_MONITOR_GRACE_PERIOD_S == 50  # Kubernetes 1.32's default
    assert seconds["node-monitor-period"] == NODE_MONITOR_PERIOD_S
    kube_default = int(total) - default + 300
    terms = " + ".join(str(n) for n in [*list(seconds.values())[:2], 300, *list(seconds.values())[3:]])
    assert f"{terms} = {kube_default} s" in section


# --- volumes and the container -------------------------------------------------------------------------


def test_spec_shm_scratch_and_checkpoint_volumes() -> None:
    spec = load_spec(SFT)
    objs = by_kind(render(spec))
    mounts = mounts_of(objs)
    assert mounts[SPEC_MOUNT_DIR]["configMap"] == {"name": objs["ConfigMap"]["metadata"]["name"]}
    assert {m["mountPath"]: m.get("readOnly") for m in container_of(objs)["volumeMounts"]}[SPEC_MOUNT_DIR] is True
    assert mounts[SHM_MOUNT]["emptyDir"] == {"medium": "Memory", "sizeLimit": format_bytes(spec.hardware.shm_size)}
    assert mounts["/tmp"]["emptyDir"] == {}
    assert mounts["/checkpoints"]["persistentVolumeClaim"] == {"claimName": "sft-checkpoints"}
    paths = [m["mountPath"] for m in container_of(objs)["volumeMounts"]]
    assert len(paths) == len(set(paths))


def test_checkpoint_dir_without_pvc_is_a_writable_emptydir() -> None:
    assert mounts_of(rendered(SFT, "checkpoints.pvc=null"))["/checkpoints"]["emptyDir"] == {}
    objs = rendered(QUICKSTART, "checkpoints.dir=runs/quickstart")  # relative: the container's working directory
    assert container_of(objs)["workingDir"] == WORKDIR
    assert mounts_of(objs)[f"{WORKDIR}/runs/quickstart"]["emptyDir"] == {}


@pytest.mark.parametrize("directory", ["/tmp", SHM_MOUNT, SPEC_MOUNT_DIR, "/etc/jobspec/"])
def test_checkpoint_dir_on_a_pod_mount_is_refused(directory: str) -> None:
    with pytest.raises(ConfigError, match=r"checkpoints\.dir"):
        render(load_spec(SFT, [f"checkpoints.dir={directory}"]))


def test_caches_point_at_scratch_and_user_env_wins() -> None:
    env = env_of(rendered(SFT))
    assert env["HOME"]["value"] == "/tmp" and env["XDG_CACHE_HOME"]["value"].startswith("/tmp/")
    assert env["TRITON_CACHE_DIR"]["value"].startswith("/tmp/")
    names = [e["name"] for e in container_of(rendered(SFT, "env.HOME=/checkpoints/home"))["env"]]
    assert names.count("HOME") == 1
    assert env_of(rendered(SFT, "env.HOME=/checkpoints/home"))["HOME"]["value"] == "/checkpoints/home"


def test_reserved_env_name_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape(f"env.{ENV_NODE_RANK}")):
        render(load_spec(SFT, [f"env.{ENV_NODE_RANK}=3"]))


def test_termination_message_for_the_failure_reason() -> None:
    container = container_of(rendered(SFT))
    assert container["terminationMessagePath"] == TERMINATION_MESSAGE_PATH
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["name"] == CONTAINER_NAME


# --- round trip, purity, output -------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_configmap_spec_reads_back_equal(example: Path) -> None:
    spec = load_spec(example)
    text = by_kind(render_example(example))["ConfigMap"]["data"][SPEC_FILE_NAME]
    assert parse_spec(text, "configmap") == spec


def test_explicit_nulls_survive_the_round_trip() -> None:
    spec = load_spec(SFT, ["scheduling.ttl_seconds_after_finished=null", "training.max_grad_norm=null"])
    back = parse_spec(by_kind(render(spec))["ConfigMap"]["data"][SPEC_FILE_NAME])
    assert back == spec and back.training.max_grad_norm is None and back.scheduling.ttl_seconds_after_finished is None


def test_render_is_pure() -> None:
    spec = load_spec(MULTINODE, KITCHEN_SINK[-3:])
    before = spec.model_dump()
    first = render(spec)
    snapshot = copy.deepcopy(first)
    first[-1]["spec"]["template"]["spec"]["containers"][0]["env"].clear()  # no state shared between calls
    first[0]["metadata"]["labels"].clear()
    assert render(spec) == snapshot and spec.model_dump() == before


def test_import_pulls_in_neither_torch_nor_kubernetes() -> None:
    code = (
        "import sys, jobspec.render\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'kubernetes', 'kubernetes_validate'})\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_to_yaml_is_multi_document_and_to_json_a_list() -> None:
    objs = render(load_spec(MULTINODE))
    text = to_yaml(objs)
    assert text.count("\n---\n") == len(objs) - 1 == 3 and f"{SPEC_FILE_NAME}: |" in text  # spec stays readable
    assert "&id" not in text and "*id" not in text  # no YAML anchors, even for a selector written twice
    assert list(yaml.safe_load_all(text)) == objs
    assert json.loads(to_json(objs)) == {"apiVersion": "v1", "kind": "List", "items": objs}


def test_data_pvc_is_mounted_read_only() -> None:
    pod = pod_of(rendered(SFT))
    volume = next(v for v in pod["volumes"] if v["name"] == "data")
    assert volume["persistentVolumeClaim"] == {"claimName": "sft-data", "readOnly": True}
    mount = next(m for m in container_of(rendered(SFT))["volumeMounts"] if m["name"] == "data")
    assert mount == {"name": "data", "mountPath": "/data", "readOnly": True}


def test_no_namespace_written_renders_objects_without_one(tmp_path: Path) -> None:
    """Issue 43: a spec without `namespace` rendered every object into `default`, so `jobspec render X | kubectl
    apply -f -` ignored the kubeconfig's namespace. Now only a namespace the spec (or --set) writes is rendered."""
    from jobspec.cli import main

    assert "namespace" not in load_spec(QUICKSTART).model_fields_set  # the quick start names none
    bare = render(load_spec(QUICKSTART))
    assert [o["metadata"].get("namespace") for o in bare] == [None] * len(bare)
    for objs in (render(load_spec(SFT)), render(load_spec(QUICKSTART, ['namespace="default"']))):
        wanted = "jobspec" if objs[-1]["metadata"]["name"] == "sft-fast" else "default"  # written: kept, even default
        assert {o["metadata"]["namespace"] for o in objs} == {wanted}
    out = tmp_path / "render.yaml"  # the command a user pipes into kubectl
    with open(out, "w") as handle, contextlib.redirect_stdout(handle):
        assert main(["render", str(QUICKSTART)]) == 0
    assert all("namespace" not in d["metadata"] for d in yaml.safe_load_all(out.read_text()))
