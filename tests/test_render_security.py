"""Cluster defaults a security review asks for: the job's NetworkPolicy, cpu/memory requests on every
pod (QoS Burstable, never BestEffort), images pinned by digest, and the notes `jobspec validate` gives."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import major_minor

from jobspec.cli import _notes
from jobspec.cluster.submit import in_namespace
from jobspec.contract import ANNOTATION_SPEC_HASH, LABEL_JOB, RDZV_PORT
from jobspec.errors import SpecError
from jobspec.render import DEFAULT_CPU_PER_RANK, DEFAULT_MEMORY_PER_RANK, ENV_SPEC_HASH, render, shipped_hash
from jobspec.spec.loader import load_spec, parse_spec
from jobspec.spec.units import format_bytes, parse_size

from .test_render import (
    EXAMPLES,
    K8S_VERSIONS,
    MULTINODE,
    QUICKSTART,
    ROCM,
    SFT,
    by_kind,
    container_of,
    rendered,
    shipped,  # fmt: skip
)

ROOT = Path(__file__).resolve().parents[1]
DIGEST = "sha256:" + "0123456789abcdef" * 4
Obj = dict[str, Any]


# --- a small model of NetworkPolicy semantics (the API reference's rules, for ingress) ----------------------


def _matches(selector: Obj, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what the renderer writes; matchExpressions unmodelled
    return selector.get("matchLabels", {}).items() <= labels.items()


def admits(policies: list[Obj], src: tuple[str, dict[str, str]], dst: tuple[str, dict[str, str]], port: int,
           protocol: str = "TCP") -> bool:  # fmt: skip
    """Would a connection from pod `src` (namespace, labels) to pod `dst` on port/protocol be allowed?

    A pod selected by no Ingress policy accepts everything; a selected pod accepts what at least one
    rule of one selecting policy allows (policies add up). A peer with only a podSelector means pods of
    the policy's own namespace; a rule without ports allows every port; a port entry without a port
    allows every port of its protocol (default TCP).
    """
    (src_ns, src_labels), (dst_ns, dst_labels) = src, dst
    selecting = [
        p for p in policies
        if p["metadata"]["namespace"] == dst_ns and _matches(p["spec"]["podSelector"], dst_labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]  # fmt: skip
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            peer_ok = not peers or any(
                set(peer) == {"podSelector"}
                and src_ns == policy["metadata"]["namespace"]
                and _matches(peer["podSelector"], src_labels)
                for peer in peers
            )
            ports = rule.get("ports")
            port_ok = not ports or any(
                entry.get("protocol", "TCP") == protocol and entry.get("port") in (None, port) for entry in ports
            )
            if peer_ok and port_ok:
                return True
    return False


def policies_of(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] == "NetworkPolicy"]


def test_the_policy_model_can_say_no() -> None:
    closed = {"metadata": {"namespace": "a"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert admits([], ("b", {}), ("a", {}), 1)  # no policy: open
    assert not admits([closed], ("a", {}), ("a", {"x": "y"}), 1)  # selected, no rule: closed
    assert admits([closed], ("a", {}), ("b", {}), 1)  # another namespace's pod is not selected


# --- NetworkPolicy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_network_policy_admits_the_jobs_own_pods_on_any_tcp_port_and_nothing_else(example: Path) -> None:
    spec, files = load_spec(example), shipped(example)
    objs = in_namespace(render(spec, files), spec.namespace)  # as submit places them (a spec without one renders none)
    (policy,) = policies_of(objs)
    kinds = by_kind(objs)
    pod_labels = kinds["Job"]["spec"]["template"]["metadata"]["labels"]
    assert policy["metadata"]["name"] == spec.name and policy["metadata"]["namespace"] == spec.namespace
    assert policy["metadata"]["labels"][LABEL_JOB] == spec.name
    want = shipped_hash(spec, files) if files else spec.spec_hash()  # a job that ships files: theirs too
    assert policy["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == want  # cancel finds it by label
    # The policy selects exactly the pods the headless Service selects: this job's.
    assert policy["spec"]["podSelector"] == {"matchLabels": {LABEL_JOB: spec.name}}
    assert policy["spec"]["podSelector"]["matchLabels"] == kinds["Service"]["spec"]["selector"]
    assert _matches(policy["spec"]["podSelector"], pod_labels)
    # Ingress only: egress (hub, trackers, object stores, DNS) is not restricted.
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]
    # One rule: from this job's pods in this namespace (no namespaceSelector, no ipBlock), every TCP port.
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {LABEL_JOB: spec.name}}}], "ports": [{"protocol": "TCP"}]}
    ]

    ns = spec.namespace
    me = (ns, pod_labels)
    peer = (ns, {**pod_labels, "batch.kubernetes.io/job-completion-index": "1"})
    other_job = (ns, {**pod_labels, LABEL_JOB: "someone-else"})
    same_label_elsewhere = ("other-namespace", pod_labels)
    unlabelled = (ns, {})
    # TCPStore on the rendezvous port, NCCL bootstrap / socket transport and gloo on ephemeral ports.
    for port in (RDZV_PORT, 1024, 43817, 65535):
        assert admits([policy], peer, me, port), port
        for stranger in (other_job, same_label_elsewhere, unlabelled):
            assert not admits([policy], stranger, me, port), (stranger, port)
    assert not admits([policy], peer, me, RDZV_PORT, "UDP")  # nothing between ranks needs UDP
    # Other pods of the namespace are not selected, so the policy changes nothing for them.
    assert admits([policy], unlabelled, other_job, RDZV_PORT)


def test_user_labels_do_not_widen_the_policy() -> None:
    objs = rendered(SFT, f"scheduling.labels={{team: nlp, {LABEL_JOB}: other}}")
    policy = objs["NetworkPolicy"]["spec"]
    assert policy["podSelector"] == {"matchLabels": {LABEL_JOB: "sft-fast"}}
    assert policy["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {LABEL_JOB: "sft-fast"}}}]


def test_network_policy_switch_off_drops_only_the_policy() -> None:
    on, off = render(load_spec(MULTINODE)), render(load_spec(MULTINODE, ["scheduling.network_policy=false"]))
    assert [o["kind"] for o in off] == ["ConfigMap", "Service", "Job"]
    assert [o["kind"] for o in on] == ["ConfigMap", "Service", "NetworkPolicy", "Job"]

    def pod_without_hash(objs: list[Obj]) -> Obj:  # the spec hash differs, as the spec does
        pod = by_kind(objs)["Job"]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = [e for e in container["env"] if e["name"] != ENV_SPEC_HASH]
        return {**pod, "containers": [{**container, "env": env}]}

    assert pod_without_hash(off) == pod_without_hash(on)
    stored = yaml.safe_load(by_kind(off)["ConfigMap"]["data"]["spec.yaml"])
    assert stored["scheduling"]["network_policy"] is False  # the runner's copy says so too
    assert "network_policy" not in yaml.safe_load(by_kind(on)["ConfigMap"]["data"]["spec.yaml"])["scheduling"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_object_validates_strictly_with_the_policy_on_and_off(example: Path, version: str) -> None:
    for overrides in ((), ("scheduling.network_policy=false",), (f"image.name=ghcr.io/me/trainer@{DIGEST}",)):
        objs = render(load_spec(example, overrides), shipped(example))
        assert len(policies_of(objs)) == (0 if overrides == ("scheduling.network_policy=false",) else 1)
        for obj in objs:
            assert kubernetes_validate.validate(obj, version, strict=True) == major_minor(version)


# --- requests: QoS Burstable, never BestEffort ---------------------------------------------------------------


def qos_class(pod: Obj) -> str:
    """The pod's QoS class by Kubernetes' rules: only cpu and memory count (a GPU request does not);
    a missing request defaults to its limit."""
    containers = pod["containers"] + pod.get("initContainers", [])
    guaranteed, any_set = True, False
    for c in containers:
        limits = {k: v for k, v in c.get("resources", {}).get("limits", {}).items() if k in ("cpu", "memory")}
        requests = {k: v for k, v in c.get("resources", {}).get("requests", {}).items() if k in ("cpu", "memory")}
        requests = {**limits, **requests}
        any_set = any_set or bool(limits or requests)
        guaranteed = guaranteed and set(limits) == {"cpu", "memory"} and requests == limits
    return "Guaranteed" if guaranteed else "Burstable" if any_set else "BestEffort"


def test_qos_model_tells_the_three_classes_apart() -> None:
    def pod(resources: Obj) -> Obj:
        return {"containers": [{"name": "c", "resources": resources}]}

    gpu = {"nvidia.com/gpu": 1}
    assert qos_class(pod({"requests": gpu, "limits": gpu})) == "BestEffort"  # what a GPU-only pod was
    assert qos_class(pod({"requests": {"cpu": "1", **gpu}, "limits": gpu})) == "Burstable"
    both = {"cpu": "2", "memory": "1Gi"}
    assert qos_class(pod({"limits": both})) == "Guaranteed"
    assert qos_class(pod({"requests": {"cpu": "1", "memory": "1Gi"}, "limits": both})) == "Burstable"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("unset", [False, True], ids=["as-written", "defaults"])
def test_every_pod_requests_cpu_and_memory_and_is_burstable(example: Path, unset: bool) -> None:
    overrides = ["hardware.cpu=null", "hardware.memory=null"] if unset else []
    spec = load_spec(example, overrides)
    objs = by_kind(render(spec, shipped(example)))
    resources = container_of(objs)["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert qos_class(objs["Job"]["spec"]["template"]["spec"]) == "Burstable"
    assert "cpu" not in resources.get("limits", {})  # never a CPU limit: throttling stalls collectives
    hw, ranks = spec.hardware, spec.hardware.gpus.count
    if hw.cpu is None:
        assert resources["requests"]["cpu"] == str(DEFAULT_CPU_PER_RANK[hw.vendor] * ranks)
    if hw.memory is None:  # a guess is a request only: as a limit it would OOM-kill runs the node could carry
        assert resources["requests"]["memory"] == format_bytes(DEFAULT_MEMORY_PER_RANK[hw.vendor] * ranks)
        assert "memory" not in resources.get("limits", {})
    else:
        assert resources["requests"]["memory"] == resources["limits"]["memory"] == format_bytes(hw.memory)


def test_defaults_per_rank_and_overrides() -> None:
    assert container_of(rendered(SFT, "hardware.cpu=null", "hardware.memory=null"))["resources"]["requests"] == {
        "cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 2,
    }  # fmt: skip
    rocm = container_of(rendered(ROCM, "hardware.cpu=null", "hardware.memory=null", "hardware.gpus=MI300X:8"))
    assert rocm["resources"]["requests"] == {"cpu": "16", "memory": "64Gi", "amd.com/gpu": 8}
    assert container_of(rendered(QUICKSTART))["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    # One field set, the other defaulted.
    mixed = container_of(rendered(SFT, "hardware.cpu=500m", "hardware.memory=null"))["resources"]
    assert mixed["requests"]["cpu"] == "500m" and mixed["requests"]["memory"] == "16Gi"


def test_one_gpu_defaults_fit_the_smallest_gpu_nodes() -> None:
    """4 vCPUs and 16 GiB with one GPU (g4dn/g5/g6.xlarge, g2-standard-4): allocatable is about 3.5 CPUs
    and 14 GiB once the kubelet's reservations and the daemonsets are taken."""
    for vendor in ("cuda", "rocm"):
        assert DEFAULT_CPU_PER_RANK[vendor] <= 3.5 and DEFAULT_MEMORY_PER_RANK[vendor] <= parse_size("14Gi")


