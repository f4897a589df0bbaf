"""Object-store URLs and paths: one parser (jobspec/spec/object_store.py) for validate, render, run and export.

A control character anywhere (a newline from a YAML block scalar, a tab from an escape) is refused with the field,
where it is and the fix: before, `checkpoints.dir: "s3://my-bucket/runs/x\\ny"` was not a URL to the parser (its
pattern stopped at the newline) and trained into `./s3:/my-bucket/...` on the pod's disk. `jobspec export` of a
malformed URL exits 2 naming it, never a traceback and never the URL's user part.
"""

from __future__ import annotations

import json

import pytest

from jobspec.errors import ConfigError, SpecError
from jobspec.spec import object_store
from jobspec.spec.loader import parse_spec
from runner.output.export import main as export_main

GOOD = "name: demo\nmodel:\n  preset: tiny\ntraining:\n  global_batch: 8\n  steps: 10\nhardware:\n  vendor: cpu\n"


@pytest.mark.parametrize(("field", "value"), [
    ("checkpoints.dir", "s3://my-bucket/runs/x\ny"),
    ("checkpoints.dir", "s3://my-bucket/runs/x\n"),  # a trailing newline (YAML's `|` block)
    ("checkpoints.dir", "gs://my-bucket/runs\t/x"),
    ("checkpoints.dir", "/checkpoints/run\n"),  # a local path too
    ("data.path", "s3://my-bucket/data/train.jsonl\n"),
    ("data.path", "s3://my-bucket/da\nta/train.jsonl"),
    ("data.path", "/data/train\x00.jsonl"),
    ("data.eval_path", "gs://my-bucket/eval.jsonl\r"),
])  # fmt: skip
def test_a_control_character_in_a_path_or_url_is_refused_with_the_field(field, value):
    section, key = field.split(".")
    text = GOOD + f"{section}:\n  {key}: {json.dumps(value)}\n"  # a double-quoted YAML string: escapes kept
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    text = str(info.value)
    assert field in text and "control character" in text, text


def test_the_same_urls_on_one_line_pass():
    spec = parse_spec(GOOD, overrides=["checkpoints.dir=s3://my-bucket/runs/x", "data.path=gs://my-bucket/d/t.jsonl"])
    assert spec.remote_dir == object_store.ObjectUrl("s3", "my-bucket", "runs/x")


@pytest.mark.parametrize("text", ["s3://b-1/x\ny", "s3://bucket/x\n", "gs://bucket\n"])
def test_a_url_with_a_newline_is_still_a_url(text):
    assert object_store.is_url(text) and object_store.problem(text)
    with pytest.raises(ValueError, match="control character"):
        object_store.parse(text)


def test_redacted_hides_the_user_part_only():
    assert object_store.redacted("s3://AKIAEXAMPLE:hunter2@bucket/runs/step-4") == "s3://***@bucket/runs/step-4"
    assert object_store.redacted("gs://bucket/a@b/step-4") == "gs://bucket/a@b/step-4"  # '@' in a key: no user part
    assert object_store.redacted("/local/path") == "/local/path"


@pytest.mark.parametrize(("url", "says"), [
    ("s3://bucket/runs/../../other/step-4", "'..'"),
    ("s3://AKIAIOSFODNN7EXAMPLE:hunter2pass@bucket/runs/step-4", "credentials"),
    ("gs://bucket/runs/x\n/step-4", "control character"),
    ("s3://B_UPPER/runs", "bucket name"),
])  # fmt: skip
def test_export_of_a_malformed_url_exits_2_without_a_traceback_or_the_secret(url, says, capsys):
    assert export_main([url]) == ConfigError.exit_code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert "hunter2" not in err and "AKIAIOSFODNN7" not in err, err
