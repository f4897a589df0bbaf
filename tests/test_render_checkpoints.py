"""Each job its own place on a shared checkpoint volume: the PVC is mounted with subPath = the job name."""

from __future__ import annotations

import pytest

from jobspec.errors import SpecError
from jobspec.render import render
from jobspec.spec.loader import parse_spec

BASE = """\
name: {name}
model: {{preset: tiny}}
training: {{global_batch: 8}}
checkpoints: {{pvc: shared-ckpt{extra}}}
"""


def mount(name: str, extra: str = "") -> dict:
    job = next(o for o in render(parse_spec(BASE.format(name=name, extra=extra))) if o["kind"] == "Job")
    mounts = job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    return next(m for m in mounts if m["name"] == "checkpoints")


def test_two_jobs_on_one_volume_get_their_own_directories():
    a, b = mount("job-a"), mount("job-b")
    assert (a["mountPath"], a["subPath"]) == ("/checkpoints", "job-a")
    assert b["subPath"] == "job-b"


def test_sub_path_can_be_named_or_turned_off():
    assert mount("job-a", ", sub_path: team/run-7")["subPath"] == "team/run-7"
    assert "subPath" not in mount("job-a", ", sub_path: null")  # the volume's root, as before


def test_without_a_pvc_there_is_no_sub_path():
    spec = parse_spec("name: a\nmodel: {preset: tiny}\ntraining: {global_batch: 8}\n")
    job = next(o for o in render(spec) if o["kind"] == "Job")
    mounts = job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert "subPath" not in next(m for m in mounts if m["name"] == "checkpoints")


@pytest.mark.parametrize("bad", ["../other-job", "/abs", "a/../b", "a b", ""])
def test_a_sub_path_that_escapes_or_is_not_a_plain_path_is_refused(bad):
    with pytest.raises(SpecError, match=r"checkpoints\.sub_path"):
        parse_spec(BASE.format(name="a", extra=f", sub_path: '{bad}'"))
