"""`model.quantize` on the submitter side: the spec's rules, and the memory model's 4-bit base (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jobspec.catalog.presets import ModelShape
from jobspec.errors import ConfigError
from jobspec.plan import memory
from jobspec.plan.quantize import NF4_BYTES, quantized_params
from tests.cli_helpers import cli

# a Llama-3.1-8B shape: the case QLoRA is for (an 8B adapter on a 16-24 GiB card)
LLAMA_8B = ModelShape("llama", layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256, max_positions=8192,
                      intermediate=14336, tie_embeddings=False)  # fmt: skip
LORA = memory.LoraShape(16, ("q_proj", "k_proj", "v_proj", "o_proj"))
GIB = 1024**3


def spec_file(tmp_path: Path, **model: object) -> str:
    arch = {"family": "llama", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "vocab": 128256,
            "intermediate": 14336, "tie_embeddings": False}  # fmt: skip
    spec = {
        "name": "qlora",
        "model": {"path": str(tmp_path / "m"), "architecture": arch, **model},
        "data": {"max_seq_len": 2048},
        "training": {"global_batch": 16, "steps": 10},
        "hardware": {"vendor": "cuda", "gpus": 1},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_quantize_without_lora_exits_2_naming_the_field_and_the_fix(tmp_path: Path) -> None:
    code, out = cli("validate", spec_file(tmp_path, quantize="nf4"))
    assert code == 2
    assert "model.quantize: nf4" in out and "add `model.lora`" in out and "Traceback" not in out


def test_quantize_on_a_gpt2_preset_is_refused_at_validate_time(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "q", "model": {"preset": "tiny", "quantize": "nf4",
                                                           "lora": {"rank": 4, "targets": ["c_attn"]}},
                                    "training": {"global_batch": 8, "steps": 2}}))  # fmt: skip
    code, out = cli("validate", str(path))
    assert code == 2 and "Conv1D" in out and "llama-tiny" in out


FAMILIES = Path(__file__).resolve().parents[1] / "examples" / "families"


@pytest.mark.parametrize("example", ["qwen3-moe-30b-a3b-lora.yaml", "deepseek-v2-lite-lora.yaml",
                                     "mixtral-8x7b-lora.yaml"])  # fmt: skip
def test_nf4_on_experts_or_latent_attention_is_refused_at_validate_time(example: str) -> None:
    """validate said ok and only plan and the pod refused (issue 44): the same check, naming model.quantize."""
    code, out = cli("validate", str(FAMILIES / example), "--set", "model.quantize=nf4")
    assert code == 2 and "model.quantize nf4" in out and "mixture-of-experts" in out and "Traceback" not in out, out
    assert cli("validate", str(FAMILIES / example))[0] == 0


def test_an_nf4_base_holds_its_block_linears_at_half_a_byte_and_a_bit() -> None:
    dense = memory.estimate(LLAMA_8B, tier="fast", seq_len=2048, micro_batch=0, world_size=1, lora=LORA)
    four = memory.estimate(LLAMA_8B, tier="fast", seq_len=2048, micro_batch=0, world_size=1, lora=LORA, quantize="nf4")
    linears = quantized_params(LLAMA_8B, "nf4")
    assert linears == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert dense.weights - four.weights == int((2 - NF4_BYTES) * linears)
    assert 0.515 < NF4_BYTES < 0.516


@pytest.mark.parametrize("world_size", [1, 8])
def test_the_nf4_plan_is_below_the_16_bit_lora_plan_at_every_tier(world_size: int) -> None:
    kw = dict(seq_len=2048, micro_batch=2, world_size=world_size, lora=LORA)
    for tier in ("fast", "zero2", "zero2_offload", "zero3", "minimal"):
        dense = memory.estimate(LLAMA_8B, tier=tier, **kw)
        four = memory.estimate(LLAMA_8B, tier=tier, quantize="nf4", **kw)
        assert four.gpu_bytes + four.host < dense.gpu_bytes + dense.host, tier
        if tier == "minimal" and world_size == 1:  # FSDP2 leaves the 4-bit layers alone on one rank: on the GPU
            assert four.weights == pytest.approx(NF4_BYTES * quantized_params(LLAMA_8B, "nf4"), abs=2), tier
        else:
            assert four.gpu_bytes <= dense.gpu_bytes, tier  # minimal peaks at the 16-bit head: equal


def test_auto_quantizes_only_where_the_16_bit_base_does_not_fit_and_says_so() -> None:
    kw = dict(gpu_bytes=16 * GIB, global_batch=16, world_size=1, seq_len=2048, lora=LORA)
    auto = {p.tier: p for p in memory.plan_all(LLAMA_8B, quantize="auto", **kw)}
    dense = {p.tier: p for p in memory.plan_all(LLAMA_8B, **kw)}
    assert not dense["zero2_offload"].fits and auto["zero2_offload"].fits and auto["zero2_offload"].quantize == "nf4"
    assert "quantize auto -> nf4" in auto["zero2_offload"].note and "GiB" in auto["zero2_offload"].note
    assert dense["minimal"].fits and auto["minimal"].quantize is None  # 16 bits wherever they fit
    assert memory.pick_tier(list(auto.values())).tier == "zero2_offload"  # before minimal's 2-5x slower offload
    assert all(p.quantize is None for p in dense.values())  # `none` (the default) never quantizes
    roomy = memory.plan_all(LLAMA_8B, quantize="auto", **{**kw, "gpu_bytes": 80 * GIB})
    assert all(p.quantize is None for p in roomy)


def test_plan_prints_the_4_bit_choice_of_auto(tmp_path: Path) -> None:
    code, out = cli("plan", spec_file(tmp_path, quantize="auto", lora={"rank": 16, "targets": ["q_proj", "v_proj"]}),
                    "--gpu-memory", "16", "-o", "json")  # fmt: skip
    assert code == 0, out
    tiers = {t["tier"]: t for t in json.loads(out)["tiers"]}
    assert tiers["zero2_offload"]["quantize"] == "nf4" and tiers["minimal"]["quantize"] is None
    assert tiers["zero2_offload"]["quantize_note"].startswith("quantize auto -> nf4")


def test_the_memory_model_refuses_a_4_bit_base_without_lora() -> None:
    with pytest.raises(ConfigError, match=r"add model\.lora"):
        memory.estimate(LLAMA_8B, tier="fast", seq_len=128, micro_batch=1, world_size=1, quantize="nf4")


def test_plan_trace_traces_each_tier_with_the_base_its_plan_holds(tmp_path: Path) -> None:
    """`quantize: auto` may hold the base in 4 bits at some tiers only: each is traced with that base."""
    from unittest import mock

    from jobspec.plan import traced

    kw = dict(gpu_bytes=16 * GIB, global_batch=16, world_size=1, seq_len=2048, lora=LORA)
    plans = memory.plan_all(LLAMA_8B, quantize="auto", **kw)
    calls: list[tuple[list[str], list[str]]] = []

    def run_trace(spec_path, overrides, pairs, world_size, precision, timeout_s):
        calls.append((list(overrides), [tier for tier, _ in pairs]))
        return [{"tier": tier, "micro_batch": mbs, "peak": 1} for tier, mbs in pairs]

    with mock.patch.object(traced, "run_trace", run_trace), mock.patch.object(traced, "find_spec", return_value=1):
        rows = traced.trace_tiers("spec.yaml", ["data.max_seq_len=2048"], plans, 1, "bf16")
    four = [p.tier for p in plans if p.quantize == "nf4"]
    assert four and set(rows) == {p.tier for p in plans}
    assert (["data.max_seq_len=2048", "model.quantize=nf4"], four) in calls
    assert (["data.max_seq_len=2048"], [p.tier for p in plans if p.quantize is None]) in calls
