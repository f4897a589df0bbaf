"""`jobspec validate` reports every problem in one pass: the field errors and, beside them, the rules that
span fields (jobspec/spec/rules.py) and sections (steps with epochs), each at its line with a fix.

A rule whose own inputs did not validate is skipped, never judged on a default: `vendor: nvidia` beside
`gpus: MI300X:8` is one problem (the vendor), not two.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from jobspec.errors import SpecError
from jobspec.spec.loader import parse_spec
from jobspec.spec.models import JobSpec, annotation_types
from tests.cli_helpers import cli, run_cli
from tests.test_errors_help import GOOD  # a valid spec for one cuda node of 2 x H100


def validate(tmp_path: Path, text: str, *overrides: str) -> tuple[int, str]:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    argv = ["validate", str(path)]
    for item in overrides:
        argv += ["--set", item]
    code, out = cli(*argv)
    return code, out.replace(str(path), "spec.yaml")


def test_field_errors_and_cross_field_rules_in_one_run(tmp_path: Path) -> None:
    text = GOOD.replace("global_batch: 8", "global_batch: 7\n  learning_rate: -1").replace("H100:2", "H10:8")
    result = run_cli("validate", str(_write(tmp_path, text)))  # the real entry point: exit code and stderr
    assert result.returncode == 2 and "Traceback" not in result.stderr
    out = result.stderr.replace(str(tmp_path / "spec.yaml"), "spec.yaml")
    assert "3 problems in the job spec" in out
    assert "spec.yaml:5: training.global_batch: 7 does not divide over 8 ranks" in out
    assert "spec.yaml:6: training.learning_rate: Input should be greater than 0" in out
    assert "spec.yaml:10: hardware.gpus.type: unknown GPU type 'H10'" in out
    assert out.count("hint: ") == 3 and "did you mean H100?" in out and "use a multiple of 8" in out


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_a_section_rule_beside_a_field_error(tmp_path: Path) -> None:
    code, out = validate(tmp_path, GOOD.replace("steps: 10", "steps: 10\n  epochs: 2\n  warmup_steps: -1"))
    assert code == 2
    assert "spec.yaml:4: training: set either `training.steps` or `training.epochs`, not both" in out
    assert "spec.yaml:8: training.warmup_steps: Input should be greater than or equal to 0" in out


def test_an_unknown_key_hides_no_rule(tmp_path: Path) -> None:
    text = GOOD.replace("steps: 10", "steps: 10\n  epochs: 2\n  lr: 0.1").replace("H100:2", "H100:3") + "typo: 1\n"
    code, out = validate(tmp_path, text)
    assert code == 2
    assert "spec.yaml:8: training.lr: unknown field 'lr'" in out and "spec.yaml:12: typo: unknown field" in out
    assert "spec.yaml:4: training: set either `training.steps` or `training.epochs`, not both" in out
    assert "spec.yaml:5: training.global_batch: 8 does not divide over 3 ranks" in out


def test_every_rule_beside_errors_in_other_sections(tmp_path: Path) -> None:
    text = GOOD.replace("preset: tiny", "preset: tiny\n  lora: {rank: 0}") + (
        "  memory: 40000m\n"
        "data:\n  max_seq_len: 4096\n  num_workers: 99\n"
        "image:\n  name: rocm/pytorch:latest\n  pull_policy: Sometimes\n"
        "scheduling:\n  labels: {'bad key!': x}\n  node_selector: {zone: [1]}\n"
        "env:\n  A: [1]\n  HF_TOKEN: hf_abcdefghijklmnopqrstuvwxyz123456\n"
    )
    code, out = validate(tmp_path, text)
    assert code == 2 and "Traceback" not in out
    expected = [
        "spec.yaml:4: model.lora.rank",
        "spec.yaml:11: hardware.memory: '40000m' was read as 40000 milli-bytes",
        "spec.yaml:13: data.max_seq_len: 4096 exceeds model preset 'tiny'",
        "spec.yaml:14: data.num_workers",
        "spec.yaml:16: image.name: image 'rocm/pytorch:latest' does not match hardware.vendor 'cuda'",
        "spec.yaml:17: image.pull_policy",
        "spec.yaml:19: scheduling.labels.bad key!: not a valid Kubernetes key",
        "spec.yaml:20: scheduling.node_selector.zone",
        "spec.yaml:22: env.A",
        "spec.yaml:23: env.HF_TOKEN: inline secret value (token)",  # the map's own validator, beside env.A
    ]
    for line in expected:
        assert line in out, line
    assert "hf_abcdef" not in out


@pytest.mark.parametrize(
    ("change", "reported", "not_reported"),
    [
        # count 0 is the problem: no rule divides the batch by it, or calls the type unknown without it
        (("H100:2", "H100:0"), "hardware.gpus.count", ["does not divide", "ranks"]),
        # an unknown vendor: the GPU type is not judged against a vendor that was never set
        (("vendor: cuda", "vendor: nvidia"), "hardware.vendor", ["is a cuda GPU", "vendor cpu"]),
        # a global batch that is not a number is not divided either
        (("global_batch: 8", "global_batch: lots"), "training.global_batch", ["does not divide"]),
        # a missing section is one problem: the rules that read it wait for it
        (("training:\n  global_batch: 8\n  steps: 10\n", ""), "training: required field is missing", ["divide"]),
    ],
)
def test_a_rule_whose_inputs_did_not_validate_is_skipped(
    tmp_path: Path, change: tuple[str, str], reported: str, not_reported: list[str]
) -> None:
    text = GOOD.replace("H100:2", "MI300X:8") if "nvidia" in change[1] else GOOD
    code, out = validate(tmp_path, text.replace(*change) + "  memory: 1e3\n")
    assert code == 2 and reported in out and "hardware.memory: '1e3' is 1000 bytes?" in out, out
    assert not [words for words in not_reported if words in out], out


def test_a_file_problem_stays_at_its_line_beside_a_set_problem(tmp_path: Path) -> None:
    code, out = validate(tmp_path, GOOD.replace("global_batch: 8", "global_batch: 7"), "training.learning_rate=-1")
    assert code == 2
    assert "spec.yaml:5: training.global_batch: 7 does not divide over 2 ranks" in out
    assert "--set training.learning_rate=...: training.learning_rate" in out
    # and a rule broken by the --set is blamed on it, beside a field error in the file
    code, out = validate(tmp_path, GOOD.replace("steps: 10", "steps: 0"), "hardware.gpus=H100:3")
    assert "--set hardware.gpus=...: training.global_batch: 8 does not divide over 3 ranks" in out
    assert "spec.yaml:6: training.steps" in out


def test_a_valid_spec_still_validates(tmp_path: Path) -> None:
    code, out = validate(tmp_path, GOOD)
    assert code == 0 and "spec.yaml: ok (demo: 2 rank(s), tier auto)" in out


# --- the property: one pass finds what fixing and validating again would --------------------------

# (--set item, the path it breaks): field errors, cross-field rules and a section's rule, independent.
BREAKAGES = [
    ("training.learning_rate=-1", "training.learning_rate"),
    ("data.num_workers=65", "data.num_workers"),
    ("checkpoints.keep=0", "checkpoints.keep"),
    ("model.lora={rank: 0}", "model.lora.rank"),
    ("scheduling.backoff_limit=101", "scheduling.backoff_limit"),
    ("hardware.shm_size=64", "hardware.shm_size"),
    ("training.global_batch=7", "training.global_batch"),
    ("hardware.gpus=H10:2", "hardware.gpus.type"),
    ("image.name=rocm/pytorch", "image.name"),
    ("data.max_seq_len=4096", "data.max_seq_len"),
    ("scheduling.labels={'bad key!': x}", "scheduling.labels.bad key!"),
    ("training.epochs=2", "training"),
    ("env.API_TOKEN=hunter2", "env.API_TOKEN"),
]


@settings(max_examples=60, deadline=None)
@given(st.sets(st.sampled_from(BREAKAGES), min_size=1))
def test_one_pass_reports_every_independent_problem(broken: set[tuple[str, str]]) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(GOOD, "spec.yaml", tuple(item for item, _ in sorted(broken)))
    assert {issue.path for issue in info.value.issues} == {path for _, path in broken}, str(info.value)
    assert all(issue.source for issue in info.value.issues)  # each named by its --set, never by a file line


def test_problems_are_listed_by_line(tmp_path: Path) -> None:
    text = GOOD.replace("steps: 10", "steps: 10\n  learning_rate: 5").replace("H100:2", "H10:3")
    code, out = validate(tmp_path, text)
    lines = [int(n) for n in re.findall(r"spec\.yaml:(\d+):", out)]
    assert code == 2 and len(lines) == 3 and lines == sorted(lines), out


def test_a_map_with_a_bad_key_and_a_bad_value_still_checks_its_good_items(tmp_path: Path) -> None:
    code, out = validate(tmp_path, GOOD + "env:\n  1: x\n  A: [1]\n  B-C: x\n")
    assert code == 2 and "Traceback" not in out
    assert "env.1.[key]: Input should be a valid string" in out
    assert "spec.yaml:13: env.B-C: not a valid variable name" in out  # the map's own rule, on its good items


# --- any value anywhere: the second reading never crashes -----------------------------------------


def _paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every field path of the spec's models (sections and their fields)."""
    out = []
    for name, field in model.model_fields.items():
        out.append((*prefix, name))
        inner = [a for a in annotation_types(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if inner and len(prefix) < 3:
            out += _paths(inner[0], (*prefix, name))
    return out



PATHS = _paths(JobSpec)
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 2**64)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["H10:8", "H100:0", "1e3", "40000m", "auto", "hf_abcdefghijklmnopqrstuvwxyz123456"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | st.integers(0, 3), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=4))
def test_any_value_in_any_field_gives_located_problems_never_a_crash(
    changes: list[tuple[tuple[str, ...], object]],
) -> None:
    data = yaml.safe_load(GOOD)
    for path, value in changes:
        node = data
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = value
    try:
        parse_spec(yaml.safe_dump(data), "spec.yaml")
    except SpecError as err:
        assert err.issues and all(issue.message and issue.line for issue in err.issues if issue.path), str(err)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("hardware.vendor=cpu", "hardware.gpus=null"), "flash_attention_2 needs a GPU and hardware.vendor is cpu"),
        (("training.precision=fp32",), "flash_attention_2 runs in bf16/fp16 only"),
    ],
)
def test_flash_attention_where_it_cannot_run_is_refused_at_validate(
    tmp_path: Path, overrides: tuple[str, ...], expected: str
) -> None:
    code, out = validate(tmp_path, GOOD + "  # flash\n", "model.attention=flash_attention_2", *overrides)
    assert code == 2 and expected in out and "model.attention" in out, out


def test_flash_attention_on_a_gpu_spec_validates(tmp_path: Path) -> None:
    code, out = validate(tmp_path, GOOD, "model.attention=flash_attention_2")
    assert code == 0, out
