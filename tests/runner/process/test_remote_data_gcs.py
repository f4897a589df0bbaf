"""Data sources on gs:// (runner/process/remote_data.py through runner/checkpoint/stores.py's GCS) against a GCS JSON
API emulator on loopback (gcp-storage-emulator, tests/runner/gcs_server.py).

A CPU run whose data.path is gs://bucket/chat.jsonl trains loss for loss as the same run on the local file, its reads
pinned to the listed generation; a missing object exits 2 naming the field and the fix, a missing bucket is a
ConfigError, an endpoint that does not answer is retryable (exit 1). The emulator serves the current object whatever
generation a read pins (GCS would answer 404 for a replaced generation): an object replaced while it is read is caught
by the listing after the download, and read again whole.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import yaml

from jobspec.contract import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from jobspec.errors import ConfigError
from runner.checkpoint.remote import RemoteUnavailable
from runner.process import remote_data
from tests.runner import gcs_server
from tests.runner.train_helpers import ROOT, records, run_supervisor, tiny_spec, tiny_spec_dict, write_spec

pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (the dev extra) runs GCS on loopback")
pytest.importorskip("gcsfs", reason="gcsfs (the gcs extra) is the runner's GCS client")

BUCKET = "data"
LINES = (ROOT / "runner" / "data" / "sft_synthetic.jsonl").read_bytes().splitlines(keepends=True)


@pytest.fixture(scope="module")
def gcs():
    with gcs_server.serve(BUCKET) as fs:
        yield fs


def _local(override: str) -> Path:
    return Path(yaml.safe_load(override.split("=", 1)[1]))


def test_a_run_on_gs_data_equals_the_local_run_with_reads_pinned_to_the_generation(tmp_path, gcs):
    data = b"".join(LINES[:400])
    (tmp_path / "chat.jsonl").write_bytes(data)
    gcs.pipe_file(f"{BUCKET}/sets/chat.jsonl", data)
    generation = gcs.info(f"{BUCKET}/sets/chat.jsonl")["generation"]
    losses = {}
    for name, path in (("local", str(tmp_path / "chat.jsonl")), ("gs", f"gs://{BUCKET}/sets/chat.jsonl")):
        spec = tiny_spec_dict(tmp_path / name, data={"path": path}, training={"steps": 2, "warmup_steps": 1})
        result = run_supervisor([str(write_spec(tmp_path / f"{name}.yaml", spec))])
        assert result.returncode == EXIT_OK, result.stderr[-4000:]
        losses[name] = {r["step"]: r["loss"] for r in records(tmp_path / name)}
    assert f"data.path gs://data/sets/chat.jsonl (generation {generation}" in result.stderr
    assert sorted(losses["local"]) == [1, 2] and losses["gs"] == losses["local"]  # the same bits
    reads = gcs_server.requests.matching(r"GET /storage/v1/b/data/o/sets%2Fchat\.jsonl\?alt=media")
    assert reads and all(f"generation={generation}" in line for line in reads)


def test_a_missing_object_or_bucket_exits_2_and_no_answer_is_retried(tmp_path, gcs, monkeypatch):
    spec = tiny_spec_dict(tmp_path / "run", data={"path": f"gs://{BUCKET}/sets/none.jsonl"})
    result = run_supervisor([str(write_spec(tmp_path / "spec.yaml", spec))])
    assert result.returncode == EXIT_CONFIG, result.stderr[-4000:]
    assert "data.path gs://data/sets/none.jsonl: no object 'sets/none.jsonl' in bucket 'data'" in result.stderr
    assert "gcloud storage ls gs://data/" in result.stderr and "Traceback" not in result.stderr
    spec = tiny_spec(tmp_path / "run", data={"eval_path": "gs://no-such-bucket/a.jsonl"})
    with pytest.raises(ConfigError, match=r"^data\.eval_path gs://no-such-bucket/a\.jsonl: no bucket 'no-such-bucket'"):
        remote_data.localize(spec)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")  # nothing listens: retryable
    import gcsfs.retry

    async def _no_wait(_: float) -> None:  # gcsfs retries 6 times, 31 s of backoff: the same errors, at once
        return None

    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=_no_wait))
    with pytest.raises(RemoteUnavailable, match=r"^data\.eval_path .* did not answer") as err:
        remote_data.localize(spec)
    assert err.value.exit_code == EXIT_FAILED


def test_an_object_replaced_while_read_is_caught_though_the_store_ignores_the_pin(tmp_path, gcs, monkeypatch, caplog):
    key = f"{BUCKET}/sets/moving.jsonl"
    old, new = b"".join(LINES[:50]), b"".join(LINES[50:120])
    gcs.pipe_file(key, old)
    download, calls = remote_data._download, []

    def replaced_first(store, where, field, url, objs, local):  # replaced after it was listed, before it is read
        calls.append(objs[0].etag)
        if len(calls) == 1:
            gcs.pipe_file(key, new)
        return download(store, where, field, url, objs, local)

    monkeypatch.setattr(remote_data, "_download", replaced_first)
    [override] = remote_data.localize(tiny_spec(tmp_path / "run", data={"path": f"gs://{key}"}))
    # GCS answers the pinned read of the replaced generation with 404; the emulator serves the new bytes: either
    # way the first attempt is not kept, and the copy is one version whole, recorded as that version.
    assert "changed while it was downloaded (attempt 1 of 3)" in caplog.text
    assert len(calls) == 2 and calls[1] == str(gcs.info(key)["generation"]) != calls[0]
    assert _local(override).read_bytes() == new


def test_gcs_credentials_are_a_secret_mounted_as_a_file_never_inline(tmp_path):
    from jobspec.render import render
    from jobspec.spec.loader import parse_spec

    spec = {**tiny_spec_dict(tmp_path), "name": "gs-job", "data": {"path": "gs://data/sets/chat.jsonl"},
            "checkpoints": {"dir": "gs://ckpt/runs/gs-job"}, "gcs_credentials": {"secret": "gcs-key", "key": "sa.json"}}
    objects = render(parse_spec(yaml.safe_dump(spec)))
    pod = next(o for o in objects if o["kind"] == "Job")["spec"]["template"]["spec"]
    assert {"name": "gcs-credentials", "secret": {"secretName": "gcs-key", "items": [{"key": "sa.json",
            "path": "key.json"}], "defaultMode": 0o440}} in pod["volumes"]  # fmt: skip
    container = pod["containers"][0]
    assert {"name": "gcs-credentials", "mountPath": "/var/run/secrets/jobspec/gcs", "readOnly": True} in \
        container["volumeMounts"]  # fmt: skip
    assert {"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": "/var/run/secrets/jobspec/gcs/key.json"} in \
        container["env"]  # fmt: skip
    assert "persistentVolumeClaim" not in yaml.safe_dump(objects)
    from jobspec.cluster.preflight import pod_refs  # submit checks the Secret and its key before anything is applied

    job = next(o for o in objects if o["kind"] == "Job")
    assert pod_refs(job).secrets["gcs-key"] == {"sa.json": "volume gcs-credentials"}
    del spec["gcs_credentials"]  # workload identity: no Secret, no variable
    pod = next(o for o in render(parse_spec(yaml.safe_dump(spec))) if o["kind"] == "Job")["spec"]["template"]["spec"]
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in yaml.safe_dump(pod) and "secret" not in yaml.safe_dump(pod)
    inline = '{"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----abc"}'
    with pytest.raises(Exception, match=r"gcs_credentials: invalid value \(not shown: it may be a credential\)") as err:
        parse_spec(yaml.safe_dump({**spec, "gcs_credentials": inline}))
    assert "BEGIN PRIVATE KEY" not in str(err.value)


def test_gcs_credentials_without_a_gs_location_or_beside_the_env_variable_exit_2(tmp_path):
    """A key mounted for no gs:// location (a typo, or a bucket moved to s3://) and a key named twice (the explicit
    env entry from a Secret would win silently) are refused by `jobspec validate`, naming the field and the fix."""
    from jobspec.contract import EXIT_CONFIG
    from tests.cli_helpers import cli

    key = {"secret": "gcs-key", "key": "sa.json"}
    base = {**tiny_spec_dict(tmp_path), "name": "gs-job", "gcs_credentials": key}
    cases = {
        "s3": ({**base, "checkpoints": {"dir": "s3://ckpt/runs/gs-job"}}, "no gs:// location uses it"),
        "twice": ({**base, "data": {"path": "gs://data/chat.jsonl"},
                   "env": {"GOOGLE_APPLICATION_CREDENTIALS": {"secret": "k", "key": "sa.json"}}}, "is given twice"),
    }  # fmt: skip
    for name, (spec, why) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        code, out = cli("validate", str(path))
        assert code == EXIT_CONFIG and "gcs_credentials" in out and why in out, (name, out)
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump({**base, "data": {"sources": [{"path": "gs://data/chat.jsonl"}]}}))
    assert cli("validate", str(ok))[0] == 0