# --- images: digests and mutable tags ------------------------------------------------------------------------

GOOD = "name: x\nmodel: {preset: tiny}\ntraining: {global_batch: 8, steps: 2}\nhardware: {vendor: cpu}\n"


@pytest.mark.parametrize(
    "image",
    [
        f"ghcr.io/me/trainer@{DIGEST}",
        f"ghcr.io/me/trainer:1.0@{DIGEST}",  # the tag is informative, the digest decides
        f"localhost:5000/team/trainer@{DIGEST}",
        "quay.io/org/x@sha512:" + "ab" * 64,
        "ubuntu",
        "registry.example.com:443/a/b_c/d-e:v1.2_3",
    ],
)
def test_image_references_are_accepted_and_rendered_as_written(image: str) -> None:
    spec = load_spec(SFT, [f"image.name={image}"])
    assert container_of(by_kind(render(spec)))["image"] == image


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("ghcr.io/me/trainer@sha256:abc123", "64 lowercase hex digits"),  # cut short
        ("ghcr.io/me/trainer@sha256:" + "AB" * 32, "64 lowercase hex digits"),  # upper case
        ("ghcr.io/me/trainer@md5:" + "ab" * 16, "must be sha256:"),  # not an algorithm runtimes verify
        ("ghcr.io/me/trainer@" + "ab" * 32, "must be sha256:"),  # algorithm missing
        ("ghcr.io/me/trainer:1@", "must be sha256:"),  # nothing after '@'
        ("ghcr.io/Me/Trainer:1", "lowercase"),  # kubelet: InvalidImageName
        ("ghcr.io/me/trainer:", "not an image reference"),
        ("ghcr.io/me/trainer:1 ", "not an image reference"),
    ],
)
def test_bad_image_reference_is_a_located_error(image: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(f"{GOOD}image:\n  name: {image!r}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert f"{path}:6: image.name" in text and message in text, text


def test_an_image_with_a_credential_is_reported_as_one() -> None:
    """The reference check steps aside: the credential rule reports it, without echoing it."""
    with pytest.raises(SpecError) as info:
        parse_spec(GOOD, overrides=["image.name=robot:hunter2pass@registry.example.com/team/runner:1"])
    assert "credential" in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("image", "tag"),
    [("ghcr.io/me/trainer", "latest"), ("ghcr.io/me/trainer:latest", "latest"), ("localhost:5000/me/t:1.2", "1.2")],
)
def test_a_mutable_tag_is_a_note(image: str, tag: str) -> None:
    notes = [n for n in _notes(parse_spec(GOOD, overrides=[f"image.name={image}"])) if "image.name" in n]
    assert len(notes) == 1 and f"the tag :{tag}, not a digest" in notes[0] and f"{image}@sha256:" in notes[0]


def test_a_digest_or_the_default_image_gives_no_image_note() -> None:
    for overrides in ([f"image.name=ghcr.io/me/trainer:1@{DIGEST}"], []):
        assert not [n for n in _notes(parse_spec(GOOD, overrides=overrides)) if "image.name" in n]


def test_validate_prints_the_notes_and_still_succeeds() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jobspec", "validate", str(SFT), "--set", "image.name=ghcr.io/me/trainer:latest",
         "--set", "scheduling.network_policy=false"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "note: image.name 'ghcr.io/me/trainer:latest' is the tag :latest" in out.stderr
    assert "note: scheduling.network_policy is false" in out.stderr


def test_offload_tier_without_host_memory_is_a_note() -> None:
    spec = load_spec(SFT, ["memory.tier=minimal", "hardware.memory=null"])
    assert any("memory.tier minimal keeps optimizer state in host memory" in n for n in _notes(spec))
    assert not any("memory.tier" in n for n in _notes(load_spec(SFT, ["memory.tier=minimal"])))


# --- k8s/: the optional namespace-wide default deny ----------------------------------------------------------


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_default_deny_overlay_closes_the_namespace_and_jobs_still_reach_each_other() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "k8s" / "overlays" / "default-deny")],
                         capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    objs = [d for d in yaml.safe_load_all(out) if d]
    base = subprocess.run(["kubectl", "kustomize", str(ROOT / "k8s")],
                          capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    assert len(objs) == len([d for d in yaml.safe_load_all(base) if d]) + 1
    (deny,) = policies_of(objs)
    assert deny["metadata"]["namespace"] == "jobspec"
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)

    job = render(load_spec(MULTINODE))  # namespace jobspec
    labels = by_kind(job)["Job"]["spec"]["template"]["metadata"]["labels"]
    both = [deny, *policies_of(job)]
    assert admits(both, ("jobspec", labels), ("jobspec", labels), 40000)  # the job's own policy opens it
    assert not admits(both, ("jobspec", {"app": "debug"}), ("jobspec", labels), RDZV_PORT)
    assert not admits(both, ("jobspec", labels), ("jobspec", {"app": "debug"}), 80)  # a hand-made pod: closed
