"""The JSON Schema editors use: shipped as a file, equal to the models', and true to the loader.

Every spelling the loader accepts must be valid in the schema (an editor must not flag `gpus: H100:8`),
and every spec the project shows (examples/, the README and the docs pages) must validate against it.

    python tests/test_schema.py      # regenerate jobspec/schema/jobspec.schema.json
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from jobspec.spec.loader import parse_spec
from jobspec.spec.reference import SCHEMA_FILE, json_schema_text

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))  # examples/families/ and examples/objectives/ too
SCHEMA_COMMENT = "# yaml-language-server: $schema=../jobspec/schema/jobspec.schema.json"  # from examples/


def _shown_specs() -> list[tuple[str, str]]:
    """(page, spec) for every whole spec (a YAML block with a top-level `name:`) of the README and docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    blocks = [(page, b) for page in pages for b in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)]
    return [(str(page.relative_to(ROOT)), b) for page, b in blocks if re.search(r"^name:", b, re.M)]


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _errors(validator: jsonschema.protocols.Validator, data: Any) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(data)]


def test_shipped_schema_is_the_generated_one() -> None:
    assert SCHEMA_FILE.read_text() == json_schema_text(), (
        "jobspec/schema/jobspec.schema.json is stale: run `python tests/test_schema.py` to regenerate it"
    )


def test_schema_ships_as_package_data() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^jobspec = \[[^\]]*"schema/\*\.json"', pyproject, re.M)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_examples_validate_and_name_the_schema(path: Path, validator: jsonschema.protocols.Validator) -> None:
    text = path.read_text()
    up = "../" * (len(path.relative_to(ROOT / "examples").parts) - 1)  # examples/families/x.yaml: one more level
    comment = SCHEMA_COMMENT.replace("$schema=", f"$schema={up}")
    assert text.splitlines()[0] == comment
    assert (path.parent / comment.partition("$schema=")[2]).resolve() == SCHEMA_FILE.resolve()
    assert _errors(validator, yaml.safe_load(text)) == []


def test_specs_in_the_docs_validate(validator: jsonschema.protocols.Validator) -> None:
    specs = _shown_specs()
    assert len(specs) >= 5, "the docs show no specs"
    for page, text in specs:
        parse_spec(text)  # the loader accepts it too
        assert _errors(validator, yaml.safe_load(text)) == [], page


BASE = yaml.safe_load((ROOT / "examples" / "sft_fast.yaml").read_text())


def _with(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return data


# Shorthand the loader accepts: each must load, and validate against the schema.
ACCEPTED = [
    ("hardware.gpus", "H100:8"),
    ("hardware.gpus", 2),
    ("hardware.gpus", "2"),
    ("hardware.gpus", "RTX3080-20GB"),
    ("hardware.gpus", {"type": "RTX3080-20GB", "count": 2}),
    ("hardware.gpus", {"count": 2, "memory": "20GB"}),
    ("hardware.memory", "64Gi"),
    ("hardware.memory", "20GB"),
    ("hardware.memory", "1.5Ti"),
    ("hardware.memory", 34359738368),
    ("hardware.memory", "34359738368"),
    ("hardware.shm_size", "512Mi"),
    ("hardware.cpu", "500m"),
    ("hardware.cpu", 8),
    ("training.gradient_checkpointing", True),  # YAML 1.1: a bare `on`
    ("training.gradient_checkpointing", "off"),
    ("tracking.tensorboard", True),
    ("tracking.tensorboard", {"logdir": "/tb"}),
    ("tracking.mlflow", True),
    ("env.OMP_NUM_THREADS", 8),
    ("env.DEBUG", False),
    ("output.max_shard_size", "5GB"),
]


@pytest.mark.parametrize(("path", "value"), ACCEPTED, ids=lambda v: str(v))
def test_shorthand_the_loader_accepts_is_valid(
    path: str, value: Any, validator: jsonschema.protocols.Validator
) -> None:
    data = _with(path, value)
    parse_spec(yaml.safe_dump(data))
    assert _errors(validator, data) == []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("hardware.memory", 64),  # 64 bytes: refused by the loader, flagged by the schema
        ("hardware.memory", "64 lots"),
        ("hardware.vendor", "nvidia"),
        ("hardware.gpus", 0),
        ("training.gradient_checkpointing", "sometimes"),
        ("training.typo", 1),
        ("name", "Not_A_Label"),
    ],
    ids=lambda v: str(v),
)
def test_schema_flags_what_the_loader_refuses(
    path: str, value: Any, validator: jsonschema.protocols.Validator
) -> None:
    assert _errors(validator, _with(path, value))


if __name__ == "__main__":  # regenerate the shipped schema
    SCHEMA_FILE.write_text(json_schema_text())
