"""The hub cache in the rendered objects (jobspec/render/hub.py): HF_HOME on a PersistentVolumeClaim when the
model or data come from the hub, an emptyDir when opted out, nothing for presets and local paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate.utils import major_minor

from jobspec.contract import HF_CACHE_MOUNT, LABEL_JOB
from jobspec.errors import ConfigError
from jobspec.render import render
from jobspec.spec.hub import hub_origin
from jobspec.spec.loader import load_spec
from tests.test_render import K8S_VERSIONS, MULTINODE, RESTRICTED_VOLUME_TYPES, SFT, by_kind, env_of, mounts_of

# env={}: the example sets its own HF_HOME, which wins over the cache's (the user's env wins over every default).
HUB_MODEL = (
    "env={}","model.preset=null", "model.path=meta-llama/Llama-3.2-1B",
             "model.architecture={family: llama, layers: 16, hidden: 2048, heads: 32, vocab: 128256, "
             "intermediate: 8192, kv_heads: 8}")  # fmt: skip


def objects(*overrides: str, path: Path = SFT) -> list[dict[str, Any]]:
    return render(load_spec(path, overrides))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_a_hub_model_mounts_hf_home_from_a_claim_rendered_with_the_job(version: str) -> None:
    objs = objects(*HUB_MODEL, "model.hub_token={secret: hf, key: token}")
    assert objs[0]["kind"] == "PersistentVolumeClaim"  # applied before the Job that mounts it
    kinds = by_kind(objs)
    claim = kinds["PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == "jobspec-hf-cache-rwo" and claim["metadata"]["namespace"] == "jobspec"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]  # one node
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi" and "storageClassName" not in claim["spec"]
    assert LABEL_JOB not in claim["metadata"]["labels"]  # no job owns it: cancel and the TTL leave it
    assert "ownerReferences" not in claim["metadata"]
    assert mounts_of(kinds)[HF_CACHE_MOUNT] == {
        "name": "hf-cache", "persistentVolumeClaim": {"claimName": "jobspec-hf-cache-rwo"}
    }  # fmt: skip
    env = env_of(kinds)
    assert env["HF_HOME"] == {"name": "HF_HOME", "value": HF_CACHE_MOUNT}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    for obj in objs:
        assert kubernetes_validate.validate(obj, version, strict=True) == major_minor(version)


def test_several_nodes_share_a_read_write_many_claim_of_the_asked_size_and_class() -> None:
    kinds = by_kind(objects(*HUB_MODEL, "model.hub_cache={size: 1Ti, storage_class: nfs}", path=MULTINODE))
    claim = kinds["PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == "jobspec-hf-cache-rwx" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Ti" and claim["spec"]["storageClassName"] == "nfs"
    for obj in kinds.values():
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


def test_a_single_node_claim_cannot_serve_several_nodes() -> None:
    with pytest.raises(ConfigError, match=r"model.hub_cache.access_mode ReadWriteOnce with hardware.nodes 2"):
        objects(*HUB_MODEL, "model.hub_cache={access_mode: ReadWriteOnce}", path=MULTINODE)


def test_a_named_claim_is_mounted_and_never_rendered() -> None:
    kinds = by_kind(objects(*HUB_MODEL, "model.hub_cache={claim: team-hf-cache}"))
    assert "PersistentVolumeClaim" not in kinds
    assert mounts_of(kinds)[HF_CACHE_MOUNT]["persistentVolumeClaim"] == {"claimName": "team-hf-cache"}


@pytest.mark.parametrize("opt_out", ["model.hub_cache=none", "model.hub_cache={claim: none}", "model.hub_cache=false"])
def test_opting_out_puts_the_cache_on_an_emptydir(opt_out: str) -> None:
    kinds = by_kind(objects(*HUB_MODEL, opt_out))
    assert "PersistentVolumeClaim" not in kinds
    assert mounts_of(kinds)[HF_CACHE_MOUNT] == {"name": "hf-cache", "emptyDir": {}}
    assert env_of(kinds)["HF_HOME"]["value"] == HF_CACHE_MOUNT


@pytest.mark.parametrize(
    "overrides",
    [
        (),  # a preset
        (
            "model.preset=null",
            "model.path=/models/llama",
            "model.architecture={family: gpt2, layers: 2, hidden: 64, heads: 2, vocab: 100, intermediate: 256}",
        ),
        ("data.path=./train.jsonl",),
        ("data.path=sft/train.parquet",),
    ],
)
def test_nothing_from_the_hub_mounts_no_cache(overrides: tuple[str, ...]) -> None:
    kinds = by_kind(objects(*overrides))
    assert "PersistentVolumeClaim" not in kinds and HF_CACHE_MOUNT not in mounts_of(kinds)
    assert env_of(kinds)["HF_HOME"]["value"] == "/checkpoints/hf-cache"  # the example's own env, untouched


@pytest.mark.parametrize("data", ["data.path=HuggingFaceH4/ultrachat_200k", "data.eval_path=org/evals",
                                  "data.sources=[{path: /data/a.jsonl}, {path: org/chats, weight: 2}]"])  # fmt: skip
def test_a_hub_dataset_mounts_the_cache_too(data: str) -> None:
    overrides = ("data.path=null", data) if data.startswith("data.sources") else (data,)
    kinds = by_kind(objects(*overrides, "env={}"))
    assert kinds["PersistentVolumeClaim"]["metadata"]["name"] == "jobspec-hf-cache-rwo"
    assert env_of(kinds)["HF_HOME"]["value"] == HF_CACHE_MOUNT


def test_the_pod_stays_restricted_with_the_cache() -> None:
    pod = by_kind(objects(*HUB_MODEL))["Job"]["spec"]["template"]["spec"]
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= RESTRICTED_VOLUME_TYPES


def test_checkpoints_cannot_hide_the_cache_mount() -> None:
    with pytest.raises(ConfigError, match="would hide the pod's own /hf-cache mount"):
        objects(*HUB_MODEL, f"checkpoints.dir={HF_CACHE_MOUNT}")


@pytest.mark.parametrize("bad", ["model.hub_token=hf_abcdefghijklmnopqrstuvwxyz0123", "model.revision=../main",
                                 "model.hub_cache={claim: Not_A_Name}", "model.hub_cache={size: lots}"])  # fmt: skip
def test_bad_hub_settings_are_refused_when_the_spec_loads(bad: str) -> None:
    from jobspec.errors import SpecError

    with pytest.raises(SpecError) as info:
        load_spec(SFT, [*HUB_MODEL, bad])
    assert "hf_abcdefghijklmnopqrstuvwxyz0123" not in str(info.value)


@pytest.mark.parametrize(
    ("path", "origin"),
    [
        ("/hf-cache/hub/models--org--name/snapshots/" + "a" * 40, ("org/name", "a" * 40)),
        ("/x/hub/models--gpt2/snapshots/" + "0f" * 20 + "/", ("gpt2", "0f" * 20)),
        ("/x/hub/models--org--na.me-1/snapshots/" + "1" * 40, ("org/na.me-1", "1" * 40)),
        ("/x/hub/models--org--name/snapshots/main", None),  # not a commit: no snapshot of the cache
        ("/c/hub/models--meta-llama--Llama-3.2-1B/snapshots/" + "b" * 40, ("meta-llama/Llama-3.2-1B", "b" * 40)),
        ("/models/llama", None),
        ("org/name", None),
        (None, None),
    ],
)
def test_a_snapshot_in_the_cache_maps_back_to_its_hub_id_and_commit(path, origin):
    # the export's adapter names the hub id (loadable anywhere), not the pod's cache directory
    assert hub_origin(path) == origin


def test_a_benchmark_task_from_the_hub_mounts_the_cache_and_a_task_file_does_not() -> None:
    """eval.benchmarks: a task name's data set comes from the hub into HF_HOME (runner/output/benchmarks.py)."""
    named = by_kind(objects("env={}", "eval.benchmarks=[arc_easy]"))  # env={}: the example sets its own HF_HOME
    assert mounts_of(named)[HF_CACHE_MOUNT]["persistentVolumeClaim"] == {"claimName": "jobspec-hf-cache-rwo"}
    assert env_of(named)["HF_HOME"] == {"name": "HF_HOME", "value": HF_CACHE_MOUNT}
    local = by_kind(objects("eval.benchmarks=[/tasks/mine.yaml]"))
    assert HF_CACHE_MOUNT not in mounts_of(local) and "PersistentVolumeClaim" not in local
