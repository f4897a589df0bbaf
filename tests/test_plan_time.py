"""Time and cost in `jobspec plan`: FLOPs per token, step time per tier, the job's duration, GPU types."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jobspec.catalog import gpus
from jobspec.catalog.presets import PRESETS
from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.plan import throughput
from jobspec.plan.compare import compare, parse_prices
from jobspec.plan.job_length import count_rows, job_length
from jobspec.plan.memory import LoraShape, trainable_params
from jobspec.plan.output import plan_table
from jobspec.plan.planner import plan_spec
from jobspec.spec.loader import parse_spec
from tests.cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
MULTINODE = ROOT / "examples" / "multinode.yaml"  # llama-1b, 2 x 8 H100, steps 10000, seq 2048, batch 256
SFT = ROOT / "examples" / "sft_fast.yaml"  # gpt2-medium, 2 x RTX3080-20GB, 3 epochs of data not here


def test_flops_per_token_is_6n_plus_attention() -> None:
    gpt2 = PRESETS["gpt2-small"]
    n = gpt2.params - gpt2.max_positions * gpt2.hidden  # tied head: the token table is the head's matmul
    assert throughput.matmul_params(gpt2) == n
    f = throughput.flops_per_token(gpt2, 1024, lora=None, checkpointing=False)
    assert f.model == 6 * n + 6 * 12 * 768 * 1024 and f.recompute == 0
    ckpt = throughput.flops_per_token(gpt2, 1024, lora=None, checkpointing=True)
    assert ckpt.recompute == 2 * n + 2 * 12 * 768 * 1024 and ckpt.total == pytest.approx(f.model * 4 / 3)
    untied = PRESETS["qwen-1.8b"]  # the input table is a lookup, the untied head a matmul
    assert throughput.matmul_params(untied) == untied.params - untied.vocab * untied.hidden


def test_lora_flops_skip_the_base_weight_gradients() -> None:
    shape, lora = PRESETS["qwen-0.5b"], LoraShape(16, ("q_proj", "v_proj"))
    n, adapters, attention = throughput.matmul_params(shape), trainable_params(shape, lora), 24 * 896 * 2048
    f = throughput.flops_per_token(shape, 2048, lora=lora, checkpointing=False)
    assert f.model == 4 * n + 6 * adapters + 6 * attention


def test_step_time_is_tokens_times_flops_over_peak_and_efficiency() -> None:
    flops = throughput.Flops(model=6e9, recompute=2e9)
    t = throughput.step_time(flops, tier="zero3", tokens_per_step=1000, world_size=4, peak_tflops=100, steps=50)
    assert t.efficiency == throughput.EFFICIENCY["zero3"]
    assert t.step_seconds == pytest.approx(1000 * 8e9 / (4 * 100e12 * 0.35))
    assert t.tokens_per_second == pytest.approx(1000 / t.step_seconds)
    assert t.mfu == pytest.approx(0.35 * 6 / 8)  # recomputation is not model work
    assert t.total_seconds == pytest.approx(50 * t.step_seconds)


def test_every_catalogue_gpu_has_a_peak() -> None:
    for info in gpus.catalogue():
        assert info.tflops16 and 10 < info.tflops16 < 5000, info.name
    assert gpus.lookup("H100").tflops16 == 989.0 and gpus.lookup("A100").tflops16 == 312.0
    assert gpus.lookup("MI300X").tflops16 == 1307.4 and gpus.lookup("RTX3080").tflops16 == 59.5


def test_plan_prints_a_duration_per_tier() -> None:
    result = run_cli("plan", str(MULTINODE))
    assert result.returncode == EXIT_OK, result.stderr
    lines = result.stdout.splitlines()
    header = lines[2].split()
    assert header[:11] == ["tier", "GiB/GPU", "host", "GiB", "fits", "micro", "accum", "ckpt", "step", "tok/s", "MFU"]
    rows = [line for line in lines[3:8]]
    assert [r.split()[0] for r in rows] == ["fast", "zero2", "zero2_offload", "zero3", "minimal"]
    for row in rows:
        assert any(unit in row for unit in (" min ", " h ", " d ", " s ")), row
    assert "6N + 6·L·h·s" in result.stdout and "assumed share of peak: fast 40%" in result.stdout
    assert "job: training.steps 10,000" in result.stdout


def test_plan_json_carries_the_same_numbers() -> None:
    report = json.loads(run_cli("plan", str(MULTINODE), "-o", "json").stdout)
    spec = parse_spec(MULTINODE.read_text())
    assert report["steps"] == 10_000 and report["tokens_per_step"] == 256 * 2048
    assert report["peak_tflops"] == 989.0 and report["assumptions"]["efficiency"]["fast"] == 0.4
    fast = report["tiers"][0]
    flops = throughput.flops_per_token(PRESETS["llama-1b"], 2048, lora=None, checkpointing=False)
    step = 256 * 2048 * flops.total / (spec.world_size * 989e12 * 0.4)
    assert fast["step_seconds"] == pytest.approx(step)
    assert fast["duration_seconds"] == pytest.approx(10_000 * step)
    assert fast["tokens_per_second"] == pytest.approx(256 * 2048 / step)
    table = plan_table(plan_spec(spec))
    assert throughput.format_duration(fast["duration_seconds"]) in table.splitlines()[3]


def test_epochs_need_rows_counted_as_the_runner_counts_them(tmp_path: Path) -> None:
    spec = parse_spec(SFT.read_text())
    unknown = job_length(spec)
    assert unknown.steps is None and "--rows" in unknown.how
    # 20,000 rows, 5 % held out, batch 32: 593 steps per epoch (last partial batch dropped), 3 epochs.
    assert job_length(spec, rows=20_000).steps == 3 * (19_000 // 32)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n' * 1000 + "\n")
    local = parse_spec(SFT.read_text(), overrides=(f"data.path={data}", "data.pvc=null", "training.epochs=1.5"))
    assert count_rows(local) == (1000, f"data.path {data}")
    assert job_length(local).steps == math.ceil(1.5 * (950 // 32))
    report = plan_spec(local)
    assert report.times["fast"].total_seconds == pytest.approx(report.times["fast"].step_seconds * 44)


def test_the_bundled_set_is_counted() -> None:
    quick = parse_spec((ROOT / "examples" / "quickstart.yaml").read_text(), overrides=("training.steps=null",))
    rows, where = count_rows(quick)
    assert where == "the bundled set" and rows and rows > 100


def test_compare_gpu_types_fastest_first_with_cost() -> None:
    spec = parse_spec(SFT.read_text())
    prices = parse_prices(["H100=2.49,a100-80gb=1.79", "RTX3080-20GB=0.30"])
    assert prices == {"H100": 2.49, "A100-80GB": 1.79, "RTX3080-20GB": 0.30}
    reports = compare(spec, gpus.catalogue(), prices, rows=20_000)
    assert {r.gpu.name for r in reports if r.gpu} == set(gpus.known_names())
    steps = [r.times[r.runs.tier].step_seconds for r in reports if r.runs]
    assert steps == sorted(steps)
    h100 = next(r for r in reports if r.gpu and r.gpu.name == "H100")
    assert h100.runs is not None
    hours = h100.times[h100.runs.tier].total_seconds / 3600
    assert h100.cost == pytest.approx(hours * spec.world_size * 2.49)


def test_plan_gpus_any_on_the_command_line() -> None:
    result = run_cli("plan", str(SFT), "--gpus", "any", "--rows", "20000", "--price", "H100=2.49")
    assert result.returncode == EXIT_OK, result.stderr
    for name in gpus.known_names():
        assert any(line.startswith(name + " ") for line in result.stdout.splitlines()), name
    spec_row = next(line for line in result.stdout.splitlines() if line.startswith("RTX3080-20GB "))
    assert "<- spec" in spec_row
    out = json.loads(run_cli("plan", str(SFT), "--gpus", "H100,L4", "-o", "json", "--rows", "20000").stdout)
    assert [g["gpu"] for g in out["gpus"]] == ["H100", "L4"] and out["gpus"][0]["duration_seconds"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--price", "H10=2"], "did you mean H100?"),
        (["--price", "H100=lots"], "expected a price per GPU-hour"),
        (["--gpus", "A6000"], "is not in the GPU catalogue"),
        (["--gpus", "any", "--gpu-memory", "24Gi"], "cannot be combined"),
        (["--rows", "0"], "--rows 0"),
    ],
)
def test_plan_flags_are_checked(args: list[str], message: str) -> None:
    result = run_cli("plan", str(SFT), *args)
    assert result.returncode == EXIT_CONFIG and message in result.stderr and "Traceback" not in result.stderr
