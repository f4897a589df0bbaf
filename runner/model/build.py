"""The model: a transformers causal LM from a preset config (no download) or a local path, plus LoRA.

LoRA comes from peft (`get_peft_model`): target modules are matched by name suffix (peft's
`target_modules`), every base parameter is frozen, and the adapters' names are peft's own
(`...c_attn.lora_A.default.weight`), so checkpoints hold only the adapters and an export is a
PEFT adapter directory that `PeftModel.from_pretrained` reads.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import nullcontext
from importlib.util import find_spec
from typing import Any

import torch
from torch import nn

from jobspec.catalog.families import FAMILIES
from jobspec.catalog.model_config import check_config, shape_from_config
from jobspec.catalog.presets import PRESETS, ModelShape
from jobspec.errors import ConfigError
from jobspec.plan.planner import model_attention
from jobspec.spec.models import JobSpec, LoraSpec
from runner import internals

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
            **({"head_dim": shape.head_dim} if shape.head_dim else {}),  # a shape read from a config that names it
        )
    return cfg


def ready_for_training(model: nn.Module) -> nn.Module:
    """What every built model needs before training, the trace's included: no KV cache (and none with checkpointing);
    for a mixture-of-experts model, the experts' matmul at autocast's width (runner/internals/kernels.py
    `install_experts_matmul`: torch's grouped matmul takes bf16 only on a GPU)."""
    model.config.use_cache = False
    fam = FAMILIES.get(getattr(model.config, "model_type", ""))
    if fam is not None and fam.experts is not None:
        internals.install_experts_matmul()
    return model


def liger_blocks(model: nn.Module, device_type: str) -> list[str]:
    """Liger Kernel's block kernels in `model` (`training.block_kernels: liger`; runner/internals/kernels.py), the
    experts of a mixture of experts left as they are; logged."""
    model_type = getattr(model.config, "model_type", "")
    fam = FAMILIES.get(model_type)
    applied = internals.apply_liger_blocks(model, model_type, device_type,
                                           experts=fam is not None and fam.experts is not None)  # fmt: skip
    # Liger's RMSNorm returns a view of its output; FSDP2 warns about every unit whose output is one (an in-place op
    # on it would skip the unit's pre-backward hook). Nothing writes into a norm's output here: the blocks add it
    # out of place and the loss head reads the last one.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*RMSNorm.*\) returned a view tensor")
    log.info("block kernels: Liger Kernel's %s", ", ".join(applied))
    return applied


def router_aux_coef(model: nn.Module) -> float | None:
    """The weight of the router's load-balancing loss that transformers adds for this model (`router_aux_loss_coef`
    where it computes one: jobspec/catalog/families.py), or None (a dense model, DeepSeek-V2, a coefficient of 0, a
    mixture-of-experts family whose config keeps every layer dense: transformers' loss then finds no router logits and
    fails with an IndexError)."""
    config = getattr(model, "config", None)
    fam = FAMILIES.get(getattr(config, "model_type", ""))
    coef = getattr(config, "router_aux_loss_coef", None)
    if fam is None or fam.experts is None or not fam.experts.aux_loss or not isinstance(coef, (int, float)):
        return None
    if not shape_from_config(config.to_dict(), "the model's config").moe_layers:
        return None
    return float(coef) if coef > 0 else None


def frozen_base_width(model: nn.Module, precision: str) -> nn.Module:
    """A LoRA preset's frozen base at the width it trains at: 16-bit with bf16/fp16 training, else fp32."""
    return model.to(DTYPES[precision]) if precision in ("bf16", "fp16") else model


def check_attention(attention: str) -> None:
    """flash_attention_2 needs the flash_attn package and a GPU, and is never swapped for sdpa behind the user's back.

    transformers reports either lack only after building the model, as a traceback: an ImportError without the
    package, a ValueError on a machine without a GPU (the model is built on the CPU and placed later; with a GPU
    present it only warns). runner.process.preflight asks for the package before any heavy import; this repeats
    it for callers that build without the supervisor, and adds what only torch knows: whether a GPU is here.
    """
    if attention != "flash_attention_2":
        return
    if find_spec("flash_attn") is None:
        raise ConfigError(
            "model.attention flash_attention_2 needs the flash_attn package, which is not installed here: "
            "pip install flash-attn --no-build-isolation, or set model.attention: sdpa"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            "model.attention flash_attention_2 needs a GPU and this machine has none (a CPU run, or the CPU "
            "stand-in for GPUs): set model.attention: sdpa"
        )


def checked_config(path: str) -> object:
    """The transformers config of `path` (a local directory or a hub id), its shape checked before any weight is
    allocated (jobspec.catalog.model_config: the numbers transformers would build from). A config transformers
    itself cannot read is a ConfigError too, whatever it raises: the file is input, not code."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as err:  # a config file someone else wrote: any failure is bad input
        raise ConfigError(
            f"model.path {path!r}: cannot read its config ({type(err).__name__}: {str(err)[:300]})"
        ) from None
    check_config(config.to_dict(), where=f"model.path {path!r} config")
    return text_part(config)


# A multimodal checkpoint's language-model weights as its text model's causal LM names them (Gemma 3: the hub files'
# `language_model.model.*`, and `model.language_model.*` as transformers >= 4.52 writes them): the vision tower's
# weights match none and are left unread (transformers reports them as unexpected).
TEXT_WEIGHTS = {r"^language_model\.model\.": "model.", r"^model\.language_model\.": "model.",
                r"^language_model\.lm_head\.": "lm_head."}  # fmt: skip


def text_part(config: object) -> object:
    """The config of the model a run trains: for a family that trains a multimodal checkpoint's text model alone
    (jobspec/catalog/families.py `text_model`: Gemma 3 4B+), its `text_config` (AutoModelForCausalLM builds
    Gemma3ForCausalLM from it); `config` otherwise."""
    fam = FAMILIES.get(getattr(config, "model_type", ""))
    return config.text_config if fam is not None and fam.text_model else config  # type: ignore[attr-defined]


def load_pretrained(path: str, config: object, **kwargs: object) -> nn.Module:
    """AutoModelForCausalLM.from_pretrained of `path` built as `config` (checked_config's): a multimodal checkpoint's
    text model reads the language model's weights (TEXT_WEIGHTS), so it loads exactly what the file holds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    stored = AutoConfig.from_pretrained(path)
    mapping = {"key_mapping": TEXT_WEIGHTS} if text_part(stored) is not stored else {}
    return AutoModelForCausalLM.from_pretrained(path, config=config, **mapping, **kwargs)


def build_model(
    spec: JobSpec, *, bos: int, eos: int, vocab: int, precision: str = "fp32", quantize: str | None = None,
    shards: int = 1, device: torch.device | None = None, weights: str = "init", train_on: str | None = None,
) -> nn.Module:  # fmt: skip
    """The model in fp32 (preset) or its stored dtype (path), on the CPU unless `device` says where; the caller
    places it.

    `device` (a GPU where the whole model lives anyway: tier fast): a preset is built and initialised there, a
    `model.path` loaded straight onto it, with no pass over the weights on the host (building the 1B preset on the
    host took about 30 s of the first H200 run's start-up, issue 41). `weights`: "init" gives the initial weights
    (the spec's seed, or the stored ones); "none" builds a preset on the meta device and materialises it on the host
    uninitialised, for a caller that writes every parameter and buffer itself (an in-process tier step-down hands
    the trained state over; `transient_buffers` are the non-persistent buffers it copies too: rotary frequencies).

    With LoRA and 16-bit training (`precision`), a preset's frozen base is cast to that width first: it
    takes no gradient or optimizer step, so fp32 would only double its memory (the memory model counts
    2 bytes a frozen parameter); peft keeps the adapters in fp32. `quantize` (the plan's, LoRA only): the base's block
    linear layers in 4 bits before the adapters go on (runner/model/quantize.py), split into blocks that `shards`
    FSDP2 ranks can share. `train_on` (the device type the model will train on; an export leaves it out): the spec's
    `training.block_kernels` go into the blocks for it (Liger's, before LoRA: runner/internals/kernels.py).
    """
    from transformers import AutoModelForCausalLM

    m = spec.model
    attention = model_attention(spec)  # the family's kernel where the spec left the default (Gemma 2: eager)
    check_attention(attention)
    torch.manual_seed(spec.training.seed)  # the same initial weights on every rank and every restart
    if weights == "none" and (not m.preset or m.lora):  # a path's dtype and vocabulary, LoRA's base: from files, seed
        raise ValueError("weights='none' builds presets without LoRA only: the caller must have every weight")
    gpu = device if device is not None and device.type != "cpu" else None
    where = {} if gpu is None else {"device_map": {"": gpu}}
    if m.preset:
        cfg = preset_config(PRESETS[m.preset], bos, eos)
        place = torch.device("meta") if weights == "none" else gpu  # factories allocate there: no host pass
        with place if place is not None else nullcontext():
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention)
        if weights == "none":
            model.to_empty(device="cpu")  # allocated, never written: the caller writes every weight
            model.tie_weights()  # to_empty gives each of two tied parameters its own storage
    else:
        config = checked_config(m.path)
        try:
            model = load_pretrained(m.path, config, dtype=DTYPES[m.dtype], attn_implementation=attention, **where)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.path {m.path!r}: cannot load the model ({err})") from None
        if vocab > model.get_input_embeddings().num_embeddings:
            log.info(
                "resizing the embeddings %d -> %d rows for the tokenizer",
                model.get_input_embeddings().num_embeddings,
                vocab,
            )
            model.resize_token_embeddings(vocab)
    ready_for_training(model)
    if train_on is not None and spec.training.block_kernels == "liger":
        liger_blocks(model, train_on)
    if m.lora and m.preset:
        frozen_base_width(model, precision)
    if m.lora and quantize:
        from runner.model.quantize import quantize_base

        quantize_base(model, quantize, shards=shards, dtype=DTYPES[precision])
    if m.lora:
        model = apply_lora(model, m.lora)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "model %s: %.2fM parameters, %.2fM trainable, attention %s",
        m.preset or m.path,
        total / 1e6,
        trainable / 1e6,
        attention,
    )
    return model


