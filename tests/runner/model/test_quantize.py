"""A 4-bit base for LoRA (`model.quantize: nf4`): a real 2-layer Llama trains on an NF4 base at `fast` and on two
FSDP2 ranks at `zero3`, its adapter loads with peft, its merge matches training, and the plan follows the trace."""

from __future__ import annotations

import pytest
import torch

from jobspec.catalog.presets import PRESETS, ModelShape
from jobspec.contract import EXIT_OK
from jobspec.plan import memory
from jobspec.plan.quantize import NF4_BYTES, quantized_params
from jobspec.spec.models import LoraSpec
from runner.model.quantize import base_linears, is_quantized
from runner.oom.faults import ENV_VAR
from runner.train.trace import trace_step
from tests.runner.output.test_export import load_adapter_outside, trained_logits
from tests.runner.train_helpers import records, run_supervisor, tiny_spec, tiny_spec_dict, train_in_process, write_spec

LORA = {"rank": 8, "targets": ["q_proj", "v_proj", "up_proj"]}
PROMPT = torch.tensor([[257, 260, *b"What is 2 + 3?", 261]])


def qlora(**sections):
    """The tiny spec's sections for LoRA on llama-tiny's NF4 base (`sections` override)."""
    training = {"steps": 8, "learning_rate": 1e-2, "micro_batch": 4, **sections.pop("training", {})}
    return {"model": {"preset": "llama-tiny", "lora": LORA, "quantize": "nf4"}, "training": training, **sections}


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """One bf16 run at `fast` on an NF4 base (the trained worker and its run directory)."""
    run = tmp_path_factory.mktemp("qlora") / "run"
    code, worker = train_in_process(tiny_spec(run, **qlora(training={"precision": "bf16"})))
    assert code == EXIT_OK
    return worker, run


def test_an_nf4_base_trains_its_adapters_and_the_loss_falls(fast):
    worker, run = fast
    plan = records(run, "plan")[0]
    assert plan["quantize"] == "nf4" and plan["tier"] == "fast"
    weights = [m.weight for _, m in base_linears(worker.accelerator.unwrap_model(worker.model))]
    assert len(weights) == 2 * 7 and all(is_quantized(w) and not w.requires_grad for w in weights)
    held = sum(t.numel() * t.element_size() for w in weights for t in (w.quantized_data, w.quantized_scalers,
                                                                       w.quantization_factor))  # fmt: skip
    assert held == pytest.approx(NF4_BYTES * quantized_params(PRESETS["llama-tiny"], "nf4"), rel=0.01)
    losses = [r["loss"] for r in records(run)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses


def test_the_export_is_an_adapter_for_the_16_bit_base_and_a_merged_model_of_what_trained(fast, tmp_path):
    worker, run = fast
    logits = trained_logits(worker, PROMPT)
    got, (adapted, merged_logits) = load_adapter_outside(run, tmp_path)
    assert got["types"] == ["Parameter"] and got["dtype"] == "torch.bfloat16"  # the 16-bit base, no NF4 in it
    assert not got["merged_has_lora"]
    torch.testing.assert_close(merged_logits, logits, rtol=0.05, atol=0.05)  # the dequantized base + the adapters
    assert (adapted - logits).abs().max() < 1.0  # the 16-bit base the adapter names: close, not the same weights


def test_zero3_on_two_cpu_ranks_shards_the_nf4_base(tmp_path):
    spec = tiny_spec_dict(tmp_path / "run", **qlora(memory={"tier": "zero3"}, training={"micro_batch": 2, "steps": 6}))
    result = run_supervisor([str(write_spec(tmp_path / "s.yaml", spec)), "--nproc", "2"])
    assert result.returncode == EXIT_OK, result.stderr[-4000:]
    plan = records(tmp_path / "run", "plan")[0]
    assert (plan["tier"], plan["world_size"], plan["quantize"]) == ("zero3", 2, "nf4")
    losses = [r["loss"] for r in records(tmp_path / "run")]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize(("tier", "world_size"), [("fast", 1), ("zero2", 4), ("zero3", 4), ("zero3", 1)])
def test_the_plan_of_an_nf4_base_is_below_the_16_bit_one_and_within_10_percent_of_the_trace(tier, world_size):
    shape = ModelShape("llama", layers=2, hidden=512, heads=8, kv_heads=2, vocab=32000, max_positions=1024,
                       intermediate=1408, tie_embeddings=False)  # fmt: skip
    lora = LoraSpec(rank=8, targets=["q_proj", "v_proj"])
    kw = dict(tier=tier, world_size=world_size, micro_batch=2, seq_len=512)
    est = {q: memory.estimate(shape, lora=memory.LoraShape(8, ("q_proj", "v_proj")), quantize=q, **kw)
           for q in (None, "nf4")}  # fmt: skip
    assert est["nf4"].gpu_bytes < est[None].gpu_bytes
    traced = trace_step(shape, lora=lora, quantize="nf4", **kw)
    model = est["nf4"].gpu_bytes - est["nf4"].overhead  # the trace leaves out the context and fragmentation
    assert model == pytest.approx(traced.peak, rel=0.10)


def test_a_tier_step_down_keeps_the_nf4_base(tmp_path, monkeypatch):
    """An OOM at micro-batch 1 moves `fast` to the next tier in process (one rank: zero2_offload, sharded by FSDP2):
    the plan there holds the base in 4 bits too, the adapters are handed over, and training goes on."""
    monkeypatch.setenv(ENV_VAR, "step=4,backward")
    sections = qlora(training={"micro_batch": 1, "steps": 6}, checkpoints={"every_steps": 100})
    spec = tiny_spec(tmp_path / "run", **sections)
    code, worker = train_in_process(spec)
    assert code == EXIT_OK
    plans = records(tmp_path / "run", "plan")
    assert [(p["tier"], p["quantize"]) for p in plans] == [("fast", "nf4"), ("zero2_offload", "nf4")]
    model = worker.accelerator.unwrap_model(worker.model)
    assert sum(is_quantized(m.weight) for _, m in base_linears(model)) == 2 * 7
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
