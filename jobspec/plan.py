"""`jobspec plan`: what the memory model says about a spec, tier by tier, before any GPU work.

Also the one place that turns a spec's model section into a `ModelShape` and its LoRA section
into a `LoraShape`, so the CLI and the runner plan from the same numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec import memory
from jobspec.errors import ConfigError
from jobspec.presets import PRESETS, ModelShape
from jobspec.spec import JobSpec
from jobspec.units import parse_bytes

GiB = 1024**3


def model_shape(spec: JobSpec) -> ModelShape:
    """Preset, explicit `model.architecture`, or the config.json of a local `model.path`."""
    model = spec.model
    if model.preset:
        return PRESETS[model.preset]
    if model.architecture:
        a = model.architecture
        return ModelShape(
            a.family,
            a.layers,
            a.hidden,
            a.heads,
            a.vocab,
            a.max_positions,
            a.intermediate,
            a.kv_heads,
            tie_embeddings=a.tie_embeddings,
        )
    config = Path(model.path or "") / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"model.path {model.path!r}: no local config.json to size the model from; "
            "add model.architecture {family, layers, hidden, heads, vocab, intermediate} to the spec"
        )
    return shape_from_config(json.loads(config.read_text()))


def shape_from_config(cfg: dict[str, Any]) -> ModelShape:
    """A transformers config.json (GPT-2 or Llama-style keys) as a ModelShape."""
    if "n_embd" in cfg:  # GPT-2 naming
        hidden = cfg["n_embd"]
        return ModelShape(
            "gpt2",
            layers=cfg["n_layer"],
            hidden=hidden,
            heads=cfg["n_head"],
            vocab=cfg["vocab_size"],
            max_positions=cfg.get("n_positions", 1024),
            intermediate=cfg.get("n_inner") or 4 * hidden,
        )
    try:
        return ModelShape(
            "llama",
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            heads=cfg["num_attention_heads"],
            kv_heads=cfg.get("num_key_value_heads"),
            vocab=cfg["vocab_size"],
            max_positions=cfg.get("max_position_embeddings", 2048),
            intermediate=cfg["intermediate_size"],
            tie_embeddings=cfg.get("tie_word_embeddings", False),  # transformers' Llama default
        )
    except KeyError as err:
        raise ConfigError(f"config.json has no {err.args[0]!r}: add model.architecture to the spec") from None


def lora_shape(spec: JobSpec) -> memory.LoraShape | None:
    lora = spec.model.lora
    return memory.LoraShape(lora.rank, tuple(lora.targets)) if lora else None


def estimate_kwargs(spec: JobSpec, world_size: int, precision: str) -> dict[str, Any]:
    """The spec's arguments to `memory.estimate` (and `plan_tier`/`plan_all`), apart from tier and micro-batch.

    One place for `jobspec plan` and the runner, so both size from the same numbers.
    """
    forced = {"on": True, "off": False}.get(spec.training.gradient_checkpointing)  # auto: the tier decides
    return {
        "world_size": world_size,
        "seq_len": spec.data.max_seq_len,
        "lora": lora_shape(spec),
        "checkpointing": forced,
        "attention": spec.model.attention,
        "precision": precision,
    }


def planned_precision(spec: JobSpec) -> memory.Precision:
    """The autocast width before any device is seen: `auto` is fp32 on CPU, 16-bit on a GPU."""
    asked = spec.training.precision
    if asked == "auto":
        return "fp32" if spec.hardware.vendor == "cpu" else "bf16"
    return asked


@dataclass(frozen=True)
class PlanReport:
    spec: JobSpec
    shape: ModelShape
    gpu_bytes: int
    gpu_label: str
    plans: list[memory.TierPlan]
    chosen: memory.TierPlan | None  # what the spec's tier (or `auto`) gives

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.spec.name,
            "model_params": self.shape.params,
            "gpu": self.gpu_label,
            "gpu_bytes": self.gpu_bytes,
            "world_size": self.spec.world_size,
            "global_batch": self.spec.training.global_batch,
            "seq_len": self.spec.data.max_seq_len,
            "tier": self.chosen.tier if self.chosen else None,
            "tiers": [
                {
                    "tier": p.tier,
                    "gpu_bytes": p.estimate.gpu_bytes,
                    "host_bytes": p.estimate.host,
                    "fits": p.fits,
                    "useful": p.useful,
                    "micro_batch": p.micro_batch,
                    "grad_accum": p.grad_accum,
                    "note": p.reason,
                }
                for p in self.plans
            ],
        }


def plan_spec(spec: JobSpec, gpu_memory: str | int | None = None) -> PlanReport:
    hw = spec.hardware
    if gpu_memory is not None:
        try:
            gpu_bytes, label = parse_bytes(gpu_memory), f"{gpu_memory} (--gpu-memory)"
        except ValueError as err:
            raise ConfigError(f"--gpu-memory: {err}") from None
    elif hw.gpus.memory_bytes:
        gpu_bytes, label = hw.gpus.memory_bytes, f"{hw.gpus.type or 'GPU'} {hw.gpus.memory_bytes / GiB:.0f} GiB"
    else:
        raise ConfigError(
            f"{spec.name}: no GPU memory to plan against (hardware.vendor {hw.vendor}, no hardware.gpus.type); "
            "pass --gpu-memory 24Gi or set hardware.gpus.type / hardware.gpus.memory"
        )
    shape = model_shape(spec)
    plans = memory.plan_all(
        shape,
        gpu_bytes=gpu_bytes,
        global_batch=spec.training.global_batch,
        utilization=spec.memory.target_utilization,
        **estimate_kwargs(spec, spec.world_size, planned_precision(spec)),
    )
    if spec.memory.tier == "auto":
        chosen = memory.pick_tier(plans)
    else:
        chosen = next(p for p in plans if p.tier == spec.memory.tier)
    return PlanReport(spec, shape, gpu_bytes, label, plans, chosen)


def plan_table(report: PlanReport) -> str:
    spec = report.spec
    head = (
        f"{spec.name}: {report.shape.params / 1e6:,.0f}M params, seq {spec.data.max_seq_len}, "
        f"global batch {spec.training.global_batch} over {spec.world_size} rank(s), {report.gpu_label} per GPU"
    )
    rows = [("tier", "GiB/GPU", "host GiB", "fits", "micro", "accum", "note")]
    for p in report.plans:
        mark = "  <- " + ("auto" if spec.memory.tier == "auto" else "spec") if p is report.chosen else ""
        rows.append(
            (
                p.tier,
                f"{p.estimate.gpu_bytes / GiB:.1f}",
                f"{p.estimate.host / GiB:.1f}" if p.estimate.host else "-",
                "yes" if p.fits else "no",
                str(p.micro_batch or "-"),
                str(p.grad_accum or "-"),
                (p.reason or "") + mark,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = [head, ""] + ["  ".join(c.ljust(w) for c, w in zip(r[:6], widths, strict=True)) + "  " + r[6] for r in rows]
    if report.chosen is None or not report.chosen.fits:
        lines.append("\nnothing fits: use a larger GPU, more GPUs, a shorter data.max_seq_len, or LoRA")
    budget = f"{spec.memory.target_utilization:.0%}"
    lines.append(f"\nGiB/GPU is at the micro-batch shown (1 when nothing fits); sized to {budget} of the GPU.")
    return "\n".join(lines)