def transient_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict leaves out (non-persistent: rotary frequencies, masks), by name: what a model built with
    `weights="none"` lacks once the state dict's tensors are written into it."""
    kept = model.state_dict(keep_vars=True).keys()
    return {n: b for n, b in model.named_buffers() if n not in kept}


EXPERT_TARGET = "experts."  # `model.lora.targets` naming a mixture of experts' parameters: experts.gate_up_proj, ...


def lora_config(lora: LoraSpec, model: nn.Module) -> object:
    """peft's LoraConfig for the spec's `model.lora` (GPT-2's Conv1D stores its weight transposed)."""
    from peft import LoraConfig

    family = getattr(getattr(model, "config", None), "model_type", "")
    experts = [t for t in lora.targets if t.startswith(EXPERT_TARGET)]  # a MoE's 3-D expert weights (peft >= 0.17)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=[t for t in lora.targets if t not in experts] or None,
        fan_in_fan_out=family == "gpt2",
        task_type="CAUSAL_LM",
        **({"target_parameters": experts} if experts else {}),  # only where asked: peft < 0.17 has no such field
    )


def apply_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    """The model wrapped by peft: base frozen, LoRA adapters on every module whose name ends with a target."""
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, lora_config(lora, model))
    except ValueError as err:  # peft's NoMatchingPeftModuleError is a ValueError
        raise ConfigError(
            f"model.lora.targets {list(lora.targets)}: {err} Use e.g. [c_attn] for GPT-2, [q_proj, v_proj] "
            "for Llama-style models, and experts.gate_up_proj, experts.down_proj for a mixture of experts' experts"
        ) from None
    modules = {n.rsplit(".lora_", 1)[0] for n, p in peft_model.named_parameters() if p.requires_grad}
    log.info("LoRA (peft) rank %d alpha %g on %d modules (%s)", lora.rank, lora.alpha, len(modules),
             ", ".join(lora.targets))  # fmt: skip
    return peft_model


