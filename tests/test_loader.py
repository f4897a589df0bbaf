"""Spec loading: every bad input is one clear, located error with exit code 2."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobspec.cli import main
from jobspec.errors import ConfigError, SpecError
from jobspec.spec.loader import apply_override, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))  # examples/families/ and examples/objectives/ too

GOOD = """\
name: demo
model:
  preset: tiny
training:
  global_batch: 8
  steps: 10
hardware:
  vendor: cpu
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_example_loads_and_plans_to_its_tier(example: Path) -> None:
    """Every example validates (a hub model's inline config.json included) and `jobspec plan` fits a tier: the one it
    names where it names one."""
    from jobspec.plan.planner import model_attention, plan_spec

    spec = load_spec(example)
    assert spec.training.global_batch % spec.world_size == 0
    model_attention(spec)  # what `jobspec validate` checks of the model beyond the spec
    # a CPU example (the quick start) has no GPU to plan against: the runner plans against host memory there
    report = plan_spec(spec, "24Gi" if spec.hardware.vendor == "cpu" else None, rows=1000)
    assert report.runs is not None, f"{example}: no tier fits"
    assert spec.memory.tier in ("auto", report.runs.tier), f"{example}: {spec.memory.tier}, plan {report.runs.tier}"


def test_generated_examples_are_what_jobspec_init_writes_now() -> None:
    """examples/families/ and examples/objectives/ carry `jobspec init`'s plan in their comments (micro-batch, GiB):
    when the memory model moves, `python tests/examples_gen.py` writes them again, and this fails until it has."""
    from tests.examples_gen import examples

    stale = [str(path.relative_to(ROOT)) for path, text in examples().items() if path.read_text() != text]
    assert not stale, f"stale examples (run `python tests/examples_gen.py`): {stale}"


def test_good_spec_and_shorthand(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD + "  shm_size: 2Gi\n"))
    assert spec.hardware.shm_size == 2 * 1024**3
    spec = parse_spec(GOOD.replace("vendor: cpu", "gpus: H100:8"))
    assert (spec.hardware.gpus.type, spec.hardware.gpus.count, spec.world_size) == ("H100", 8, 8)
    assert spec.hardware.gpus.memory_bytes == 80 * 1024**3


def test_yaml_on_off_words_are_accepted() -> None:
    spec = parse_spec(GOOD.replace("  steps: 10\n", "  steps: 10\n  gradient_checkpointing: on\n"))
    assert spec.training.gradient_checkpointing == "on"


# Each bad spec: (replace this, with this) in GOOD, the field path and line the error must name.
BAD = {
    "typo key": ("  steps: 10", "  stepz: 10", "training.stepz", 6, "did you mean `steps`"),
    "wrong type": ("global_batch: 8", "global_batch: eight", "training.global_batch", 5, None),
    "nodes zero": ("vendor: cpu", "vendor: cpu\n  nodes: 0", "hardware.nodes", 9, None),
    "bad name": ("name: demo", "name: Demo_Job", "name", 1, None),
    "long name": ("name: demo", "name: " + "a" * 51, "name", 1, None),
    "inline secret": ("vendor: cpu", "vendor: cpu\nenv:\n  HF_TOKEN: abc123", "env.HF_TOKEN", 10, "secret"),
    "token-shaped value": (
        "vendor: cpu",
        "vendor: cpu\nenv:\n  MY_VAR: hf_aaaaaaaaaaaaaaaaaaaaaaaaa",
        "env.MY_VAR",
        10,
        "secret",
    ),
    "unknown tier": ("vendor: cpu", "vendor: cpu\nmemory:\n  tier: huge", "memory.tier", 10, None),
    "vendor image mismatch": (
        "vendor: cpu",
        "vendor: rocm\nimage:\n  name: nvcr.io/nvidia/pytorch:24.01",
        "image.name",
        10,
        "vendor",
    ),
    "gpu vendor mismatch": ("vendor: cpu", "vendor: rocm\n  gpus: H100:1", "hardware.gpus.type", 9, "vendor: cuda"),
    "unknown gpu": ("vendor: cpu", "vendor: cuda\n  gpus: Z9000:1", "hardware.gpus.type", 9, "hardware.gpus.memory"),
    "batch not divisible": (
        "vendor: cpu",
        "vendor: cuda\n  gpus: 3",
        "training.global_batch",
        5,
        "multiple of 3",
    ),
    "micro batch not divisor": ("steps: 10", "steps: 10\n  micro_batch: 3", "training.micro_batch", 7, "[1, 2, 4, 8]"),
    "seq too long": ("vendor: cpu", "vendor: cpu\ndata:\n  max_seq_len: 4096", "data.max_seq_len", 10, "<= 512"),
    "missing training": ("training:\n  global_batch: 8\n  steps: 10\n", "", "training", None, "add it"),
    "unknown preset": ("preset: tiny", "preset: gpt5", "model.preset", 3, None),
    "steps and epochs": ("steps: 10", "steps: 10\n  epochs: 2", "training", 4, "either"),
    "bad size": ("vendor: cpu", "vendor: cpu\n  shm_size: lots", "hardware.shm_size", 9, None),
    "bad toleration": (
        "vendor: cpu",
        "vendor: cpu\nscheduling:\n  tolerations:\n    - key: a\n      opertor: Exists",
        "scheduling.tolerations.0.opertor",
        12,
        "operator",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD), ids=str)
