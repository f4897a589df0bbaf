"""The model: a transformers causal LM from a preset config (no download) or a local path, plus LoRA.

LoRA is implemented here (no peft dependency): each target module (nn.Linear, or GPT-2's Conv1D,
matched by name suffix like PEFT's `target_modules`) is wrapped so that
    y = base(x) + (dropout(x) @ A^T @ B^T) * alpha / r,   A: (r, in), B: (out, r), B = 0 at start,
and every base parameter is frozen. Checkpoints then hold only the adapters.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from jobspec.errors import ConfigError
from jobspec.presets import PRESETS, ModelShape
from jobspec.spec import JobSpec, LoraSpec

log = logging.getLogger("jobspec.runner")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "auto": "auto"}


def preset_config(shape: ModelShape, bos: int, eos: int) -> object:
    """A transformers config for a preset shape. Dropout is 0: fine-tuning runs are short, and the
    loss is then a deterministic function of the weights (exact resume is checked bit for bit)."""
    from transformers import GPT2Config, LlamaConfig

    if shape.family == "gpt2":
        cfg = GPT2Config(
            vocab_size=shape.vocab,
            n_positions=shape.max_positions,
            n_embd=shape.hidden,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_inner=shape.intermediate,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=bos,
            eos_token_id=eos,
            tie_word_embeddings=shape.tie_embeddings,
        )
    else:
        cfg = LlamaConfig(
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads or shape.heads,
            max_position_embeddings=shape.max_positions,
            tie_word_embeddings=shape.tie_embeddings,
            bos_token_id=bos,
            eos_token_id=eos,
        )
    return cfg


def build_model(spec: JobSpec, *, bos: int, eos: int, vocab: int) -> nn.Module:
    """The model on the CPU in fp32 (preset) or its stored dtype (path); the caller places it."""
    from transformers import AutoModelForCausalLM

    m = spec.model
    torch.manual_seed(spec.training.seed)  # the same initial weights on every rank and every restart
    if m.preset:
        cfg = preset_config(PRESETS[m.preset], bos, eos)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=m.attention)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(m.path, dtype=DTYPES[m.dtype], attn_implementation=m.attention)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.path {m.path!r}: cannot load the model ({err})") from err
        if vocab > model.get_input_embeddings().num_embeddings:
            log.info(
                "resizing the embeddings %d -> %d rows for the tokenizer",
                model.get_input_embeddings().num_embeddings,
                vocab,
            )
            model.resize_token_embeddings(vocab)
    model.config.use_cache = False  # no KV cache in training (and required with checkpointing)
    if m.lora:
        apply_lora(model, m.lora)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "model %s: %.2fM parameters, %.2fM trainable, attention %s",
        m.preset or m.path,
        total / 1e6,
        trainable / 1e6,
        m.attention,
    )
    return model


class LoRA(nn.Module):
    """A frozen `base` (nn.Linear or transformers Conv1D) plus a trainable low-rank update."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float):
        super().__init__()
        if isinstance(base, nn.Linear):
            fan_in, fan_out = base.in_features, base.out_features
        else:  # transformers Conv1D stores its weight as (in, out) and computes x @ W + b
            fan_in, fan_out = base.weight.shape
        self.base = base
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, fan_in, dtype=w.dtype, device=w.device))  # (r, in)
        self.lora_b = nn.Parameter(torch.zeros(fan_out, rank, dtype=w.dtype, device=w.device))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # PEFT's init: the update starts at 0 via B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = (self.dropout(x) @ self.lora_a.t()) @ self.lora_b.t()  # (..., in) -> (..., r) -> (..., out)
        return self.base(x) + update * self.scale


def apply_lora(model: nn.Module, lora: LoraSpec) -> int:
    """Wrap every module whose name ends with a target; freeze the rest. Returns modules wrapped."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = [
        name
        for name, mod in model.named_modules()
        if any(name == t or name.endswith("." + t) for t in lora.targets)
        and hasattr(mod, "weight")
        and mod.weight.dim() == 2
    ]
    if not names:
        raise ConfigError(
            f"model.lora.targets {lora.targets} match no linear module of this model; "
            "use e.g. [c_attn] for GPT-2 or [q_proj, v_proj] for Llama-style models"
        )
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRA(getattr(parent, child), lora.rank, lora.alpha, lora.dropout))
    log.info("LoRA rank %d alpha %g on %d modules (%s)", lora.rank, lora.alpha, len(names), ", ".join(lora.targets))
    return len(names)


def block_class_names(model: nn.Module) -> list[str]:
    """Class names of the transformer blocks (FSDP wraps each one, and checkpointing recomputes them)."""
    blocks = getattr(model, "_no_split_modules", None) or []
    found = {type(m).__name__ for m in model.modules()}
    names = [b for b in blocks if b in found]
    if not names:
        raise ConfigError(f"cannot find the transformer blocks of {type(model).__name__} to shard")
    return names
