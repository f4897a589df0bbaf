"""Pre-submit checks against the fake API server: what examples/multinode.yaml names must be there, each missing
one named with its fix (exit 2, nothing applied); a check RBAC refuses is a warning; a Secret's value is never
printed; Pod Security levels of rendered and altered pods."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from jobspec.cluster import podsecurity
from jobspec.cluster.client import ClusterClient
from jobspec.cluster.preflight import preflight
from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.render import render
from jobspec.spec.loader import load_spec

from .conftest import CliRun
from .fake_api import FakeApi
from .objects import gpu_node, prerequisite

REPO = Path(__file__).resolve().parents[2]
MULTI = str(REPO / "examples" / "multinode.yaml")  # namespace jobspec; 2 pods x 8 H100, queue, PVCs, hf-token
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
SECRET_VALUE = "hf_VALUE-never-printed-1234567890"


def provide_all(api: FakeApi, *, nodes: int = 2) -> None:
    """Everything examples/multinode.yaml names, as `kubectl apply -k k8s/overlays/kueue/` and the user would."""
    ns = "jobspec"
    api.put(prerequisite("Namespace", ns, metadata={"labels": {podsecurity.ENFORCE_LABEL: "restricted"}}))
    api.put(prerequisite("PriorityClass", "training", value=100000))
    api.put(prerequisite("LocalQueue", "gpu-queue", ns, spec={"clusterQueue": "jobspec"}))
    api.put(prerequisite("ClusterQueue", "jobspec", spec={}))
    for claim in ("chat-data", "llama-checkpoints"):
        api.put(prerequisite("PersistentVolumeClaim", claim, ns))
    api.put(prerequisite("Secret", "hf-token", ns, data={"token": SECRET_VALUE}))
    for i in range(nodes):
        api.put(gpu_node(f"gpu-{i}", **H100))
    api.put(gpu_node("cpu-0", count=0))


def kc(kubeconfig: Path) -> list[str]:
    return ["--kubeconfig", str(kubeconfig)]


def test_every_missing_prerequisite_is_named_with_its_fix_and_nothing_is_applied(
    api: FakeApi, kubeconfig: Path, cli: CliRun
) -> None:
    api.put(gpu_node("cpu-0", count=0))  # a node without the GPU resource
    code, out, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_CONFIG, err
    assert 'PriorityClass "training" (scheduling.priority_class) does not exist' in err
    assert "k8s/base/priority-classes.yaml" in err
    assert 'LocalQueue "gpu-queue" (scheduling.queue) does not exist in namespace "jobspec"' in err
    assert 'PersistentVolumeClaim "chat-data" (data.pvc)' in err
    assert 'PersistentVolumeClaim "llama-checkpoints" (checkpoints.pvc)' in err
    assert 'Secret "hf-token" (env HF_TOKEN) does not exist' in err
    assert "kubectl create secret generic hf-token -n jobspec --from-literal=token=..." in err
    assert "no schedulable node matching nodeSelector" in err and "nvidia.com/gpu" in err
    assert not api.calls("PATCH") and not api.calls("DELETE")  # nothing applied
    assert out == ""


def test_all_there_submits_and_the_dry_run_checks_too(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    provide_all(api)
    code, out, err = cli("submit", MULTI, "--dry-run=server", *kc(kubeconfig))
    assert code == EXIT_OK, err
    assert "nothing was persisted" in out and api.get("jobs", "jobspec", "sft-multinode") is None
    code, out, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_OK, err
    # nothing but the note that no runner image was pushed from here (jobspec/render/images.py)
    assert [line for line in err.splitlines() if "no cuda image was pushed" not in line] == [], err
    assert api.get("jobs", "jobspec", "sft-multinode") is not None
    checked = {r.path.rsplit("/", 2)[-2] for r in api.calls("GET") if "/namespaces/jobspec/jobs/" not in r.path}
    assert {"priorityclasses", "localqueues", "clusterqueues", "persistentvolumeclaims", "secrets"} <= checked


def test_a_missing_secret_key_names_the_keys_never_a_value(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    provide_all(api)
    api.put(prerequisite("Secret", "hf-token", "jobspec", data={"hf_token": SECRET_VALUE}))
    code, out, err = cli("submit", MULTI, "--debug", *kc(kubeconfig))
    assert code == EXIT_CONFIG
    assert 'Secret "hf-token" has no key "token" (env HF_TOKEN); its keys: hf_token' in err
    assert SECRET_VALUE not in err + out


def test_a_refused_read_is_a_warning_not_a_failure(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    provide_all(api)
    api.fail("GET", r"/priorityclasses/", 403, message='cannot get resource "priorityclasses"')
    api.fail("GET", r"/api/v1/nodes", 403, message='cannot list resource "nodes"')
    code, _, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_OK, err
    assert 'warning: PriorityClass "training" not checked: the submitter may not read it' in err
    assert "kubectl auth can-i get priorityclasses.scheduling.k8s.io" in err
    assert "warning: GPU resources on the nodes not checked" in err


def test_kueue_missing_and_a_queue_pointing_nowhere(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    provide_all(api)
    api.kueue = False
    code, _, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_CONFIG and "the cluster serves no Kueue kueue.x-k8s.io/v1beta2 API" in err
    api.kueue = True
    del api.objects[("clusterqueues", "", "jobspec")]
    code, _, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_CONFIG
    assert 'LocalQueue "gpu-queue" points to ClusterQueue "jobspec", which does not exist' in err


@pytest.mark.parametrize(
    ("nodes", "said"),
    [
        ([gpu_node("a", count=4, **H100), gpu_node("b", count=4, **H100)], "most allocatable on one node: 4"),
        ([gpu_node("a", **H100)], "do not fit the schedulable nodes matching nodeSelector"),  # 1 of 2 pods
        ([gpu_node("a"), gpu_node("b")], "no schedulable node matching nodeSelector"),  # wrong product label
        ([gpu_node("a", resource="amd.com/gpu", **H100)], "no schedulable node"),
    ],
)
def test_gpus_that_cannot_hold_the_pods(
    api: FakeApi, kubeconfig: Path, cli: CliRun, nodes: list[dict[str, Any]], said: str
) -> None:
    provide_all(api, nodes=0)
    for node in nodes:
        api.put(node)
    code, _, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_CONFIG and said in err, err
    assert "?." not in err  # a question, then the fix's period (issue 43)
    assert cli("submit", MULTI, "--skip-check", "gpu", *kc(kubeconfig))[0] == EXIT_OK


def test_cordoned_nodes_do_not_count_and_are_named(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    """Seen on a real control plane (issue 43): GPU nodes that were only cordoned were reported as nodes without
    GPUs, the device plugin blamed. They are named as cordoned, and the device plugin is left out of it."""
    provide_all(api)
    for i in range(2):
        api.objects[("nodes", "", f"gpu-{i}")]["spec"] = {"unschedulable": True}
    code, _, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_CONFIG and "offers 8 nvidia.com/gpu is cordoned (spec.unschedulable: gpu-0, gpu-1)" in err
    assert "device plugin" not in err and "kubectl uncordon" in err, err
    api.objects[("nodes", "", "gpu-0")]["spec"] = {}  # one back: 1 of the 2 pods fits, the count says so
    code, _, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_CONFIG and "do not fit the schedulable nodes" in err and "1 would" in err, err


def test_a_claim_being_deleted_is_refused(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    """Issue 43: a claim with a deletionTimestamp (kept by pvc-protection while a pod mounts it) passed the check;
    the new pods would wait in Pending for good once it is gone."""
    provide_all(api)
    api.objects[("persistentvolumeclaims", "jobspec", "chat-data")]["metadata"]["deletionTimestamp"] = (
        "2025-01-01T00:05:00Z"
    )
    code, _, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_CONFIG and not api.calls("PATCH"), err  # nothing applied
    assert 'PersistentVolumeClaim "chat-data" (data.pvc) is being deleted (since 2025-01-01T00:05:00Z' in err, err
    assert "llama-checkpoints" not in err  # the other claim is fine


def test_an_absent_namespace(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    api.absent_namespaces.add("jobspec")
    code, _, err = cli("submit", MULTI, *kc(kubeconfig))
    assert code == EXIT_CONFIG and 'namespace "jobspec" does not exist: `kubectl create namespace jobspec`' in err


def rendered(path: str = MULTI) -> list[dict[str, Any]]:
    return render(load_spec(path))


def pod_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == "Job")["spec"]["template"]["spec"]


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.yaml")))
def test_every_example_meets_restricted(example: str) -> None:
    assert podsecurity.pod_level(pod_of(rendered(str(REPO / "examples" / example)))) == ("restricted", [])


@pytest.mark.parametrize(
    ("change", "level", "why"),
    [
        (lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"), "baseline",
         "allowPrivilegeEscalation"),
        (lambda p: p["securityContext"].pop("seccompProfile"), "baseline", "seccompProfile"),
        (lambda p: p["volumes"].append({"name": "nfs", "nfs": {"server": "x", "path": "/"}}), "baseline", "type nfs"),
        (lambda p: p["containers"][0]["securityContext"].update(privileged=True), "privileged", "privileged"),
        (lambda p: p.update(hostNetwork=True), "privileged", "hostNetwork"),
        (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "privileged", "hostPath"),
        (lambda p: p["containers"][0]["securityContext"].update(capabilities={"add": ["IPC_LOCK"]}), "privileged",
         "IPC_LOCK"),
    ],
)
def test_pod_security_levels(change: Any, level: str, why: str) -> None:
    pod = copy.deepcopy(pod_of(rendered()))
    change(pod)
    got, reasons = podsecurity.pod_level(pod)
    assert got == level and any(why in r for r in reasons), reasons


def test_a_namespace_stricter_than_the_pods_is_refused(api: FakeApi, client: ClusterClient) -> None:
    provide_all(api)
    objects = rendered()
    pod_of(objects)["hostIPC"] = True
    for enforced, missing in (("restricted", True), ("baseline", True), ("privileged", False)):
        api.put(prerequisite("Namespace", "jobspec", metadata={"labels": {podsecurity.ENFORCE_LABEL: enforced}}))
        result = preflight(client, objects, "jobspec")
        said = [m for m in result.missing if "Pod Security" in m]
        assert bool(said) is missing, result
    assert f'enforces Pod Security "baseline" ({podsecurity.ENFORCE_LABEL})' in said_text(api, client, objects)
    assert not preflight(client, objects, "jobspec", skip=["podsecurity"]).missing


def said_text(api: FakeApi, client: ClusterClient, objects: list[dict[str, Any]]) -> str:
    api.put(prerequisite("Namespace", "jobspec", metadata={"labels": {podsecurity.ENFORCE_LABEL: "baseline"}}))
    return "\n".join(preflight(client, objects, "jobspec").missing)


def test_a_key_of_an_env_from_secret_that_the_spec_also_sets_is_named(
    api: FakeApi, kubeconfig: Path, cli: CliRun, tmp_path: Path
) -> None:
    """model.hub_token renders HF_TOKEN from its Secret; an env_from_secrets Secret that also holds HF_TOKEN would be
    dropped by Kubernetes without a word (explicit `env` wins over `envFrom`): exit 2 naming both, no value shown."""
    import yaml

    provide_all(api)
    spec = yaml.safe_load(Path(MULTI).read_text())
    spec["env_from_secrets"] = [*spec.get("env_from_secrets", []), "team-env"]
    path = tmp_path / "multinode.yaml"
    path.write_text(yaml.safe_dump(spec))
    api.put(prerequisite("Secret", "team-env", "jobspec", data={"HF_TOKEN": SECRET_VALUE, "WANDB_PROJECT": "x"}))
    code, out, err = cli("submit", str(path), *kc(kubeconfig))
    assert code == EXIT_CONFIG, err
    assert ('Secret "team-env" (env_from_secrets) has a key "HF_TOKEN" that the spec sets as well '
            "(model.hub_token or env.HF_TOKEN)") in err  # fmt: skip
    assert "WANDB_PROJECT" not in err.split("team-env", 1)[1].split("\n", 1)[0] and SECRET_VALUE not in err + out
    assert not api.calls("PATCH")
    api.put(prerequisite("Secret", "team-env", "jobspec", data={"WANDB_PROJECT": "x"}))
    code, _, err = cli("submit", str(path), *kc(kubeconfig))
    assert code == EXIT_OK, err
