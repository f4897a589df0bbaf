"""The memory model's LoRA figures against what peft really allocates, counted in tensor bytes on CPU.

Model states with LoRA (jobspec/plan/memory.py `_states`, tier fast, one rank): the frozen base at 2 bytes a
parameter plus 16 bytes per adapter parameter (its weight, gradient and Adam's two moments). peft keeps
the adapters in fp32 beside a bf16 base (`autocast_adapter_dtype`), so for a model stored in bf16 the
count is exact. A preset is built in fp32: with 16-bit training the runner casts its frozen base to
that width (runner/model/build.py), which makes the count exact too; fp32 training (CPU) keeps 4 bytes a
frozen parameter, 2P more than the model says (asserted, so the gap is not forgotten).
"""

from __future__ import annotations

import torch

from jobspec.plan import memory
from jobspec.plan.planner import lora_shape, model_shape
from runner.model.build import build_model
from runner.train.engine import make_optimizer
from tests.runner.train_helpers import tiny_spec


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Weights, gradients and optimizer state after one step: every tensor that lives through training."""
    x = torch.randint(0, 256, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    tensors = {id(p): p for p in model.parameters()}  # tied weights once
    total = sum(p.numel() * p.element_size() for p in tensors.values())
    total += sum(p.grad.numel() * p.grad.element_size() for p in tensors.values() if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def modelled(spec) -> tuple[int, int, int]:
    """(what persists on the GPU: weights, gradients, Adam's moments; trainable params; base params)."""
    shape = model_shape(spec)
    s = memory._states(shape, "fast", 1, lora_shape(spec))
    return s.weights + s.gradients + s.optimizer + s.buckets, s.trainable, shape.params


def test_lora_states_of_a_bf16_model_match_the_memory_model_exactly(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path / "bf16"
    cfg = GPT2Config(vocab_size=512, n_positions=128, n_embd=128, n_layer=2, n_head=4, n_inner=512)
    GPT2LMHeadModel(cfg).to(torch.bfloat16).save_pretrained(path)
    arch = {"family": "gpt2", "layers": 2, "hidden": 128, "heads": 4, "vocab": 512, "intermediate": 512,
            "max_positions": 128, "tie_embeddings": True}  # fmt: skip
    lora = {"rank": 8, "targets": ["c_attn", "mlp.c_proj"]}
    spec = tiny_spec(tmp_path, model={"preset": None, "path": str(path), "architecture": arch, "lora": lora})
    model = build_model(spec, bos=257, eos=258, vocab=262)
    real = state_bytes(model, make_optimizer(model, spec, torch.device("cpu"), "fast"))
    gpu, trainable, params = modelled(spec)
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert real == gpu == 2 * params + 16 * trainable


def test_lora_on_a_preset_trained_in_bf16_matches_the_memory_model_exactly(tmp_path):
    spec = tiny_spec(tmp_path, model={"lora": {"rank": 8, "targets": ["c_attn"]}})
    model = build_model(spec, bos=257, eos=258, vocab=262, precision="bf16")
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # peft's adapters
    real = state_bytes(model, make_optimizer(model, spec, torch.device("cpu"), "fast"))
    gpu, trainable, params = modelled(spec)
    assert real == gpu == 2 * params + 16 * trainable


def test_lora_on_a_preset_trained_in_fp32_holds_the_frozen_base_at_4_bytes(tmp_path):
    spec = tiny_spec(tmp_path, model={"lora": {"rank": 8, "targets": ["c_attn"]}})
    model = build_model(spec, bos=257, eos=258, vocab=262)
    real = state_bytes(model, make_optimizer(model, spec, torch.device("cpu"), "fast"))
    gpu, trainable, params = modelled(spec)
    assert real == 4 * params + 16 * trainable
    assert real - gpu == 2 * params  # the gap the module docstring names
