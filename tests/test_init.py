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
    assert code == EXIT_CONFIG and "huggingface-cli download Org/not-cached config.json" in said
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
    assert spec.model.path == "Org/Small" and spec.model.architecture.hidden == config["hidden_size"]
    assert plan_spec(spec, rows=1000).chosen.fits


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