def test_bad_spec_is_located(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new, field, line, hint = BAD[case]
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    issue = next((i for i in info.value.issues if i.path == field), None)
    assert issue is not None, f"no issue for {field}: {info.value}"
    if line is not None:
        assert issue.line == line, str(info.value)
    if hint:
        assert hint in f"{issue.message} {issue.hint}", str(info.value)
    # The CLI: exit 2, file:line and field in the message, no traceback.
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err and str(path) in err and "Traceback" not in err
    if line is not None:
        assert f"{path}:{line}" in err


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    text = GOOD.replace("name: demo", "name: Bad!").replace("steps: 10", "stepz: 10").replace("8", "-1")
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text))
    assert {"name", "training.stepz", "training.global_batch"} <= {i.path for i in info.value.issues}


def test_secret_value_never_echoed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    secret = "hf_" + "x" * 30
    path = write(tmp_path, GOOD + f"env:\n  HF_TOKEN: {secret}\n  OTHER: [{secret}]\n")
    assert main(["validate", str(path)]) == 2
    out = capsys.readouterr()
    assert secret not in out.err + out.out


def test_secret_given_with_set_is_never_echoed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    secret = "hf_" + "y" * 30
    assert main(["validate", str(write(tmp_path, GOOD)), "--set", f"env.HF_TOKEN={secret}"]) == 2
    out = capsys.readouterr()
    assert "env.HF_TOKEN" in out.err and secret not in out.err + out.out


def test_secret_name_check_matches_whole_words() -> None:
    spec = parse_spec(GOOD, overrides=["env.TOKENIZERS_PARALLELISM=false", "env.MAX_TOKENS=512"])
    assert spec.env == {"TOKENIZERS_PARALLELISM": "false", "MAX_TOKENS": "512"}
    for name in ("HF_TOKEN", "WANDB_API_KEY", "DB_PASSWORD", "AWS_SECRET_ACCESS_KEY", "TOKEN"):
        with pytest.raises(SpecError, match="inline secret"):
            parse_spec(GOOD, overrides=[f"env.{name}=x"])


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, GOOD + "  bad: [unclosed\n"))
    assert info.value.issues[0].line is not None and "YAML" in info.value.issues[0].message


def test_duplicate_key_is_an_error() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(GOOD + "name: again\n")
    assert info.value.issues[0].path == "name" and info.value.issues[0].line == 9


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just text"])
def test_non_mapping_root(text: str) -> None:
    with pytest.raises(SpecError, match="expected a mapping"):
        parse_spec(text)


def test_missing_file_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_spec(tmp_path / "nope.yaml")


def test_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    spec = load_spec(path, ["training.global_batch=16", "hardware.gpus=2", "scheduling.node_selector.zone=a"])
    assert spec.training.global_batch == 16 and spec.world_size == 2
    assert spec.scheduling.node_selector == {"zone": "a"}
    with pytest.raises(SpecError) as info:
        load_spec(path, ["training.global_batch=zero"])
    assert info.value.issues[0].source == "--set training.global_batch=..."
    with pytest.raises(SpecError, match=r"key\.path=value"):
        load_spec(path, ["training.global_batch"])


