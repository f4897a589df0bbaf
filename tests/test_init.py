"""`jobspec init`: the spec it writes validates and plans to the tier it names; what cannot fit is refused (exit 2)
with the smallest change that would, and that change, applied, fits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.plan.planner import plan_spec
from jobspec.spec.loader import load_spec
from tests.cli_helpers import cli

ROOT = Path(__file__).resolve().parents[1]


def _big_model(tmp_path: Path) -> Path:
    """A 70B-sized Llama config.json: no single T4 holds it at 4096 tokens."""
    config = json.loads((ROOT / "bench" / "families.json").read_text())["llama-3.1-8b"]
    config.update(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps(config))
    return tmp_path / "big"


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "qwen-0.5b", "--gpus", "A10G:1", "--data", "/data/train.jsonl", "--lora"],
        ["--model", "llama-1b", "--gpus", "A100-80GB:2", "--data", "/data/pairs.jsonl", "--objective", "dpo"],
        ["--model", "gpt2-medium", "--gpus", "RTX3080:1", "--data", "/data/train.jsonl", "--max-seq-len", "1024"],
    ],
)
def test_the_written_spec_validates_and_plans_to_its_tier(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "spec.yaml"
    code, said = cli("init", *args, "-o", str(out))
    assert code == EXIT_OK, said
    text = out.read_text()
    spec = load_spec(out)
    report = plan_spec(spec, rows=1000)
    tier = re.search(r"^  tier: (\w+)$", text, re.M)[1]
    assert report.chosen is not None and report.chosen.fits and report.chosen.tier == tier == spec.memory.tier
    # the comment gives the plan's micro-batch and accumulation for that tier
    assert f"micro-batch {report.chosen.micro_batch} x {report.chosen.grad_accum} accumulation" in text
    assert cli("validate", str(out))[0] == EXIT_OK
    # its header's commands name the file it was written to, not a name of its own
    assert text.splitlines()[1] == f"#   jobspec validate {out} && jobspec plan {out}"
    assert spec.training.objective == args[args.index("--objective") + 1] if "--objective" in args else "sft"
    assert (spec.model.lora is not None) == ("--lora" in args)


def test_a_local_model_too_big_is_refused_with_the_smallest_change(tmp_path: Path) -> None:
    big = _big_model(tmp_path)
    base = ["init", "--model", str(big), "--gpus", "T4:1", "--data", "/d.jsonl", "--max-seq-len", "4096"]
    code, said = cli(*base)
    assert code == EXIT_CONFIG
    assert "does not fit T4:1" in said and "The smallest change that fits: --lora" in said, said
    assert "see: docs/troubleshooting.md#config-error" in said
    assert "Traceback" not in said
    # the suggested change, applied, fits
    code, said = cli(*base, "--lora")
    assert code == EXIT_OK, said
    assert "lora:" in said and "targets: [q_proj, k_proj, v_proj, o_proj]" in said


def test_bad_requests_are_named(tmp_path: Path) -> None:
    code, said = cli("init", "--model", "gpt9", "--gpus", "A10G:1", "--data", "x")
    assert code == EXIT_CONFIG and "not a preset" in said
    code, said = cli("init", "--model", "tiny", "--gpus", "Z80:1", "--data", "x")
    assert code == EXIT_CONFIG and "known GPU type" in said
    code, said = cli("init", "--model", "Org/not-cached", "--gpus", "A10G:1", "--data", "x")
    assert code == EXIT_CONFIG and "hf download Org/not-cached config.json" in said and "--config" in said
    out = tmp_path / "s.yaml"
    out.write_text("keep")
    code, said = cli("init", "--model", "tiny", "--gpus", "A10G:1", "--data", "x", "-o", str(out))
    assert code == EXIT_CONFIG and out.read_text() == "keep"


def test_a_cached_hub_model_gets_its_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = tmp_path / "hub" / "models--Org--Small" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    config = json.loads((ROOT / "bench" / "families.json").read_text())["llama-3.2-1b"]
    (snapshot / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    out = tmp_path / "spec.yaml"
    code, said = cli("init", "--model", "Org/Small", "--gpus", "L4:1", "--data", "/d.jsonl", "--lora", "-o", str(out))
    assert code == EXIT_OK, said
    spec = load_spec(out)
    assert spec.model.path == "Org/Small" and spec.model.architecture.config() == config  # the config.json, inline
    assert plan_spec(spec, rows=1000).chosen.fits


@pytest.mark.parametrize("family", ["qwen3-30b-a3b", "deepseek-v2-lite", "gemma-2-2b", "phi-3-mini"])
def test_a_hub_model_config_given_as_a_file_is_written_inline_and_planned_as_the_local_one(
    tmp_path: Path, family: str
) -> None:
    """No hub and no cache: --config FILE. The spec carries the config.json as model.architecture, and `jobspec plan`
    of it says what it says of the same model as a local directory (mixture of experts, latent attention, Gemma 2's
    eager attention, Phi-3's fused projections as LoRA targets)."""
    config = json.loads((ROOT / "bench" / "families.json").read_text())[family]
    config["architectures"] = ["SomethingForCausalLM"]  # file metadata: not written into the spec
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text(json.dumps(config))
    (tmp_path / "downloaded.json").write_text(json.dumps(config))
    out = tmp_path / "spec.yaml"
    args = ["--gpus", "H100:8", "--data", "/d.jsonl", "--lora", "--max-seq-len", "1024"]
    downloaded = str(tmp_path / "downloaded.json")
    code, said = cli("init", "--model", "Org/Model", "--config", downloaded, *args, "-o", str(out))
    assert code == EXIT_OK, said
    text = out.read_text()
    assert "architectures" not in text and f"--config {tmp_path / 'downloaded.json'}" in text.splitlines()[2]
    hub = load_spec(out)
    del config["architectures"]
    assert hub.model.path == "Org/Model" and hub.model.architecture.config() == config
    local = load_spec(out, [f"model.path={tmp_path / 'local'}", "model.architecture=null"])
    from jobspec.plan.planner import model_attention, model_shape

    assert model_shape(hub) == model_shape(local) and model_shape(hub).model_type == config["model_type"]
    assert model_attention(hub) == model_attention(local) == ("eager" if family == "gemma-2-2b" else "sdpa")
    hub_plan, local_plan = plan_spec(hub, rows=1000), plan_spec(local, rows=1000)
    assert [(p.tier, p.micro_batch, p.estimate.gpu_bytes) for p in hub_plan.plans] == [
        (p.tier, p.micro_batch, p.estimate.gpu_bytes) for p in local_plan.plans
    ]
    assert hub_plan.chosen is not None and hub_plan.chosen.tier == hub.memory.tier
    assert cli("validate", str(out))[0] == EXIT_OK and cli("render", str(out))[0] == EXIT_OK


def test_a_missing_or_bad_config_file_is_named(tmp_path: Path) -> None:
    base = ["init", "--model", "Org/Model", "--gpus", "H100:1", "--data", "/d.jsonl"]
    code, said = cli(*base, "--config", str(tmp_path / "nope.json"))
    assert code == EXIT_CONFIG and "no such file" in said and "huggingface.co/Org/Model/blob/main/config.json" in said
    (tmp_path / "c.json").write_text(json.dumps({"model_type": "falcon", "hidden_size": 64}))
    code, said = cli(*base, "--config", str(tmp_path / "c.json"))
    assert code == EXIT_CONFIG and "model_type 'falcon'" in said and "qwen3_moe" in said, said  # the supported list
    code, said = cli("init", "--model", "tiny", "--gpus", "H100:1", "--data", "x", "--config", str(tmp_path / "c.json"))
    assert code == EXIT_CONFIG and "only for a hub id" in said
    assert "Traceback" not in said


def test_init_does_not_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; from jobspec.cli import main; "
        f"main(['init', '--model', 'qwen-0.5b', '--gpus', 'A10G:1', '--data', 'x', '-o', r'{tmp_path / 's.yaml'}']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_sequence_longer_than_the_model_takes_is_capped_and_said(tmp_path: Path) -> None:
    """--max-seq-len (default 2048) beyond a local model's positions: the spec takes the model's, and says so."""
    config = json.loads((ROOT / "bench" / "families.json").read_text())["llama-3.2-1b"]
    config.update(max_position_embeddings=512, num_hidden_layers=2)
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "config.json").write_text(json.dumps(config))
    out = tmp_path / "spec.yaml"
    code, said = cli("init", "--model", str(tmp_path / "short"), "--gpus", "L4:1", "--data", "/d.jsonl", "-o", str(out))
    assert code == EXIT_OK, said
    assert "max_seq_len: 512  " in out.read_text() and "(--max-seq-len 2048 is longer)" in out.read_text()
    assert load_spec(out).data.max_seq_len == 512
    # a sequence the model takes is written as asked, without the note
    code, said = cli("init", "--model", str(tmp_path / "short"), "--gpus", "L4:1", "--data", "/d.jsonl",
                     "--max-seq-len", "256")  # fmt: skip
    assert code == EXIT_OK and "max_seq_len: 256\n" in said and "is longer" not in said, said
