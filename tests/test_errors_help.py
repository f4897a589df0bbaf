"""Errors that help: a suggestion for a mistyped value, bounds for a range, a unit for a bare size,
the --set that caused a problem, and `plan` that says (and exits non-zero) when nothing fits."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobspec.contract import EXIT_CONFIG, EXIT_NO_FIT, EXIT_OK
from jobspec.errors import SpecError
from jobspec.plan.planner import gpu_memory_bytes, plan_spec
from jobspec.spec.loader import parse_spec, suggest_value
from jobspec.spec.units import MAX_BYTES, MIN_BARE_BYTES, format_bytes, parse_size
from tests.cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
SFT = ROOT / "examples" / "sft_fast.yaml"
GiB = 1024**3

GOOD = """\
name: demo
model:
  preset: tiny
training:
  global_batch: 8
  steps: 10
hardware:
  vendor: cuda
  gpus: H100:2
"""


def problems(text: str, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.yaml", overrides)
    return str(info.value)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("preset: tiny", "preset: gpt2", "did you mean `gpt2-small`? (or gpt2-medium, gpt2-large)"),
        ("vendor: cuda", "vendor: nvidia", "did you mean `cuda`?"),
        ("vendor: cuda", "vendor: AMD", "did you mean `rocm`?"),
        ("steps: 10", "steps: 10\n  precision: BF16", "did you mean `bf16`?"),
        ("steps: 10", "steps: 10\n  precision: bfloat16", "did you mean `bf16`?"),
        ("gpus: H100:2", "gpus: H100:2\nmemory:\n  tier: deepspeed", "did you mean `zero2`?"),
        ("gpus: H100:2", "gpus: H100:2\nmemory:\n  tier: stage3", "did you mean `zero3`?"),
        ("gpus: H100:2", "gpus: H10:2", "did you mean H100?"),
        ("gpus: H100:2", "gpus: MI300:2\n  vendor: rocm", "did you mean MI300X?"),
        ("steps: 10", "steps: 10\n  optimizer: adamw_torch_fused", "did you mean `adamw`?"),  # transformers' names
        ("steps: 10", "steps: 10\n  optimizer: paged_adamw_8bit", "did you mean `adamw_8bit`?"),
        ("steps: 10", "steps: 10\n  optimizer: Adafactor", "Adafactor is not offered: torch's does not step FSDP2"),
        ("steps: 10", "steps: 10\n  objective: grpo\n  grpo: {loss_type: bnpo, rewards: [{kind: length}]}",
         "TRL's bnpo averages per micro-batch, which the planner chooses: use dapo"),
    ],
)
def test_mistyped_values_get_a_suggestion(old: str, new: str, expected: str) -> None:
    text = GOOD.replace(old, new)
    if "vendor: rocm" in new:
        text = text.replace("  vendor: cuda\n", "")
    assert expected in problems(text)


def test_no_suggestion_without_a_close_value() -> None:
    assert suggest_value("zzzz", ["cuda", "rocm", "cpu"]) == []
    assert suggest_value(True, ["on", "off"]) == []  # a bool is never compared with words
    assert "did you mean" not in problems(GOOD.replace("preset: tiny", "preset: xyzzy"))


@pytest.mark.parametrize(
    ("old", "new", "where", "hint"),
    [
        ("gpus: H100:2", "gpus: H100:0", "hardware.gpus.count", "count must be at least 1"),
        ("gpus: H100:2", "gpus: H100:65", "hardware.gpus.count", "count must be at most 64"),
        ("global_batch: 8", "global_batch: 0", "training.global_batch", "global_batch must be at least 1"),
        ("steps: 10", "steps: 10\n  learning_rate: 2", "training.learning_rate", "learning_rate must be less than 1"),
        ("steps: 10", "steps: 10\n  learning_rate: 0", "training.learning_rate", "learning_rate must be more than 0"),
        ("tiny", "tiny\ndata:\n  max_seq_len: 8", "data.max_seq_len", "max_seq_len must be at least 16"),
        ("tiny", "tiny\ndata:\n  num_workers: 65", "data.num_workers", "num_workers must be at most 64"),
        ("tiny", "tiny\n  lora: {rank: 8, targets: []}", "model.lora.targets", "targets needs at least 1 item(s)"),
        ("tiny", "tiny\ncheckpoints:\n  dir: ''", "checkpoints.dir", "dir needs at least 1 character(s)"),
    ],
)
def test_every_range_error_has_a_hint(old: str, new: str, where: str, hint: str) -> None:
    text = problems(GOOD.replace(old, new))
    assert where in text and f"hint: {hint}" in text


@pytest.mark.parametrize("field", ["hardware.memory={}", "hardware.shm_size={}", "hardware.gpus={{memory: {}}}"])
@pytest.mark.parametrize("value", ["64", "'64'", "512", "0"])
def test_a_size_without_a_unit_below_1mib_is_refused(field: str, value: str) -> None:
    text = problems(GOOD, (field.format(value),))
    number = value.strip("'")
    assert f"{number} bytes? a size without a unit counts bytes" in text
    assert "hint: write" in text and ("Gi" in text)


def test_bare_sizes_of_a_mebibyte_or_more_are_bytes() -> None:
    spec = parse_spec(GOOD + "  memory: 34359738368\n  shm_size: '1048576'\n")
    assert spec.hardware.memory == 32 * GiB and spec.hardware.shm_size == MIN_BARE_BYTES


@given(st.integers(min_value=0, max_value=MAX_BYTES))
def test_every_size_round_trips_through_its_serialised_form(n: int) -> None:
    # The ConfigMap carries format_bytes' text: the runner must read back the same size, never a bare slip.
    assert parse_size(format_bytes(n)) == n


def test_problems_a_set_causes_point_at_the_set() -> None:
    # --set hardware.gpus=H100:3 breaks global_batch 8, which the file wrote: the --set is the cause.
    text = problems(GOOD, ("hardware.gpus=H100:3",))
    assert "--set hardware.gpus=...: training.global_batch: 8 does not divide over 3 ranks" in text
    assert "spec.yaml:5" not in text
    # A section's rule (steps and epochs both set) broken by a --set.
    text = problems(GOOD, ("training.epochs=2",))
    assert "--set training.epochs=...: training: set either" in text
    # A problem the file has on its own stays at the file's line, whatever --set is given.
    text = problems(GOOD.replace("global_batch: 8", "global_batch: 7"), ("training.seed=1",))
    assert "spec.yaml:5: training.global_batch: 7 does not divide" in text and "--set" not in text


def test_set_values_are_never_echoed_when_blamed() -> None:
    text = problems(GOOD, ("hardware.gpus=H100:3", "training.seed=1"))
    assert "--set hardware.gpus=..., --set training.seed=...: training.global_batch" in text


def test_gpu_memory_flag_reads_a_bare_number_as_gib() -> None:
    assert gpu_memory_bytes("24") == 24 * GiB and gpu_memory_bytes(24) == 24 * GiB
    assert gpu_memory_bytes("24Gi") == 24 * GiB and gpu_memory_bytes("20GB") == 20 * 10**9
    report = plan_spec(parse_spec(SFT.read_text()), gpu_memory="24")
    assert report.gpu_bytes == 24 * GiB and report.gpu_label.startswith("24 GiB")


def test_plan_exits_4_when_nothing_fits() -> None:
    result = run_cli("plan", str(SFT), "--gpu-memory", "1")
    assert result.returncode == EXIT_NO_FIT == 4 and "nothing fits" in result.stdout
    assert run_cli("plan", str(SFT), "--gpu-memory", "24").returncode == EXIT_OK
    bad = run_cli("plan", str(SFT), "--gpu-memory", "-3")
    assert bad.returncode == EXIT_CONFIG and "--gpu-memory" in bad.stderr


def test_plan_notes_the_tier_that_fallback_runs_at() -> None:
    spec = parse_spec(SFT.read_text(), overrides=("memory.tier=fast",))
    report = plan_spec(spec, gpu_memory="8Gi")
    assert report.chosen is not None and not report.chosen.fits
    assert report.runs is not None and report.runs.fits and report.runs.tier != "fast"
    pinned = plan_spec(parse_spec(SFT.read_text(), overrides=("memory.tier=fast", "memory.fallback=false")), "8Gi")
    assert pinned.runs is None
