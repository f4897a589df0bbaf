"""submit, cancel and list against the fake API server."""

from __future__ import annotations

import pytest

from jobspec.cluster import errors
from jobspec.cluster.cancel import cancel
from jobspec.cluster.client import ClusterClient
from jobspec.cluster.listing import list_jobs
from jobspec.cluster.submit import in_namespace, submit
from jobspec.contract import ANNOTATION_SPEC_HASH, LABEL_JOB
from jobspec.errors import ConfigError

from .fake_api import FakeApi
from .objects import make_objects


def test_submit_applies_configmap_service_job_in_order(api: FakeApi, client: ClusterClient) -> None:
    objs = make_objects()
    result = submit(client, [objs[2], objs[0], objs[1]], "ml")  # the Job first on purpose
    assert result.outcome == "created"
    assert result.applied == ["configmap/train-spec", "service/train", "job.batch/train"]
    patches = api.calls("PATCH")
    assert [p.path.rsplit("/", 2)[-2] for p in patches] == ["configmaps", "services", "jobs"]
    for p in patches:
        assert p.headers["content-type"] == "application/apply-patch+yaml"
        assert p.query == {"fieldManager": "jobspec"}
    assert api.get("jobs", "ml", "train")["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == "hash-1"


def test_resubmitting_the_same_spec_changes_nothing(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    api.requests.clear()
    result = submit(client, make_objects(), "ml")
    assert result.outcome == "unchanged" and result.phase == "Pending"
    assert api.calls("PATCH") == [] and api.calls("DELETE") == []


def test_changed_spec_for_a_running_job_is_refused(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    api.get("jobs", "ml", "train")["status"] = {"active": 2}
    api.requests.clear()
    with pytest.raises(errors.SpecChanged) as info:
        submit(client, make_objects(spec_hash="hash-2"), "ml")
    msg = str(info.value)
    assert 'job "train" in namespace "ml" is Running with a different spec' in msg
    assert "--replace" in msg and "jobspec cancel train -n ml" in msg
    assert api.calls("PATCH") == []


def test_changed_spec_for_a_finished_job_is_refused_too(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    api.get("jobs", "ml", "train")["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    with pytest.raises(errors.SpecChanged, match=r"already ran \(Succeeded\)"):
        submit(client, make_objects(spec_hash="hash-2"), "ml")


def test_replace_deletes_in_the_foreground_waits_then_applies(
    api: FakeApi, client: ClusterClient, sleeps: list[float]
) -> None:
    submit(client, make_objects(), "ml")
    api.add_pod("ml", "train", 0)
    api.requests.clear()
    result = submit(client, make_objects(spec_hash="hash-2"), "ml", replace=True)
    assert result.outcome == "replaced"
    deletes = api.calls("DELETE")
    assert len(deletes) == 1 and deletes[0].query["propagationPolicy"] == "Foreground"
    assert all(p.query.get("force") == "true" for p in api.calls("PATCH"))
    first_patch = api.requests.index(api.calls("PATCH")[0])
    assert any(r.method == "GET" and r.path.endswith("/jobs/train") for r in api.requests[1:first_patch])
    assert api.get("jobs", "ml", "train")["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == "hash-2"
    assert [o for k, o in api.objects.items() if k[0] == "pods"] == []


def test_replace_gives_up_when_the_old_job_does_not_go(
    api: FakeApi, client: ClusterClient, sleeps: list[float]
) -> None:
    submit(client, make_objects(), "ml")
    api.fail("DELETE", r"/jobs/train$", 200, message="accepted")  # "deleted" but it stays
    stuck = api.add_pod("ml", "train", 1, node="gpu-7")["metadata"]["name"]
    with pytest.raises(errors.ClusterError, match="still being deleted after 3 s") as info:
        submit(client, make_objects(spec_hash="hash-2"), "ml", replace=True, replace_wait=3)
    assert sleeps == [1.0, 1.0, 1.0]
    msg = str(info.value)  # what is left, and that nothing new was applied
    assert f"still there: job.batch/train, pod/{stuck} (Running on node gpu-7)" in msg
    assert "nothing of the new spec was applied; configmap/train-spec, service/train" in msg


def test_cancel_that_times_out_says_what_is_gone_and_what_remains(
    api: FakeApi, client: ClusterClient, sleeps: list[float]
) -> None:
    submit(client, make_objects(), "ml")
    api.add_pod("ml", "train", 0, node="gpu-2")
    api.fail("DELETE", r"/jobs/train$", 200, message="accepted")  # the pods never stop
    with pytest.raises(errors.ClusterError) as info:
        cancel(client, "ml", "train", wait=True, wait_timeout=2)
    msg = str(info.value)
    assert "still there: job.batch/train, pod/train-0-" in msg and "(Running on node gpu-2)" in msg
    assert "deleted already: service/train, configmap/train-spec, networkpolicy.networking.k8s.io/train" in msg
    # the forced delete is no step the submitter can take (its Role has no pod delete: test_kustomize) (issue 43)
    assert "(not the jobspec-submitter Role: ask a cluster admin) forces it" in msg
    assert msg.index("ask a cluster admin") < msg.index("--force --grace-period=0")
    assert api.get("services", "ml", "train") is None and api.get("jobs", "ml", "train") is not None


def test_a_job_jobspec_did_not_make_is_never_touched(api: FakeApi, client: ClusterClient) -> None:
    foreign = make_objects()[2]
    foreign["metadata"]["labels"] = {}
    api.put(foreign)
    for replace in (False, True):
        with pytest.raises(errors.NotManaged, match="jobspec did not create it"):
            submit(client, make_objects(), "ml", replace=replace)
    assert api.calls("PATCH") == [] and api.calls("DELETE") == []


def test_409_on_resubmit_says_who_to_blame(api: FakeApi, client: ClusterClient) -> None:
    api.fail(
        "PATCH",
        r"/configmaps/train-spec$",
        409,
        message=('Apply failed with 1 conflict: conflict with "kubectl-client-side-apply" using v1: .data.spec.yaml'),
    )
    with pytest.raises(errors.Conflict) as info:
        submit(client, make_objects(), "ml")
    msg = str(info.value)
    assert 'conflict: patch configmaps "train-spec" in namespace "ml"' in msg
    assert "kubectl-client-side-apply" in msg and "--replace" in msg and "kubectl apply --server-side" in msg
    assert len(api.calls("PATCH")) == 1  # not retried, and the Job was not applied


def test_server_dry_run_sends_dry_run_all_and_persists_nothing(api: FakeApi, client: ClusterClient) -> None:
    result = submit(client, make_objects(), "ml", dry_run=True)
    assert result.dry_run and result.outcome == "created" and len(result.applied) == 4
    patches = api.calls("PATCH")
    assert len(patches) == 4 and all(p.query["dryRun"] == "All" for p in patches)
    assert api.objects == {}


def test_server_dry_run_of_a_replace_deletes_nothing(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    api.requests.clear()
    result = submit(client, make_objects(spec_hash="hash-2"), "ml", replace=True, dry_run=True)
    assert result.outcome == "replaced"
    assert all(r.query.get("dryRun") == "All" for r in api.requests if r.method in ("PATCH", "DELETE"))
    assert api.get("jobs", "ml", "train")["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == "hash-1"


def test_objects_are_placed_in_the_namespace_and_checked() -> None:
    placed = in_namespace(make_objects(namespace=None), "team-a")
    assert {o["metadata"]["namespace"] for o in placed} == {"team-a"}
    with pytest.raises(ConfigError, match="rendered for namespace 'ml', not 'team-a'"):
        in_namespace(make_objects(namespace="ml"), "team-a")
    with pytest.raises(ConfigError, match="jobspec submits only"):
        in_namespace([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}}], "ml")


def test_a_job_without_spec_hash_is_refused(client: ClusterClient) -> None:
    objs = make_objects()
    objs[2]["metadata"]["annotations"] = {}
    with pytest.raises(ConfigError, match="spec-hash"):
        submit(client, objs, "ml")


def test_cancel_deletes_everything_labelled_with_the_job(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    submit(client, make_objects(name="other"), "ml")
    api.add_pod("ml", "train", 0)
    api.requests.clear()
    result = cancel(client, "ml", "train")
    assert result.deleted == [
        "job.batch/train",
        "service/train",
        "configmap/train-spec",
        "networkpolicy.networking.k8s.io/train",
    ]
    lists = api.calls("GET")
    assert all(f"{LABEL_JOB}=train" in r.query["labelSelector"] for r in lists)
    assert [r.query["propagationPolicy"] for r in api.calls("DELETE")] == ["Background"] * 4
    assert sorted(k[2] for k in api.objects) == ["other", "other", "other", "other-spec"]  # pods gone with the Job


def test_cancel_wait_uses_foreground_and_polls(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    api.requests.clear()
    cancel(client, "ml", "train", wait=True)
    assert api.calls("DELETE")[0].query["propagationPolicy"] == "Foreground"
    assert api.requests[-1].method == "GET" and api.requests[-1].path.endswith("/jobs/train")


def test_cancel_of_a_missing_job(client: ClusterClient) -> None:
    with pytest.raises(errors.NotFound, match=r'job "ghost" does not exist in namespace "ml"'):
        cancel(client, "ml", "ghost")


def test_cancel_refuses_a_job_it_did_not_make(api: FakeApi, client: ClusterClient) -> None:
    foreign = make_objects()[2]
    foreign["metadata"]["labels"] = {}
    api.put(foreign)
    with pytest.raises(errors.NotManaged, match="was not created by jobspec"):
        cancel(client, "ml", "train")
    assert api.calls("DELETE") == []


def test_cancel_tolerates_objects_vanishing_meanwhile(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    api.fail("DELETE", r"/services/train$", 404, message='services "train" not found')
    result = cancel(client, "ml", "train")
    assert result.gone_already == ["service/train"]


def test_list_finds_jobspec_jobs_only(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(name="a"), "ml")
    submit(client, make_objects(name="b", queue="gpu-queue"), "ml")
    foreign = make_objects(name="c")[2]
    foreign["metadata"]["labels"] = {}
    api.put(foreign)
    jobs = list_jobs(client, "ml")
    assert [(j.name, j.queue) for j in jobs] == [("a", None), ("b", "gpu-queue")]
    n = len(api.requests)
    list_jobs(client, None)
    assert api.requests[n].path == "/apis/batch/v1/jobs"  # then each namespace's pods and events
