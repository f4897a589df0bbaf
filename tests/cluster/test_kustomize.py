"""k8s/: renders offline, passes kubernetes-validate --strict, and its Role grants exactly what
the client uses. Kueue objects are CRDs (no offline schema): they are checked structurally."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobspec.cluster.client import ClusterClient
from jobspec.cluster.logs import follow_log, print_log
from jobspec.cluster.preflight import preflight
from jobspec.cluster.submit import submit
from jobspec.contract import KUEUE_QUEUE_LABEL
from jobspec.render import render
from jobspec.spec.loader import load_spec

from .fake_api import FakeApi, rbac_of
from .objects import gpu_node, make_objects, prerequisite

REPO = Path(__file__).resolve().parents[2]
KUEUE_KINDS = {"ResourceFlavor", "ClusterQueue", "LocalQueue"}
QUANTITY = re.compile(r"^\d+(\.\d+)?(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P)?$")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def kustomize(path: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(REPO / path)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return kustomize("k8s")


@pytest.fixture(scope="module")
def with_kueue() -> list[dict[str, Any]]:
    return kustomize("k8s/overlays/kueue")


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def test_base_contents(base: list[dict[str, Any]]) -> None:
    assert sorted((o["kind"], o["metadata"]["name"]) for o in base) == [
        ("ClusterRole", "jobspec-submitter-checks"),
        ("ClusterRoleBinding", "jobspec-submitter-checks"),
        ("Namespace", "jobspec"),
        ("PriorityClass", "training"),
        ("PriorityClass", "training-low"),
        ("Role", "jobspec-submitter"),
        ("RoleBinding", "jobspec-submitter"),
        ("ServiceAccount", "jobspec-runner"),
        ("ServiceAccount", "jobspec-submitter"),
    ]
    (ns,) = by_kind(base, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    cluster_scoped = ("Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding")
    assert all(o["metadata"].get("namespace") == "jobspec" for o in base if o["kind"] not in cluster_scoped)
    assert not [o for o in base if o["kind"] in cluster_scoped and "namespace" in o["metadata"]]


def test_k8s_ships_every_priority_class_an_example_names(base: list[dict[str, Any]]) -> None:
    from jobspec.render import render
    from jobspec.spec.loader import load_spec

    shipped = {o["metadata"]["name"] for o in by_kind(base, "PriorityClass")}
    named = set()
    for path in sorted((REPO / "examples").glob("*.yaml")):
        job = next(o for o in render(load_spec(path)) if o["kind"] == "Job")
        named |= {job["spec"]["template"]["spec"].get("priorityClassName")} - {None}
    assert "training" in named and named <= shipped


@pytest.mark.parametrize("version", ["1.29.0", "latest"])
def test_builtin_objects_pass_strict_validation(
    base: list[dict[str, Any]], with_kueue: list[dict[str, Any]], version: str
) -> None:
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    version = latest_version() if version == "latest" else version
    builtin = [o for o in base + with_kueue if o["kind"] not in KUEUE_KINDS]
    assert len(builtin) == 18
    for obj in builtin:
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError


def test_runner_service_account_has_no_token_and_no_role(base: list[dict[str, Any]]) -> None:
    runner = next(o for o in by_kind(base, "ServiceAccount") if o["metadata"]["name"] == "jobspec-runner")
    assert runner["automountServiceAccountToken"] is False
    bound = [s["name"] for rb in by_kind(base, "RoleBinding") for s in rb["subjects"]]
    assert bound == ["jobspec-submitter"]


def granted(base: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    """(scope, apiGroup, resource, verb): scope "namespace" from the Role, "cluster" from the ClusterRole, each
    bound to the submitter only."""
    (role,) = by_kind(base, "Role")
    (cluster_role,) = by_kind(base, "ClusterRole")
    (binding,) = by_kind(base, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "jobspec-submitter", "namespace": "jobspec"}]
    return {
        (scope, g, r, v)
        for scope, obj in (("namespace", role), ("cluster", cluster_role))
        for rule in obj["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def kubectl_apply(api: FakeApi, kubeconfig: Path, spec: Path) -> subprocess.CompletedProcess[str]:
    """The README's `jobspec render SPEC | kubectl apply -f -`, with the real kubectl, against the fake API server.
    --validate=false: the fake serves no OpenAPI document (a non-resource read any user may make: no Role
    involved); kubectl sends no token over plain HTTP, so the server takes it as the submitter."""
    api.anonymous = True
    rendered = subprocess.run([sys.executable, "-m", "jobspec", "render", str(spec)], capture_output=True, text=True,
                              cwd=REPO, check=True, timeout=120).stdout  # fmt: skip
    return subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "--cache-dir", str(kubeconfig.parent / "cache"),
                           "apply", "--validate=false", "-f", "-"], input=rendered, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_readme_pipeline_applies_as_the_submitter_role(
    base: list[dict[str, Any]], api: FakeApi, kubeconfig: Path
) -> None:
    """Seen on a real control plane (issue 43): `jobspec render X | kubectl apply -f -` as the shipped Role got 403s
    (client-side apply gets each object before it creates it) and left the Job without its ConfigMap, Service and
    NetworkPolicy. Now every object is created, and applying again changes nothing."""
    api.granted = granted(base)
    done = kubectl_apply(api, kubeconfig, REPO / "examples" / "sft_fast.yaml")
    assert done.returncode == 0, done.stderr
    made = sorted((plural, name) for plural, ns, name in api.objects if ns == "jobspec")
    assert made == [("configmaps", "sft-fast-spec"), ("jobs", "sft-fast"), ("networkpolicies", "sft-fast"),
                    ("services", "sft-fast")]  # fmt: skip
    again = kubectl_apply(api, kubeconfig, REPO / "examples" / "sft_fast.yaml")
    assert again.returncode == 0 and again.stdout.count(" unchanged") == 4, again.stdout + again.stderr
    refused = [r for r in api.requests if r.path.startswith(("/api/", "/apis/")) and rbac_of(r) - granted(base)]
    assert not refused


def test_role_grants_exactly_what_the_client_uses(
    base: list[dict[str, Any]], api: FakeApi, client: ClusterClient, kubeconfig: Path
) -> None:
    from jobspec.cluster.cancel import cancel
    from jobspec.cluster.listing import list_jobs
    from jobspec.cluster.status import collect_status

    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "jobspec-hf-cache-rwo"},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
    submit(client, [claim, *make_objects()], "ml")  # the hub cache: looked up, created
    submit(client, make_objects(), "ml")
    submit(client, [claim, *make_objects(spec_hash="hash-2")], "ml", replace=True)  # looked up, kept
    pod = api.add_pod("ml", "train", 0)["metadata"]["name"]
    api.logs[("ml", pod)] = b"x\n"
    collect_status(client, "ml", "train")  # the Job, its pods, its events
    queued = make_objects("queued", queue="gpu-queue")
    queued[2]["spec"]["suspend"] = True  # as the renderer makes it: Kueue admits it by unsuspending
    submit(client, queued, "ml")
    collect_status(client, "ml", "queued")  # and its Kueue Workload
    cancel(client, "ml", "queued")
    print_log(client, "ml", "train", 0, io.StringIO())
    api.streams[("ml", pod)] = [[lambda: api.set_pod("ml", pod, "Succeeded", {"terminated": {"exitCode": 0}})]]
    follow_log(client, "ml", "train", 0, io.StringIO())
    list_jobs(client, "ml")
    cancel(client, "ml", "train", wait=True)
    # the pre-submit checks of examples/multinode.yaml, with all it names there (each read goes one step deeper)
    multinode = render(load_spec(REPO / "examples" / "multinode.yaml", ['namespace="ml"']))
    for obj in (prerequisite("PriorityClass", "training"), prerequisite("ClusterQueue", "jobspec"),
                prerequisite("LocalQueue", "gpu-queue", "ml", spec={"clusterQueue": "jobspec"}),
                prerequisite("PersistentVolumeClaim", "chat-data", "ml"), gpu_node("gpu-0"),
                prerequisite("Secret", "hf-token", "ml", data={"token": "dG9r"})):  # fmt: skip
        api.put(obj)
    multinode_pod = next(o for o in multinode if o["kind"] == "Job")["spec"]["template"]["spec"]
    multinode_pod["serviceAccountName"] = "jobspec-runner"
    checked = preflight(client, multinode, "ml")
    assert not checked.warnings and len(checked.missing) == 3  # llama-checkpoints, jobspec-runner, the H100s
    # and the README's other way in: `jobspec render X | kubectl apply -f -` (above: what it needs)
    assert kubectl_apply(api, kubeconfig, REPO / "examples" / "sft_fast.yaml").returncode == 0
    used = set().union(*(rbac_of(r) for r in api.requests))
    assert used == granted(base)
    assert ("namespace", "", "pods", "delete") not in used  # what a stuck cancel's message leaves to an admin


def test_kueue_component_is_consistent(with_kueue: list[dict[str, Any]]) -> None:
    """Structural checks only: Kueue's CRD schemas are not available offline."""
    kueue = [o for o in with_kueue if o["kind"] in KUEUE_KINDS]
    assert sorted(o["kind"] for o in kueue) == ["ClusterQueue", "LocalQueue", "ResourceFlavor"]
    assert {o["apiVersion"] for o in kueue} == {"kueue.x-k8s.io/v1beta2"}  # v1beta1: deprecated, gone in v0.20
    (flavor,), (cq,), (lq,) = (by_kind(with_kueue, k) for k in ("ResourceFlavor", "ClusterQueue", "LocalQueue"))
    assert "namespace" not in flavor["metadata"] and "namespace" not in cq["metadata"]  # cluster-scoped
    assert lq["metadata"]["namespace"] == "jobspec" and lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert set(cq["spec"]) <= {"namespaceSelector", "queueingStrategy", "resourceGroups", "cohortName", "preemption"}
    assert cq["spec"]["queueingStrategy"] in ("BestEffortFIFO", "StrictFIFO")
    for group in cq["spec"]["resourceGroups"]:
        covered = group["coveredResources"]
        assert {"cpu", "memory", "nvidia.com/gpu", "amd.com/gpu"} <= set(covered)
        for fl in group["flavors"]:
            assert fl["name"] == flavor["metadata"]["name"]
            assert [r["name"] for r in fl["resources"]] == covered  # Kueue requires the same order
            assert all(QUANTITY.match(str(r["nominalQuota"])) for r in fl["resources"])


def test_local_queue_matches_the_queue_label_the_renderer_sets(with_kueue: list[dict[str, Any]]) -> None:
    from jobspec.render import render
    from jobspec.spec.loader import load_spec

    (lq,) = by_kind(with_kueue, "LocalQueue")
    queued = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        job = next(o for o in render(load_spec(path)) if o["kind"] == "Job")
        if KUEUE_QUEUE_LABEL in job["metadata"].get("labels", {}):
            queued.append(job["metadata"]["labels"][KUEUE_QUEUE_LABEL])
    assert queued and set(queued) == {lq["metadata"]["name"]}


def test_every_k8s_file_is_used_and_parses() -> None:
    files = {p.relative_to(REPO / "k8s").as_posix() for p in (REPO / "k8s").rglob("*.yaml")}
    listed = set()
    for kfile in (REPO / "k8s").rglob("kustomization.yaml"):
        doc = yaml.safe_load(kfile.read_text())
        listed.add(kfile.relative_to(REPO / "k8s").as_posix())
        for res in doc.get("resources", []):
            target = (kfile.parent / res).resolve()
            if target.suffix == ".yaml":
                listed.add(target.relative_to(REPO / "k8s").as_posix())
    assert files == listed