def test_apply_override_into_lists() -> None:
    data = {"a": [{"b": 1}]}
    assert apply_override(data, "a.0.b=2") == ("a", 0, "b") and data == {"a": [{"b": 2}]}
    with pytest.raises(ValueError, match="no list item"):
        apply_override(data, "a.5.b=1")


def test_round_trip_through_yaml() -> None:
    for example in EXAMPLES:
        spec = load_spec(example)
        again = parse_spec(yaml.safe_dump(spec.to_yaml_dict()))
        assert again == spec and again.spec_hash() == spec.spec_hash()


def _mutations() -> st.SearchStrategy[str]:
    """Mutated YAML: drop, duplicate or retype lines and values of a real spec."""
    lines = (ROOT / "examples" / "sft_fast.yaml").read_text().splitlines()
    junk = st.sampled_from(["", "0", "-1", "null", "[]", "{}", "'x'", "1e999", "::", "- a", "\t", "true", "H100:0"])

    @st.composite
    def mutate(draw: st.DrawFn) -> str:
        out = list(lines)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(out) - 1))
            op = draw(st.sampled_from(["drop", "dup", "value", "indent", "text"]))
            if op == "drop":
                out.pop(i)
            elif op == "dup":
                out.insert(i, out[i])
            elif op == "value" and ":" in out[i]:
                out[i] = out[i].split(":", 1)[0] + ": " + draw(junk)
            elif op == "indent":
                out[i] = " " * draw(st.integers(0, 5)) + out[i].lstrip()
            else:
                out[i] = draw(st.text(max_size=20))
            if not out:
                out = [""]
        return "\n".join(out)

    return mutate()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_mutations())
def test_mutated_yaml_never_tracebacks(text: str) -> None:
    try:
        parse_spec(text, "fuzz.yaml")
    except SpecError as err:
        assert err.issues and all(i.message for i in err.issues)
        assert err.exit_code == 2


def test_validate_cli_subprocess_exit_code(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("global_batch: 8", "global_batch: x"))
    result = subprocess.run([sys.executable, "-m", "jobspec", "validate", str(path)], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{path}:5: training.global_batch" in result.stderr
    debug = subprocess.run(
        [sys.executable, "-m", "jobspec", "validate", "--debug", str(path)], capture_output=True, text=True
    )
    assert "Traceback" in debug.stderr


@pytest.mark.parametrize(
    ("override", "field", "words"),
    [
        ("scheduling.tolerations=[{operator: Exists, value: x}]", "scheduling.tolerations.0", "Exists takes no"),
        ("scheduling.tolerations=[{value: x}]", "scheduling.tolerations.0", "needs a `key`"),
        ("scheduling.tolerations=[{key: a, toleration_seconds: 5}]", "scheduling.tolerations.0", "NoExecute"),
        ("scheduling.node_selector={zone: 'not ok!'}", "scheduling.node_selector.zone", "label value"),
        ("data.pvc=d", None, None),
    ],
)
def test_fields_the_api_server_would_reject(override: str, field: str | None, words: str | None) -> None:
    if field is None:  # a data PVC at the default /data is fine; on top of the checkpoints it is not
        parse_spec(GOOD, overrides=[override])
        with pytest.raises(SpecError, match=r"already the pod's mount for checkpoints\.dir"):
            parse_spec(GOOD, overrides=[override, "data.mount_path=/checkpoints"])
        return
    with pytest.raises(SpecError) as info:
        parse_spec(GOOD, overrides=[override])
    issue = next(i for i in info.value.issues if i.path == field)
    assert words in issue.message


def test_the_spec_package_is_the_public_api() -> None:
    """`from jobspec.spec import JobSpec, load_spec` is what code that builds on jobspec imports."""
    import jobspec.spec as api
    from jobspec.spec import loader, models

    assert api.JobSpec is models.JobSpec and api.load_spec is loader.load_spec and api.parse_spec is loader.parse_spec
    assert api.parse_spec("name: demo\nmodel:\n  preset: tiny\ntraining:\n  global_batch: 8\n").name == "demo"
    with pytest.raises(AttributeError):
        api.no_such_name  # noqa: B018