def block_class_names(model: nn.Module) -> list[str]:
    """Class names of the transformer blocks (FSDP wraps each one, and checkpointing recomputes them): the
    `_no_split_modules` of `model`, or of the first module inside it that has them (a model wrapped by DDP, whose
    wrapper has none)."""
    holder = next((m for m in model.modules() if getattr(m, "_no_split_modules", None)), model)
    blocks = getattr(holder, "_no_split_modules", None) or []
    found = {name for m in model.modules() for name in _class_names(m)}
    names = [b for b in blocks if b in found]
    if not names:
        raise ConfigError(f"cannot find the transformer blocks of {type(model).__name__} to shard")
    return names


def _class_names(module: nn.Module) -> set[str]:
    """The names of the module's class and its bases: FSDP2's `fully_shard` gives a sharded module a class of its own
    (FSDPLlamaDecoderLayer, a subclass of LlamaDecoderLayer), which is still the block."""
    return {c.__name__ for c in type(module).__mro__}


def eager_forwards() -> Any:
    """A context in which every compiled module runs its eager code (`torch.compiler.set_stance("force_eager")`).

    With `training.compile` only the training step's forwards and backwards should compile: a forward under other
    conditions (no gradients, another batch size, a KV cache) compiles graphs of its own, seconds to a minute each on
    a GPU, for the loss head's probe, each evaluation's shapes, GRPO's sampling and log-probs, the reference pass.
    Sampling with a cache recompiles layer by layer and length by length until dynamo's recompile limit (8), after
    which the block's code runs eagerly everywhere, the training step included (seen on the CPU: GRPO with compile
    hit the limit in its first rollout). Those forwards run inside this context; the training step outside it."""
    return torch.compiler.set_stance("force_eager")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of `model`, in order (those `block_class_names` names), sharded by FSDP2 or not."""
    names = set(block_class_names(model))
    return [m for m in model.modules() if _class_names(m) & names]
