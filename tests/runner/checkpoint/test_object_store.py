"""Checkpoints in an object store (runner/checkpoint/remote.py) against a real S3 API server on loopback (moto's)
and a GCS JSON API emulator (gcp-storage-emulator; it ignores preconditions and generation pins: gcs_server.py).

A two-rank CPU run publishes its checkpoints to a bucket (s3:// and gs://); the bucket is then left as a killed run
leaves it (the holder's lease still there, the newest steps torn: one with DONE but no manifest, one with a truncated
shard); a run in a fresh local directory (another pod) takes the stale lease over, skips the torn steps, resumes from
the newest intact one and trains the same losses and weights as the uninterrupted run; `jobspec export URL` writes
that model from the bucket. The lease's conditional writes are checked on their own: S3's honoured by moto, GCS's
sent (ifGenerationMatch) and, the emulator ignoring them, detected and logged.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import yaml

from jobspec.contract import EXIT_OK
from runner.checkpoint import lease, remote
from tests.runner import gcs_server, s3_server
from tests.runner.train_helpers import ROOT, records, run_supervisor, tiny_spec_dict, write_spec

safetensors = pytest.importorskip("safetensors.torch")

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3():
    """An S3 API server on 127.0.0.1 (a free port), the AWS_* variables pointing at it, a bucket; a boto3 client."""
    pytest.importorskip("moto.server", reason="moto[server] (the dev extra) runs the S3 API on loopback")
    pytest.importorskip("s3fs", reason="s3fs (the s3 extra) is the runner's object-store client")
    with s3_server.serve(BUCKET) as client:
        yield client


@pytest.fixture(scope="module")
def gcs():
    """A GCS emulator on 127.0.0.1, STORAGE_EMULATOR_HOST pointing at it, a bucket; a gcsfs filesystem."""
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (the dev extra) runs GCS on loopback")
    pytest.importorskip("gcsfs", reason="gcsfs (the gcs extra) is the runner's GCS client")
    with gcs_server.serve(BUCKET) as fs:
        yield fs


@pytest.fixture(params=["s3", "gs"])
def store(request):
    """(scheme, an fsspec filesystem on the bucket's store): what the test reads and damages the bucket with."""
    if request.param == "s3":
        request.getfixturevalue("s3")
        import s3fs

        return "s3", s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    return "gs", request.getfixturevalue("gcs")


def _keys(fs, prefix: str) -> set[str]:
    root = f"{BUCKET}/{prefix}"
    return {p[len(root):] for p in fs.find(root)}


def _weights(model_dir) -> dict:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(safetensors.load_file(str(f)))
    assert out, f"no weights in {model_dir}"
    return out


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _assert_lease_conditions(lines: list[str]) -> None:
    """The conditions GCS itself would enforce, among the requests logged in `lines`: the lease created only where
    nothing is (generation 0), renewed and released only at the generation it read."""
    sent = [line for line in lines if re.search(r"ifGenerationMatch=\d+", line)]
    assert any("&ifGenerationMatch=0 " in line for line in sent), sent  # create
    assert any(re.search(r"&ifGenerationMatch=[1-9]\d* ", line) for line in sent), sent  # renew
    assert any(re.search(r"DELETE .*lease\.json\?ifGenerationMatch=[1-9]", line) for line in sent), sent  # release


# gs:// runs in the sweep tier (pytest -m sweep; a minute on 2 cores): the same runner code as s3:// but for the
# store, whose conditional writes test_the_lease_in_a_gcs_bucket_sends_the_conditions_gcs_enforces checks by default.
@pytest.mark.parametrize("store", ["s3", pytest.param("gs", marks=pytest.mark.sweep)], indirect=True)
def test_two_ranks_checkpoint_to_a_bucket_are_killed_resume_exactly_and_export(tmp_path, store):
    scheme, fs = store
    prefix = "runs/a"
    spec = tiny_spec_dict(tmp_path / "unused", training={"micro_batch": 2, "steps": 6},
                          checkpoints={"dir": f"{scheme}://{BUCKET}/{prefix}", "every_steps": 2})  # fmt: skip

    def run(local: str) -> subprocess.CompletedProcess:
        s = {**spec, "checkpoints": {**spec["checkpoints"], "local_dir": str(tmp_path / local)}}
        result = run_supervisor([str(write_spec(tmp_path / f"{local}.yaml", s)), "--nproc", "2"])
        assert result.returncode == EXIT_OK, result.stderr[-4000:]
        return result

    first = run("a")  # uninterrupted: steps 1..6, checkpoints 2, 4, 6 in the bucket, the model exported and uploaded
    if scheme == "gs":  # the emulator ignores ifGenerationMatch: found out at the lease's first create, and said
        assert "ignores conditional writes (ifGenerationMatch=0)" in first.stderr
        _assert_lease_conditions(gcs_server.requests.lines)
    full = {r["step"]: r["loss"] for r in records(tmp_path / "a")}
    keys = _keys(fs, f"{prefix}/")
    for step in (2, 4, 6):
        assert {f"step-{step}/DONE", f"step-{step}/manifest.json", f"step-{step}/rng-0.pt",
                f"step-{step}/rng-1.pt", f"step-{step}/meta.json"} <= keys  # fmt: skip
    assert "model/config.json" in keys and "lease.json" not in keys  # released at exit
    assert "metrics.jsonl" in keys  # the run's records beside the steps (runner/checkpoint/run_files.py)

    # As a killed run leaves the bucket: its lease (a process that is gone), and torn steps past the last good one.
    step6 = f"{BUCKET}/{prefix}/step-6/"
    for name in _keys(fs, f"{prefix}/step-6/") - {"manifest.json"}:  # step-8: DONE, but its manifest never arrived
        fs.pipe_file(f"{BUCKET}/{prefix}/step-8/{name}", fs.cat_file(step6 + name))
    shard = next(n for n in _keys(fs, f"{prefix}/step-6/") if n.endswith(".distcp"))
    body = fs.cat_file(step6 + shard)
    fs.pipe_file(step6 + shard, body[: len(body) // 2])  # step-6: a truncated shard
    holder = {**lease._identity(), "pid": _dead_pid(), "pid_start": None, "holder": "f" * 32, "job": spec["name"],
              "since": time.time(), "heartbeat": time.time()}  # fmt: skip
    fs.pipe_file(f"{BUCKET}/{prefix}/lease.json", json.dumps(holder).encode())

    result = run("b")  # another pod: an empty local directory, the same bucket
    log = result.stderr
    assert "taking over the lease" in log and "has exited" in log
    assert "step-8 is damaged (manifest.json is missing)" in log
    assert "step-6 is damaged" in log and "were written (truncated or overwritten)" in log
    # its records: the first run's, restored from the bucket (kept after step 6), then the steps it redid from step 4
    assert "restored metrics.jsonl from" in log
    steps = [r["step"] for r in records(tmp_path / "b")]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6] and records(tmp_path / "b", "plan")[-1]["step"] == 4
    resumed = {r["step"]: r["loss"] for r in records(tmp_path / "b")[-2:]}
    assert resumed == {s: full[s] for s in (5, 6)}  # exact: the same bits as the uninterrupted run

    trained = _weights(tmp_path / "b" / "model")
    uninterrupted = _weights(tmp_path / "a" / "model")
    assert trained.keys() == uninterrupted.keys()
    assert all((trained[k] == uninterrupted[k]).all() for k in trained)

    # `jobspec export URL`: step-8 is still torn and skipped, step-6 was written again whole.
    from runner.output import export

    url = f"{scheme}://{BUCKET}/{prefix}"
    done = subprocess.run([sys.executable, "-m", "jobspec", "export", url, "--out", str(tmp_path / "exported")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == EXIT_OK, done.stderr[-4000:]
    out = tmp_path / "exported"
    assert json.loads((out / export.PROVENANCE).read_text())["step"] == 6
    exported = _weights(out)
    assert all((exported[k] == trained[k]).all() for k in trained)


def test_a_pod_created_again_starts_at_the_tier_the_ladder_reached_and_keeps_the_records(tmp_path, s3, caplog):
    """With a bucket the run directory is the pod's own disk. The ladder's state and the metrics an earlier pod kept
    beside the steps come back into a new pod's empty run directory before the ladder reads them: a gang whose tier
    ran out of memory starts at the next one, instead of trying it again on every pod the Job creates."""
    from jobspec.contract import METRICS_FILE, TIER_STATE_FILE
    from runner.checkpoint import run_files
    from runner.oom import ladder

    url = f"s3://{BUCKET}/runs/ladder"
    earlier = tmp_path / "earlier"
    ladder.save_state(earlier, ladder.TierState("zero2", [ladder.TierFailure("fast", "OOM at micro-batch 1", 1.0)]))
    (earlier / METRICS_FILE).write_text('{"kind": "train", "step": 1, "loss": 9.0}\n')
    run_files.put(url, earlier)  # what rank 0 did before its 75

    spec = tiny_spec_dict(tmp_path / "unused", training={"micro_batch": 2, "steps": 3},
                          checkpoints={"dir": url, "every_steps": 3, "local_dir": str(tmp_path / "pod")})  # fmt: skip
    result = run_supervisor([str(write_spec(tmp_path / "job.yaml", spec))])
    assert result.returncode == EXIT_OK, result.stderr[-4000:]
    assert "restored tier_state.json, metrics.jsonl from" in result.stderr
    assert re.search(r"memory tier zero2 from \S+/pod/tier_state\.json \(spec: fast; failed: fast\)", result.stderr)
    assert "plan: tier zero2" in result.stderr
    steps = [(r["step"], r["loss"]) for r in records(tmp_path / "pod")]
    assert steps[0] == (1, 9.0) and [s for s, _ in steps[1:]] == [1, 2, 3]

    # a local file is never replaced; one over its bound is not read; a link planted there is not written through
    local = tmp_path / "local"
    ladder.save_state(local, ladder.TierState("zero3"))
    (local / METRICS_FILE).symlink_to(tmp_path / "elsewhere")
    assert run_files.get(url, local) == [] and ladder.load_state(local).tier == "zero3"
    assert not (tmp_path / "elsewhere").exists()
    fresh = tmp_path / "fresh"
    monkey = {**run_files.LIMITS, METRICS_FILE: 8}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_files, "LIMITS", monkey)
        assert run_files.get(url, fresh) == [TIER_STATE_FILE]
    assert "metrics.jsonl not restored" in caplog.text
    # what anyone who can write the bucket put there is checked by its reader
    s3.put_object(Bucket=BUCKET, Key="runs/damaged/tier_state.json", Body=b'{"tier": "warp9"}')
    assert run_files.get(f"s3://{BUCKET}/runs/damaged", tmp_path / "damaged") == [TIER_STATE_FILE]
    with pytest.raises(Exception, match="unknown tier 'warp9'"):
        ladder.load_state(tmp_path / "damaged")


def _lease(url: str, job: str = "job") -> lease.Lease:
    return lease.Lease("/nonexistent-local-run-dir", job, timeout=60.0, file=remote.RemoteLeaseFile(remote.Bucket(url)))


def test_the_lease_in_a_bucket_is_one_writer_by_conditional_writes(s3, monkeypatch):
    url = f"s3://{BUCKET}/runs/lease"
    first = _lease(url)
    first.acquire()
    assert first.file.honoured  # moto refuses a second If-None-Match: * create, as S3 does
    me = lease._identity()
    monkeypatch.setattr(lease, "_identity", lambda: {**me, "pid": 1})  # the others: another process (first's lives)
    with pytest.raises(lease.LeaseHeld, match="is in use by another run"):
        _lease(url, "other").acquire()
    lease.check_holder("/unused", first.holder, "job", first.file)  # the fence of every rank passes

    # Stalled past the timeout: another run takes the lease over (If-Match on the record it read) ...
    record = json.loads(s3.get_object(Bucket=BUCKET, Key="runs/lease/lease.json")["Body"].read())
    record["heartbeat"] = time.time() - 3600
    s3.put_object(Bucket=BUCKET, Key="runs/lease/lease.json", Body=json.dumps(record).encode())
    second = _lease(url, "other")
    second.acquire()
    # ... and the first finds out: its renewal and every rank's fence refuse to go on.
    with pytest.raises(lease.LeaseLost):
        lease.check_holder("/unused", first.holder, "job", first.file)
    with pytest.raises(lease.LeaseLost, match="taken over"):
        first.beat(force=True)
    # A renewal that races a takeover is refused by the store, not written over it: an ETag that is not current.
    second.file.etag = '"0123456789abcdef0123456789abcdef"'
    assert not second._replace(second.holder)
    first.release()  # not its lease: left alone
    assert second.file.exists()
    second.file.read()
    second.release()
    assert not second.file.exists()


def test_the_lease_in_a_gcs_bucket_sends_the_conditions_gcs_enforces(gcs):
    """The emulator ignores ifGenerationMatch, which the lease finds out at its first create and says; what it sends
    is what GCS itself enforces: create only where nothing is (generation 0), renew and release only the generation
    it read."""
    url = f"gs://{BUCKET}/runs/gs-lease"
    before = len(gcs_server.requests.lines)
    first = _lease(url)
    first.acquire()
    assert first.file.honoured is False
    first.beat(force=True)
    first.release()
    assert not first.file.exists()
    _assert_lease_conditions(gcs_server.requests.lines[before:])


def test_a_torn_upload_is_never_a_checkpoint(tmp_path, store):
    """No DONE: not listed at all; DONE without the manifest, or a shard shorter than the manifest says: skipped, and
    with nothing intact the resume is refused (exit 2), never trained on."""
    bucket = remote.Bucket(f"{store[0]}://{BUCKET}/runs/torn")
    files = {"a.bin": b"x" * 1000}
    listed = {"format": 1, "step": 3, "checksum": "crc32", "files": {"a.bin": {"bytes": 1000, "crc32": "0"}}}
    for name, data in {**files, "manifest.json": json.dumps(listed).encode()}.items():
        bucket.put_bytes(data, "step-3", name)  # step-3: the upload stopped before DONE
    assert bucket.steps() == ([], [3])
    assert remote.newest_intact(bucket, tmp_path / "local") is None
    bucket.put_bytes(b"x" * 10, "step-4", "a.bin")
    bucket.put_bytes(json.dumps({**listed, "step": 4}).encode(), "step-4", "manifest.json")
    bucket.put_bytes(b"", "step-4", "DONE")  # step-4: complete, but its shard is truncated
    problem = remote.download_step(bucket, tmp_path / "local", 4)
    assert problem == "a.bin has 10 bytes in the bucket, 1000 were written (truncated or overwritten)"
    with pytest.raises(remote.store.DamagedCheckpoint, match=r"step-4: a\.bin has 10 bytes"):
        remote.newest_intact(bucket, tmp_path / "local")
    assert not list((tmp_path / "local").iterdir())  # nothing half-downloaded is left
    remote.prune(bucket, keep=1)
    assert bucket.steps() == ([4], [4])  # the unfinished step-3, older than the newest complete one, is gone


def test_spec_with_a_bucket_renders_no_volume_claim_and_no_secret(tmp_path):
    from jobspec.render import render
    from jobspec.spec.loader import parse_spec

    spec = {**tiny_spec_dict(tmp_path), "name": "s3-job", "env_from_secrets": ["s3-credentials"]}
    spec["hardware"] = {"vendor": "cpu", "gpus": 1, "nodes": 2}
    spec["checkpoints"] = {"dir": "s3://ckpt/runs/s3-job", "every_steps": 4}
    text = yaml.safe_dump(render(parse_spec(yaml.safe_dump(spec))))
    assert "persistentVolumeClaim" not in text and "s3-credentials" in text and "testing" not in text
    pod = next(o for o in render(parse_spec(yaml.safe_dump(spec))) if o["kind"] == "Job")["spec"]["template"]["spec"]
    assert {"name": "checkpoints", "emptyDir": {}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in mounts
    for bad, said in [({"pvc": "vol"}, "a volume cannot be mounted at s3://"),
                      ({"dir": "gs://Bad/x"}, "not a GCS bucket name"),
                      ({"dir": "s3://AKIA:secret@ckpt/x"}, "checkpoints.dir")]:  # fmt: skip
        wrong = {**spec, "checkpoints": {**spec["checkpoints"], **bad}}
        with pytest.raises(Exception, match=said) as err:
            parse_spec(yaml.safe_dump(wrong))
        assert "secret@" not in str(err.value)
