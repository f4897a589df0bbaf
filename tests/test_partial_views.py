"""A spec that fails validation is read again field by field (jobspec/spec/partial.py) so that every problem shows
at once: the rules pydantic skipped run on a partial view. Whatever the section and whatever its other fields, a
bad field must come back as the spec's own error (exit 2), never a traceback from a rule running on that view.
Before, `data.streaming: true` beside any bad `data.*` field (a typo included) raised AttributeError
(`__pydantic_fields_set__`) in validate, render and run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jobspec.errors import SpecError
from jobspec.spec.loader import parse_spec
from jobspec.spec.models import JobSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))


def _sections(doc: dict) -> list[str]:
    """The sections of `doc` that are models (extra keys forbidden), not free-form maps such as `env`."""
    models = {name for name, field in JobSpec.model_fields.items() if "Spec" in repr(field.annotation)}
    return [name for name, value in doc.items() if isinstance(value, dict) and name in models]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_a_typo_in_any_section_of_any_example_is_the_specs_own_error(example):
    doc = yaml.safe_load(example.read_text())
    variants = []
    for section in _sections(doc):
        variants.append({**doc, section: {**doc[section], "typo_field": 1}})
        if section == "data":  # the reported case: a streaming data section with a bad field
            variants.append({**doc, "data": {**doc["data"], "streaming": True, "max_seq_lenn": 12}})
            variants.append({**doc, "data": {**doc["data"], "streaming": True, "eval_fraction": "x"}})
    assert variants
    for variant in variants:
        with pytest.raises(SpecError) as info:
            parse_spec(yaml.safe_dump(variant), str(example))
        assert "typo_field" in str(info.value) or "max_seq_lenn" in str(info.value) or "eval_fraction" in str(
            info.value)
