"""The CLI as users call it: help, schema, plan, and what it must never import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobspec.cli import main
from jobspec.plan.planner import plan_spec, shape_from_config
from jobspec.spec.loader import load_spec
from tests.cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
SFT = str(ROOT / "examples" / "sft_fast.yaml")
GiB = 1024**3


@pytest.mark.parametrize("command", ["validate", "render", "schema", "plan", "run"])
def test_every_subcommand_has_useful_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"jobspec {command}" in out and len(out.splitlines()) > 4


def test_top_level_help_lists_commands_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for word in ("validate", "render", "plan", "run", "exit codes"):
        assert word in out


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: jobspec" in capsys.readouterr().out


def test_schema_is_json_schema_with_descriptions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["additionalProperties"] is False and "training" in schema["required"]
    training = schema["$defs"]["TrainingSpec"]["properties"]
    assert all(prop.get("description") for prop in training.values())


@pytest.mark.parametrize("command", ["render", "plan", "validate"])
def test_submitter_commands_never_import_torch(command: str) -> None:
    code = (
        "import sys, io, contextlib\n"
        "from jobspec.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rc = main([{command!r}, {SFT!r}])\n"
        "heavy = sorted(m for m in ('torch', 'accelerate', 'transformers', 'kubernetes') if m in sys.modules)\n"
        "print(rc, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0 []"


def test_plan_table_marks_auto_choice() -> None:
    result = run_cli("plan", SFT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "RTX3080-20GB" in lines[0] and "355M params" in lines[0]
    chosen = [line for line in lines if "<- auto" in line]
    assert len(chosen) == 1 and chosen[0].split()[0] == "fast"


def test_plan_json_matches_memory_model() -> None:
    result = run_cli("plan", SFT, "-o", "json", "--gpu-memory", "8Gi")
    report = json.loads(result.stdout)
    assert report["gpu_bytes"] == 8 * GiB and report["tiers"][0]["tier"] == "fast"
    direct = plan_spec(load_spec(SFT), gpu_memory="8Gi")
    assert report["tier"] == (direct.chosen.tier if direct.chosen else None)
    for row in report["tiers"]:
        if row["fits"]:
            assert row["micro_batch"] * row["grad_accum"] * report["world_size"] == report["global_batch"]


def test_plan_without_gpu_memory_is_a_clear_error() -> None:
    result = run_cli("plan", str(ROOT / "examples" / "quickstart.yaml"))
    assert result.returncode == 2 and "--gpu-memory" in result.stderr and "Traceback" not in result.stderr
    bad = run_cli("plan", SFT, "--gpu-memory", "lots")
    assert bad.returncode == 2 and "--gpu-memory" in bad.stderr


def test_plan_picks_a_cheaper_tier_on_a_smaller_card() -> None:
    big = plan_spec(load_spec(SFT), gpu_memory="80Gi").chosen
    small = plan_spec(load_spec(SFT), gpu_memory="8Gi").chosen
    assert big is not None and small is not None and big.tier == "fast" and small.tier != "fast"


def test_shape_from_hf_configs() -> None:
    gpt2 = shape_from_config({"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024})
    assert gpt2.params == 124_439_808
    llama = shape_from_config(
        {
            "num_hidden_layers": 2,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "intermediate_size": 352,
        }
    )
    assert llama.family == "llama" and llama.kv_heads == 2


def test_render_pipes_and_reports_bad_spec(tmp_path: Path) -> None:
    result = run_cli("render", SFT)
    assert result.returncode == 0 and result.stdout.count("\n---\n") >= 2 and "kind: Job" in result.stdout
    as_json = json.loads(run_cli("render", SFT, "-o", "json").stdout)
    kinds = [o["kind"] for o in as_json["items"]]
    assert as_json["kind"] == "List" and kinds == ["ConfigMap", "Service", "NetworkPolicy", "Job"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {preset: tiny}\ntraining: {global_batch: 0}\n")
    result = run_cli("render", str(bad))
    assert result.returncode == 2 and f"{bad}:3: training.global_batch" in result.stderr


def test_set_override_reaches_the_render() -> None:
    result = run_cli("render", SFT, "--set", "hardware.nodes=2", "-o", "json")
    job = json.loads(result.stdout)["items"][-1]
    assert job["spec"]["completions"] == 2 and job["spec"]["parallelism"] == 2


def test_debug_before_the_subcommand_shows_the_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    result = run_cli("--debug", "validate", str(bad))
    assert result.returncode != 0 and "Traceback" in result.stderr
