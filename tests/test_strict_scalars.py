"""Strict scalars in the spec (issue 32, item 4): a boolean is never read as a number (YAML's yes/no/on/off are
booleans too), a setting given in two places is an error naming both, and hub ids meet the hub's own rules at
validate time (exit 2, the field named, the value not echoed)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from jobspec.spec.loader import SpecError, load_spec, parse_spec
from tests.cli_helpers import cli
from tests.spec_fields import dotted, leaves, spec_with, to_yaml

BOOL = "a boolean is not a number"


def _value(spec: Any, loc: tuple) -> Any:
    node = spec.model_dump()
    for step in loc:
        if isinstance(node, dict):
            node = node.get(step)
        elif isinstance(node, list):
            node = node[step] if isinstance(step, int) and step < len(node) else None
        if node is None:
            return None
    return node


@pytest.mark.parametrize("loc", [loc for loc, kind in leaves() if kind == "other"], ids=dotted)
def test_no_field_reads_a_boolean_as_a_number(loc):
    """Every non-text leaf of the spec given `true`: refused, or kept as what a boolean means (a switch, on/off),
    never turned into 1 or 1.0."""
    try:
        spec = parse_spec(to_yaml(spec_with(loc, True, "other")))
    except SpecError:
        return
    value = _value(spec, loc)
    assert isinstance(value, bool) or not isinstance(value, int | float), f"{dotted(loc)}: true read as {value!r}"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("training: {global_batch: 8, steps: true}", "training.steps"),
        ("training: {global_batch: yes, steps: 10}", "training.global_batch"),
        ("training: {global_batch: 8, steps: 10, learning_rate: on}", "training.learning_rate"),
        ("training: {global_batch: 8, steps: 10, warmup_steps: off}", "training.warmup_steps"),
        ("training: {global_batch: 8, steps: 10, micro_batch: no}", "training.micro_batch"),
        ("training: {global_batch: 8, steps: 10}\ndata: {sources: [{path: /a.jsonl, weight: true}]}",
         "data.sources.0.weight"),
        ("training: {global_batch: 8, steps: 10}\nhardware: {vendor: cpu, supplemental_groups: [44, yes]}",
         "hardware.supplemental_groups"),
    ],
)
def test_yaml_booleans_in_number_fields_exit_2_naming_the_field(tmp_path, text, field):
    path = tmp_path / "spec.yaml"
    hardware = "" if "hardware:" in text else "hardware: {vendor: cpu}\n"
    path.write_text("name: demo\nmodel: {preset: tiny}\n" + hardware + text + "\n")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert f"{field}: {BOOL}" in str(err.value), str(err.value)
    code, out = cli("validate", str(path))
    assert code == 2 and field in out and "Traceback" not in out


def test_switches_still_take_booleans():
    spec = parse_spec(yaml.safe_dump({"name": "demo", "model": {"preset": "tiny"}, "hardware": {"vendor": "cpu"},
                                      "training": {"global_batch": 8, "steps": 10},
                                      "data": {"packing": False, "streaming": False}}))  # fmt: skip
    assert spec.data.packing is False


BASE = "name: demo\nhardware: {vendor: cpu}\ntraining: {global_batch: 8, steps: 10}\n"


@pytest.mark.parametrize("env", [
    "env: {HUGGING_FACE_HUB_TOKEN: {secret: other, key: token}}\n",  # the hub client's older name
    "env: {HF_TOKEN: {secret: other, key: token}}\n",
])  # fmt: skip
def test_a_second_hub_token_under_either_name_is_an_error_naming_both(tmp_path, env):
    path = tmp_path / "spec.yaml"
    path.write_text(BASE + "model: {path: org/name, hub_token: {secret: hf, key: token}}\n" + env)
    code, out = cli("validate", str(path))
    name = env.split("{", 1)[1].split(":", 1)[0]
    assert code == 2 and "model.hub_token" in out and f"env.{name}" in out, out
    path.write_text(BASE + "model: {path: org/name}\nenv: {HF_TOKEN: {secret: a, key: t}, HUGGING_FACE_HUB_TOKEN: "
                    "{secret: b, key: t}}\n")  # fmt: skip
    code, out = cli("validate", str(path))
    assert code == 2 and "env.HF_TOKEN" in out and "env.HUGGING_FACE_HUB_TOKEN" in out, out


@pytest.mark.parametrize("key", ["../../etc/shadow", "a/b", "..data", "."])
def test_a_secret_key_is_a_kubernetes_key_never_a_path(tmp_path, key):
    """gcs_credentials.key names the mounted file too: `../../etc/shadow` passed validate."""
    path = tmp_path / "spec.yaml"
    path.write_text(BASE + "model: {preset: tiny}\ncheckpoints: {dir: 'gs://bucket/runs'}\n"
                    f"gcs_credentials: {{secret: gcp, key: '{key}'}}\n")  # fmt: skip
    code, out = cli("validate", str(path))
    assert code == 2 and "gcs_credentials.key: a Secret's key is letters" in out, out
    path.write_text(path.read_text().replace(f"'{key}'", "key.json"))
    assert cli("validate", str(path))[0] == 0


def test_hub_token_given_twice_is_an_error_naming_both(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(BASE + "model: {path: org/name, hub_token: {secret: hf, key: token}}\n"
                    "env: {HF_TOKEN: {secret: other, key: token}}\n")  # fmt: skip
    code, out = cli("validate", str(path))
    assert code == 2 and "model.hub_token" in out and "env.HF_TOKEN" in out, out
    path.write_text(BASE + "model: {path: org/name, hub_token: {secret: hf, key: token}}\n")
    assert cli("validate", str(path))[0] == 0


@pytest.mark.parametrize(
    ("model", "data", "field"),
    [("org/..", None, "model.path"), ("org/name--x", None, "model.path"), ("o/" + "n" * 97, None, "model.path"),
     ("org/name", "org/data..x", "data.path"), ("org/name", "org/-data", "data.path")],
)  # fmt: skip
def test_hub_ids_are_checked_by_the_hubs_own_rules_at_validate_time(tmp_path, model, data, field):
    path = tmp_path / "spec.yaml"
    path.write_text(BASE + f"model: {{path: '{model}'}}\n" + (f"data: {{path: '{data}'}}\n" if data else ""))
    code, out = cli("validate", str(path))
    assert code == 2 and f"{field}: is not a Hugging Face repository id" in out and "Traceback" not in out, out
    assert (model if field == "model.path" else data) not in out.split(field, 1)[1].splitlines()[0]  # not echoed


def test_valid_hub_ids_and_local_paths_pass(tmp_path):
    path = tmp_path / "spec.yaml"
    for model, data in (("gpt2", "org/data"), ("org/name.v2", "/data/train.jsonl"), ("./models/a--b", "./d--x")):
        path.write_text(BASE + f"model: {{path: '{model}'}}\ndata: {{path: '{data}'}}\n")
        code, out = cli("validate", str(path))
        assert code == 0, (model, data, out)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("data: {packing: 1}", "data.packing"),
        ("output: {export: 0}", "output.export"),
        ("memory: {fallback: 0}", "memory.fallback"),
        ("data: {streaming: 'off'}", "data.streaming"),
        ("output: {merge_lora: 'yes'}", "output.merge_lora"),
        ("data: {packing: 1.0}", "data.packing"),
    ],
)
def test_a_number_or_a_string_is_not_a_switch(tmp_path, text, field):
    """pydantic's lax mode read 1/0 and 'off'/'yes' as booleans: `output.export: 0` silently skipped the export."""
    path = tmp_path / "spec.yaml"
    path.write_text(BASE + "model: {preset: tiny}\n" + text + "\n")
    code, out = cli("validate", str(path))
    assert code == 2 and f"{field}: is a switch: write true or false" in out and "Traceback" not in out, out


def test_every_switch_refuses_a_number_and_takes_a_boolean():
    switches = [loc for loc, kind in leaves() if kind == "other" and _is_switch(loc)]
    assert len(switches) >= 5
    for loc in switches:
        with pytest.raises(SpecError) as err:
            parse_spec(to_yaml(spec_with(loc, 1, "other")))
        assert dotted(loc) in str(err.value), str(err.value)  # refused at the switch (a secret's, unshown)


def _is_switch(loc: tuple) -> bool:
    from jobspec.spec import models

    model: Any = models.JobSpec
    for step in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(step)
        if field is None:
            return False
        kinds = [k for k in models.annotation_types(field.annotation)
                 if isinstance(k, type) and issubclass(k, BaseModel)]  # fmt: skip
        if not kinds:
            return False
        model = kinds[0]
    field = getattr(model, "model_fields", {}).get(loc[-1])
    return field is not None and models._switch(field.annotation)
