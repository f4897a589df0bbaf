"""`jobspec submit` and the hub cache's claim: created when missing, left alone when it exists (whoever made it),
never deleted by `jobspec cancel` (jobs share it)."""

from __future__ import annotations

from typing import Any

from jobspec.cluster.cancel import cancel
from jobspec.cluster.client import ClusterClient
from jobspec.cluster.output import format_submit
from jobspec.cluster.submit import submit
from jobspec.render import render
from jobspec.spec.loader import parse_spec

from .fake_api import FakeApi

HUB_SPEC = """
name: train
namespace: ml
model: {path: org/model, architecture: {family: gpt2, layers: 2, hidden: 64, heads: 2, vocab: 100, intermediate: 256}}
training: {global_batch: 8, learning_rate: 1.0e-4}
hardware: {vendor: cpu}
"""
CLAIM = "jobspec-hf-cache-rwo"


def rendered(spec: str = HUB_SPEC) -> list[dict[str, Any]]:
    return render(parse_spec(spec))


def test_submit_creates_a_missing_claim_before_the_job(api: FakeApi, client: ClusterClient) -> None:
    result = submit(client, rendered(), "ml")
    assert result.applied[0] == f"persistentvolumeclaim/{CLAIM}" and result.applied[-1] == "job.batch/train"
    assert result.kept == []
    claim = api.get("persistentvolumeclaims", "ml", CLAIM)
    assert claim is not None and claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert f"persistentvolumeclaim/{CLAIM} applied" in format_submit(result)


def test_submit_leaves_an_existing_claim_alone(api: FakeApi, client: ClusterClient) -> None:
    theirs = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
              "metadata": {"name": CLAIM, "namespace": "ml", "labels": {"team": "nlp"}},
              "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "fast",
                       "resources": {"requests": {"storage": "50Gi"}}}}  # fmt: skip
    api.put(theirs)
    result = submit(client, rendered(), "ml")
    assert result.kept == [f"persistentvolumeclaim/{CLAIM}"]
    assert f"persistentvolumeclaim/{CLAIM}" not in result.applied
    assert api.calls("PATCH", "persistentvolumeclaims") == []  # not resized, relabelled or taken over
    claim = api.get("persistentvolumeclaims", "ml", CLAIM)
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi" and claim["metadata"]["labels"] == {
        "team": "nlp"
    }
    assert "kept" in format_submit(result)


def test_a_second_job_shares_the_claim_and_cancel_keeps_it(api: FakeApi, client: ClusterClient) -> None:
    submit(client, rendered(), "ml")
    second = submit(client, rendered(HUB_SPEC.replace("name: train", "name: other")), "ml")
    assert second.kept == [f"persistentvolumeclaim/{CLAIM}"]
    cancel(client, "ml", "train")
    cancel(client, "ml", "other")
    assert api.get("persistentvolumeclaims", "ml", CLAIM) is not None
    assert api.calls("DELETE", "persistentvolumeclaims") == []


def test_a_named_claim_is_never_created(api: FakeApi, client: ClusterClient) -> None:
    result = submit(client, rendered(HUB_SPEC.replace("model: {", "model: {hub_cache: {claim: mine}, ")), "ml")
    assert not any("persistentvolumeclaim" in r for r in result.applied)
    assert api.calls(path_contains="persistentvolumeclaims") == []
