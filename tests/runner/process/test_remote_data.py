"""Data sources in an object store (runner/process/remote_data.py) against a real S3 API server on loopback (moto's).

A CPU run whose data.path is s3://bucket/chat.jsonl trains loss for loss as the same run on the local file; run again
(it resumes from its checkpoint) it reads this node's copy without a GET of the object; a changed object (new ETag) is
downloaded again and its older copy removed; a missing object or bucket exits 2 naming the field and the fix, a
store that does not answer is retryable (exit 1); an object replaced between listing and GET is read again, one over
the size bound refused; two processes on one cache download once; a prefix (a datasets save_to_disk directory) comes
down whole. The spec side: URLs validated as checkpoints.dir's, and
the rendered pod has no data volume and no credentials.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobspec.contract import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from jobspec.errors import ConfigError
from runner.checkpoint.remote import RemoteUnavailable
from runner.process import remote_data
from tests.runner import s3_server
from tests.runner.train_helpers import ROOT, records, run_supervisor, tiny_spec, tiny_spec_dict, write_spec

pytest.importorskip("moto.server", reason="moto[server] (the dev extra) runs the S3 API on loopback")
pytest.importorskip("s3fs", reason="s3fs (the s3 extra) is the runner's object-store client")

BUCKET = "data"
LINES = (ROOT / "runner" / "data" / "sft_synthetic.jsonl").read_bytes().splitlines(keepends=True)


@pytest.fixture(scope="module")
def s3():
    with s3_server.serve(BUCKET) as client:
        yield client


def _gets(key: str) -> int:
    return s3_server.requests.count("GET", f"/{BUCKET}/{key}")


def test_a_run_on_s3_data_equals_the_local_run_and_downloads_once(tmp_path, s3, monkeypatch):
    data = b"".join(LINES[:400])
    (tmp_path / "chat.jsonl").write_bytes(data)
    s3.put_object(Bucket=BUCKET, Key="sets/chat.jsonl", Body=data)
    url = f"s3://{BUCKET}/sets/chat.jsonl"

    def run(name: str, path: str, steps: int) -> str:
        spec = tiny_spec_dict(tmp_path / name, data={"path": path}, training={"steps": steps, "warmup_steps": 1},
                              checkpoints={"every_steps": 2})  # fmt: skip
        result = run_supervisor([str(write_spec(tmp_path / f"{name}-{steps}.yaml", spec))])
        assert result.returncode == EXIT_OK, result.stderr[-4000:]
        return result.stderr

    run("local", str(tmp_path / "chat.jsonl"), 2)
    log = run("s3", url, 2)
    assert "data.path s3://data/sets/chat.jsonl (ETag" in log and "downloading into" in log
    assert _gets("sets/chat.jsonl") == 1  # one ranged GET: 23 KB
    local = {r["step"]: r["loss"] for r in records(tmp_path / "local")}
    assert sorted(local) == [1, 2]
    assert {r["step"]: r["loss"] for r in records(tmp_path / "s3")} == local  # the same bits

    # Again, longer: resumed from step 2 (the lineage names the same copy), the copy read, the object not.
    log = run("s3", url, 3)
    assert "this node's copy" in log and "not downloaded again" in log and "downloading" not in log
    assert _gets("sets/chat.jsonl") == 1
    assert [r["step"] for r in records(tmp_path / "s3")] == [1, 2, 3]

    # The object changes (a new ETag): downloaded again, into a new entry; the older copy removed.
    spec = tiny_spec(tmp_path / "s3", data={"path": url}, training={"steps": 3})
    [before] = remote_data.localize(spec)
    s3.put_object(Bucket=BUCKET, Key="sets/chat.jsonl", Body=b"".join(LINES[:300]))
    [kept] = remote_data.localize(spec)  # the older copy, chosen a moment ago, is left: its job may open it yet
    assert Path(yaml.safe_load(before.split("=", 1)[1])).is_file()
    monkeypatch.setattr(remote_data, "OLDER_KEPT_S", 0.0)
    s3.put_object(Bucket=BUCKET, Key="sets/chat.jsonl", Body=b"".join(LINES[:300]) + b"\n")  # a newer ETag still
    [after] = remote_data.localize(spec)
    assert _gets("sets/chat.jsonl") == 3
    old, middle, new = (yaml.safe_load(o.split("=", 1)[1]) for o in (before, kept, after))
    assert len({old, middle, new}) == 3 and Path(new).read_bytes() == b"".join(LINES[:300]) + b"\n"
    assert not Path(old).exists() and not Path(middle).exists()  # older versions, removed


def test_two_processes_on_one_cache_download_once(tmp_path, s3):
    """Two supervisors sharing a cache (pods of a node, jobs on one volume) start at once: one GET of the object."""
    s3.put_object(Bucket=BUCKET, Key="sets/shared.jsonl", Body=b"".join(LINES[:200]))
    spec = tiny_spec_dict(tmp_path / "run", data={"path": f"s3://{BUCKET}/sets/shared.jsonl",
                                                  "cache_dir": str(tmp_path / "cache")})  # fmt: skip
    code = ("import sys; from jobspec.spec.loader import load_spec; from runner.process import remote_data; "
            "print(remote_data.localize(load_spec(sys.argv[1]))[0])")  # fmt: skip
    path = str(write_spec(tmp_path / "spec.yaml", spec))
    procs = [subprocess.Popen([sys.executable, "-c", code, path], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1] and "shared.jsonl" in outs[0]
    assert _gets("sets/shared.jsonl") == 1
    local = Path(yaml.safe_load(outs[0].strip().split("=", 1)[1]))
    assert local.read_bytes() == b"".join(LINES[:200]) and local.is_relative_to(tmp_path / "cache" / "objects")


def test_a_missing_object_or_bucket_exits_2_naming_the_field_and_no_answer_is_retried(tmp_path, s3, monkeypatch):
    spec = tiny_spec_dict(tmp_path / "run", data={"path": f"s3://{BUCKET}/sets/none.jsonl"})
    result = run_supervisor([str(write_spec(tmp_path / "spec.yaml", spec))])
    assert result.returncode == EXIT_CONFIG, result.stderr[-4000:]
    assert "data.path s3://data/sets/none.jsonl: no object 'sets/none.jsonl' in bucket 'data'" in result.stderr
    assert "Traceback" not in result.stderr and "testing" not in result.stderr  # no credential shown
    spec = tiny_spec(tmp_path / "run", data={"sources": [{"path": str(ROOT / "runner/data/sft_synthetic.jsonl")},
                                                         {"path": "s3://no-such-bucket/a.jsonl"}]})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^data\.sources\.1\.path s3://no-such-bucket/a\.jsonl: no bucket"):
        remote_data.localize(spec)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens: retryable, not a config error
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(RemoteUnavailable, match=r"^data\.sources\.1\.path .* did not answer") as err:
        remote_data.localize(spec)
    assert err.value.exit_code == EXIT_FAILED


def test_an_object_replaced_while_read_is_read_again_and_a_large_one_refused(tmp_path, s3, monkeypatch, caplog):
    s3.put_object(Bucket=BUCKET, Key="sets/moving.jsonl", Body=b"".join(LINES[:50]))
    spec = tiny_spec(tmp_path / "run", data={"path": f"s3://{BUCKET}/sets/moving.jsonl"})
    listing, seen = remote_data._listing, []

    def stale_first(*args):  # the first listing is of a version replaced before its GET: 412 on If-Match
        objs = listing(*args)
        seen.append(objs)
        return [o._replace(etag='"0123456789abcdef0123456789abcdef"') for o in objs] if len(seen) == 1 else objs

    monkeypatch.setattr(remote_data, "_listing", stale_first)
    [override] = remote_data.localize(spec)
    # listed: the stale version (its GET refused), the current one, and once more after its download (unchanged)
    assert len(seen) == 3 and "changed while it was downloaded (attempt 1 of 3)" in caplog.text
    assert Path(yaml.safe_load(override.split("=", 1)[1])).read_bytes() == b"".join(LINES[:50])
    monkeypatch.setattr(remote_data, "MAX_BYTES", 1000)
    s3.put_object(Bucket=BUCKET, Key="sets/moving.jsonl", Body=b"".join(LINES[:60]))
    with pytest.raises(ConfigError, match=r"^data\.path s3://data/sets/moving\.jsonl holds [\d,]+ bytes, more than 1,"):
        remote_data.localize(spec)


def test_a_prefix_is_a_datasets_directory_downloaded_whole(tmp_path, s3):
    datasets = pytest.importorskip("datasets")
    from runner.data.records import source_kind

    rows = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(50)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for path in sorted(p for p in (tmp_path / "ds").rglob("*") if p.is_file()):
        s3.upload_file(str(path), BUCKET, f"sets/ds/{path.relative_to(tmp_path / 'ds').as_posix()}")
    spec = tiny_spec(tmp_path / "run", data={"path": str(ROOT / "runner/data/sft_synthetic.jsonl"),
                                             "eval_path": f"s3://{BUCKET}/sets/ds/"})  # fmt: skip
    [override] = remote_data.localize(spec)
    field, local = override.split("=", 1)
    local = yaml.safe_load(local)
    assert field == "data.eval_path" and local.endswith("/ds") and source_kind(local, field) == "datasets"
    assert datasets.load_from_disk(local).to_list() == rows


def test_data_urls_are_validated_and_render_no_volume_and_no_secret(tmp_path):
    from jobspec.render import render
    from jobspec.spec.loader import parse_spec

    spec = {**tiny_spec_dict(tmp_path), "name": "s3-data", "env_from_secrets": ["s3-credentials"]}
    spec["data"] = {"path": "s3://data/sets/chat.jsonl", "eval_path": "s3://data/sets/eval/"}
    objects = render(parse_spec(yaml.safe_dump(spec)))
    text = yaml.safe_dump(objects)
    pod = next(o for o in objects if o["kind"] == "Job")["spec"]["template"]["spec"]
    assert "persistentVolumeClaim" not in text and "s3-credentials" in text and "AWS_SECRET" not in text
    assert not any(v["name"] == "data" for v in pod["volumes"])
    for bad, said in [({"path": "ftp://data/chat.jsonl"}, "not an object store jobspec reads"),
                      ({"path": "s3://AKIA:secret@data/chat.jsonl"}, "data.path"),
                      ({"eval_path": "s3://data/chat.txt"}, "must end in .jsonl"),
                      ({"sources": [{"path": "s3://data/../x.jsonl"}]}, "no '..'"),
                      ({"path": "s3://data"}, "names a bucket, not data"),
                      ({"cache_dir": "s3://data/cache"}, "a local path"),
                      ({"path": "hf://datasets/org/name/train.jsonl"}, "give the hub dataset id"),
                      ({"path": "https://example.com/x.jsonl"}, "copy the file into a bucket")]:  # fmt: skip
        with pytest.raises(Exception, match=said) as err:
            parse_spec(yaml.safe_dump({**spec, "data": bad}))
        assert "secret@" not in str(err.value)
