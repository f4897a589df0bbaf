"""`jobspec plan`: what the memory model says about a spec, tier by tier, before any GPU work,
and how long each tier would take (jobspec.plan.throughput: FLOPs per token, the GPU's peak, an
efficiency per tier; jobspec.plan.job_length: the steps). jobspec.plan.output prints it.

Also the one place that turns a spec's model section into a `ModelShape` and its LoRA section
into a `LoraShape`, so the CLI and the runner plan from the same numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobspec.catalog import gpus as gpu_catalogue
from jobspec.catalog import tiers
from jobspec.catalog.families import FAMILIES, attention_for
from jobspec.catalog.model_config import read_config, shape_from_config
from jobspec.catalog.presets import PRESETS, ModelShape
from jobspec.errors import ConfigError
from jobspec.plan import calibration, capacity, memory, throughput
from jobspec.plan.job_length import JobLength, job_length, rows_per_sample
from jobspec.spec.models import DEFAULT_MEMORY_PER_RANK, ArchitectureConfig, JobSpec
from jobspec.spec.units import is_bare_number, parse_bytes

GiB = 1024**3


def model_shape(spec: JobSpec) -> ModelShape:
    """Preset, the config.json of a local `model.path` (a hub model's too, once the runner has its snapshot: the
    model's own family and sizes, experts included), or else the spec's `model.architecture`: a config.json written
    inline (read as the local one is) or the short dense form."""
    model = spec.model
    if model.preset:
        return PRESETS[model.preset]
    local = Path(model.path or "") / "config.json"
    if isinstance(model.architecture, ArchitectureConfig) and not local.is_file():
        return shape_from_config(model.architecture.config(), where="model.architecture")
    if model.architecture and not local.is_file():
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
    config = local
    if not config.exists():
        raise ConfigError(
            f"model.path {model.path!r}: no local config.json to size the model from; add the model's config.json "
            "to the spec as model.architecture (a mapping with its model_type; `jobspec init --model ID --config "
            "config.json` writes it), or for a dense model {family, layers, hidden, heads, vocab, intermediate}"
        )
    return shape_from_config(read_config(config.parent), where=str(config))


def model_attention(spec: JobSpec) -> str:
    """The attention kernel the model runs: `model.attention`, or, where the spec leaves it at its default and the
    model's family refuses sdpa (Gemma 2, gpt-oss: jobspec/catalog/families.py), eager. ConfigError (exit 2) when
    the spec names a kernel the family refuses. A hub model whose config is neither local nor inline
    (`model.architecture`'s config.json form) keeps the spec's kernel. A local config.json is read and checked on the
    way (family and sizes: what `jobspec validate` says of the model)."""
    model = spec.model
    model_type = ""
    inline = isinstance(model.architecture, ArchitectureConfig)
    if model.preset is None and (inline or (Path(model.path or "") / "config.json").is_file()):
        model_type = model_shape(spec).model_type
    fam = FAMILIES.get(model_type)
    if fam is None:
        return model.attention
    return attention_for(fam, model.attention, explicit="attention" in model.model_fields_set)


def check_model(spec: JobSpec) -> str:
    """What `jobspec validate` checks of the model before any plan: its attention kernel (`model_attention`, which
    reads a local or inline config.json) and whether its blocks can hold `model.quantize`'s 4-bit base (GPT-2's
    Conv1D, mixture-of-experts and latent-attention blocks cannot: ConfigError naming model.quantize, as `plan` and
    the runner would, only later). A hub model whose config is neither local nor inline is checked by the runner."""
    from jobspec.plan import quantize as quant

    attention = model_attention(spec)
    model = spec.model
    local = Path(model.path or "") / "config.json"
    if model.path and model.architecture is not None and local.is_file():
        raise ConfigError(f"model.architecture: model.path {model.path} has its own config.json, which the plan and "
                          "the runner read instead: remove model.architecture (or point model.path at the hub id)")
    method = quant.base_quantization(model.quantize, model.lora)
    if method and (model.preset or model.architecture is not None or local.is_file()):  # the shape is known here
        quant.check(model_shape(spec), method)
    return attention


HOST_UTILIZATION = 0.85  # of a pod's host memory the offloaded states may take: the rest is the processes, the loader


def host_checked(plan: memory.TierPlan, spec: JobSpec) -> memory.TierPlan:
    """`plan`, no longer fitting when its host memory (offloaded optimizer states and parameters, per rank, times the
    node's ranks) is more than HOST_UTILIZATION of the pod's `hardware.memory`: a Mixtral full fine-tune "fit" one L4
    at `minimal` with 695.9 GiB of host memory beside `hardware.memory: 64Gi`. Without hardware.memory the pod's host
    memory is not known before it runs (the runner reads its cgroup limit): the need is noted instead."""
    per_pod = plan.estimate.host * spec.hardware.gpus.count
    if not plan.fits or per_pod == 0:
        return plan
    limit = spec.hardware.memory
    if limit is None:  # the pod requests a default, with no limit: said when the tier needs more than it
        if per_pod <= DEFAULT_MEMORY_PER_RANK[spec.hardware.vendor] * spec.hardware.gpus.count:
            return plan
        note = f"needs {per_pod / GiB:.1f} GiB of host memory per pod: set hardware.memory to at least that"
        return dataclasses.replace(plan, note="; ".join(filter(None, (plan.note, note))))
    if per_pod <= HOST_UTILIZATION * limit:
        return plan
    why = (f"needs {per_pod / GiB:.1f} GiB of host memory per pod (offloaded states of {spec.hardware.gpus.count} "
           f"rank(s)), over {HOST_UTILIZATION:.0%} of hardware.memory {limit / GiB:.0f} GiB")  # fmt: skip
    return dataclasses.replace(plan, fits=False, reason=plan.reason or why)


def model_label(spec: JobSpec) -> str:
    """The model as a user named it, for messages: `model.preset X` or `model.path Y`."""
    return f"model.preset {spec.model.preset}" if spec.model.preset else f"model.path {spec.model.path}"


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
        "attention": model_attention(spec),
        "precision": precision,
        "packed": spec.data.packing,
        "loss_kernel": spec.training.loss_kernel,
        "quantize": None if spec.model.quantize == "none" else spec.model.quantize,
        "rows": rows_per_sample(spec),
        "sampling": spec.training.objective == "grpo",  # the rows are sampled first: their KV cache counts
        "optimizer": spec.training.optimizer,
        "block_kernels": spec.training.block_kernels,
        "compile_scope": spec.training.compile,
    }


def fixed_micro_batch(spec: JobSpec) -> int | None:
    """The spec's `training.micro_batch` when it is a number (the plan then reports that one), else None (auto)."""
    mbs = spec.training.micro_batch
    return mbs if isinstance(mbs, int) else None


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
    runs: memory.TierPlan | None = None  # where the job runs: `chosen`, or a tier memory.fallback steps down to
    length: JobLength | None = None
    gpu: gpu_catalogue.GpuInfo | None = None
    peak_tflops: float | None = None  # per GPU; None: no time estimate (time_note says why)
    time_note: str = ""
    times: dict[str, throughput.StepTime] = field(default_factory=dict)  # tiers that fit
    price: float | None = None  # per GPU-hour (--price)
    measured: list[str] = field(default_factory=list)  # --from: the model against a run's measurements
    traced: dict[str, dict[str, Any]] = field(default_factory=dict)  # --trace: tier -> the traced step's figures
    # DPO: tier -> seconds of the reference pass before training (the model's estimate, also beside a measured step)
    reference: dict[str, float] = field(default_factory=dict)

    @property
    def cost(self) -> float | None:
        """What the whole job costs at the tier it runs at."""
        return self.tier_cost(self.runs.tier) if self.runs else None

    def tier_cost(self, tier: str) -> float | None:
        """The whole job at `tier`: GPU-hours x price per GPU-hour (None without a price or a length)."""
        time = self.times.get(tier)
        if self.price is None or time is None or time.total_seconds is None:
            return None
        return time.total_seconds / 3600 * self.spec.world_size * self.price

    def to_dict(self) -> dict[str, Any]:
        length = self.length
        return {
            "job": self.spec.name,
            "model_params": self.shape.params,
            "gpu": self.gpu_label,
            "gpu_bytes": self.gpu_bytes,
            "world_size": self.spec.world_size,
            "global_batch": self.spec.training.global_batch,
            "seq_len": self.spec.data.max_seq_len,
            "tier": self.chosen.tier if self.chosen else None,
            "runs_at": self.runs.tier if self.runs else None,
            "steps": length.steps if length else None,
            "tokens_per_step": length.tokens_per_step if length else None,
            "job_tokens": length.steps * length.tokens_per_step if length and length.steps else None,
            "steps_from": length.how if length else None,
            "reference_tokens": length.reference_tokens if length else None,
            "reference_from": (length.reference_how or None) if length else None,
            "peak_tflops": self.peak_tflops,
            "price_per_gpu_hour": self.price,
            "cost": self.cost,
            "time_note": self.time_note or None,
            "assumptions": assumptions(self),
            "measured": self.measured or None,
            "tiers": [
                {
                    "tier": p.tier,
                    "gpu_bytes": p.estimate.gpu_bytes,
                    "gpu_breakdown": p.estimate.breakdown(),
                    "host_bytes": p.estimate.host,
                    "budget_bytes": p.budget,
                    "margin_bytes": p.margin,
                    "fits": p.fits,
                    "useful": p.useful,
                    "micro_batch": p.micro_batch,
                    "micro_batch_fixed": p.fixed,
                    "max_micro_batch": p.max_micro_batch,
                    "grad_accum": p.grad_accum,
                    "checkpointing": p.estimate.checkpointing,
                    "note": p.reason,
                    "quantize": p.quantize,
                    "quantize_note": p.note or None,
                    **_traced_dict(self.traced.get(p.tier), p),
                    **_time_dict(self.times.get(p.tier)),
                    "reference_seconds": self.reference.get(p.tier),
                    "cost": self.tier_cost(p.tier),
                }
                for p in self.plans
            ],
        }


def _traced_dict(row: dict[str, Any] | None, p: memory.TierPlan) -> dict[str, Any]:
    """--trace: the traced device bytes (no CUDA context or fragmentation) beside the model's same terms."""
    if row is None:
        return {}
    model = p.estimate.gpu_bytes - p.estimate.overhead
    return {
        "traced_gpu_bytes": row["peak"],
        "traced_host_bytes": row["host"],
        "traced_micro_batch": row["micro_batch"],
        "traced_parts": row["parts"],
        "model_over_traced": round(model / row["peak"], 4) if row["peak"] else None,
    }


def _time_dict(time: throughput.StepTime | None) -> dict[str, Any]:
    keys = ("efficiency", "step_seconds", "tokens_per_second", "mfu", "duration_seconds")
    if time is None:
        return dict.fromkeys(keys)
    values = (time.efficiency, time.step_seconds, time.tokens_per_second, time.mfu, time.total_seconds)
    return dict(zip(keys, values, strict=True))


def assumptions(report: PlanReport) -> dict[str, Any]:
    """The time model's formula and inputs, as `-o json` carries them and the table states them."""
    spec, shape = report.spec, report.shape
    return {
        "flops_per_token": "6*N + 6*L*h*s (LoRA: 4*N + 6*adapter params + 6*L*h*s); "
        "activation checkpointing adds the forward again: 2*N + 2*L*h*s",
        "N": throughput.matmul_params(shape),
        "L": shape.attention_layers,  # layers with softmax attention (a linear-attention layer's work is in N)
        "h": shape.hidden,
        "s": spec.data.max_seq_len,
        "rows": rows_per_sample(spec),
        "tokens_per_step": "global_batch * rows per sample (2 for a preference pair, or a KTO record with its KL "
        "row) * max_seq_len (every row full length: an upper bound without packing)",
        "reference_pass": "DPO, IPO, KTO: once before training, forward only: 2*N + 2*L*h*s per token (LoRA: + "
        "2*adapter params) over every pair's (KTO record's) 2 rows of max_seq_len tokens, at the tier's efficiency",
        "efficiency": dict(throughput.EFFICIENCY),
        "peak": "dense 16-bit matrix TFLOPS per GPU from the vendor's datasheet (jobspec/catalog/gpus.py)",
        "communication": "hidden behind compute",
    }


def gpu_memory_bytes(value: str | int) -> int:
    """--gpu-memory: a size ('24Gi', '80GB'); a number without a unit is GiB ('24' = 24Gi)."""
    try:
        if is_bare_number(value):
            gib = float(value)
            if not 0 < gib <= 1024**2:
                raise ValueError(f"{value} GiB is not a GPU's memory")
            return int(gib * 1024**3)
        return parse_bytes(value)
    except ValueError as err:
        raise ConfigError(f"--gpu-memory: {err} (e.g. --gpu-memory 24Gi; a bare number is GiB)") from None


def plan_spec(
    spec: JobSpec,
    gpu_memory: str | int | None = None,
    *,
    gpu: gpu_catalogue.GpuInfo | None = None,
    rows: int | None = None,
    length: JobLength | None = None,
    prices: dict[str, float] | None = None,
    measured: dict[str, calibration.Measured] | None = None,
) -> PlanReport:
    """Plan `spec` on its GPU, on `gpu_memory` bytes of one, or on the catalogue's `gpu`; `measured` (a run's
    figures, jobspec.plan.calibration) corrects the per-sample bytes and replaces the speed where it has them."""
    hw = spec.hardware
    info = gpu or (gpu_catalogue.lookup(hw.gpus.type) if hw.gpus.type else None)
    if gpu is not None:
        gpu_bytes, label = gpu.memory_bytes, f"{gpu.name} {gpu.memory_bytes / GiB:.0f} GiB"
    elif gpu_memory is not None:
        gpu_bytes = gpu_memory_bytes(gpu_memory)
        label = f"{gpu_bytes / GiB:g} GiB (--gpu-memory)"
    elif hw.gpus.memory_bytes:
        gpu_bytes, label = hw.gpus.memory_bytes, f"{hw.gpus.type or 'GPU'} {hw.gpus.memory_bytes / GiB:.0f} GiB"
    else:
        raise ConfigError(
            f"{spec.name}: no GPU memory to plan against (hardware.vendor {hw.vendor}, no hardware.gpus.type); "
            "pass --gpu-memory 24Gi, --gpus any, or set hardware.gpus.type / hardware.gpus.memory"
        )
    shape = model_shape(spec)
    precision = planned_precision(spec)
    kw = estimate_kwargs(spec, spec.world_size, precision)
    # A model no GPU could hold at any tier is a bad config (exit 2); one this GPU cannot hold is "nothing fits"
    # (exit 4: the table shows the tiers and their bytes, and a larger GPU is the fix).
    largest = max(gpu_catalogue.catalogue(), key=lambda g: g.memory_bytes)
    device, where = max(gpu_bytes, largest.memory_bytes), f"{model_label(spec)} (even on {largest.name})"
    capacity.check(shape, device_bytes=device, host_bytes=None, where=where, **kw)
    scale, notes = calibration.scales(shape, measured or {}, **kw)
    plans = memory.plan_all(
        shape,
        gpu_bytes=gpu_bytes,
        global_batch=spec.training.global_batch,
        utilization=spec.memory.target_utilization,
        sample_scale=scale,
        micro_batch=fixed_micro_batch(spec),
        **kw,
    )
    plans = [host_checked(p, spec) for p in plans]
    if spec.memory.tier == "auto":
        chosen = memory.pick_tier(plans)
    else:
        chosen = next(p for p in plans if p.tier == spec.memory.tier)
    length = length or job_length(spec, rows)
    peak, note = _peak(info, precision)
    times = {}
    if peak is not None:
        lora = lora_shape(spec)
        for p in plans:
            if p.fits:
                flops = throughput.flops_per_token(
                    shape, spec.data.max_seq_len, lora=lora, checkpointing=p.estimate.checkpointing
                )
                times[p.tier] = throughput.step_time(
                    flops,
                    tier=p.tier,
                    tokens_per_step=length.tokens_per_step,
                    world_size=spec.world_size,
                    peak_tflops=peak,
                    steps=length.steps,
                )
    for p in plans:  # a measured speed replaces the estimate
        m = (measured or {}).get(p.tier)
        if p.fits and m is not None and m.step_seconds:
            model = times.get(p.tier)
            times[p.tier] = throughput.measured_time(p.tier, m.step_seconds, length.tokens_per_step, length.steps,
                                                     model_mfu=model.mfu if model else None)  # fmt: skip
            old = f"{model.step_seconds:.3g} s estimated" if model else "no estimate"
            notes.append(f"{p.tier}: {m.step_seconds:.3g} s a step measured ({old}) over {m.records} records")
    reference = {}
    if peak is not None and length.reference_tokens is not None:  # DPO's reference pass, one forward over the pairs
        forward = throughput.forward_flops(shape, spec.data.max_seq_len, lora=lora_shape(spec))
        reference = {p.tier: throughput.pass_seconds(forward, tokens=length.reference_tokens, tier=p.tier,
                                                     world_size=spec.world_size, peak_tflops=peak)
                     for p in plans if p.fits}  # fmt: skip
    price = (prices or {}).get(info.name) if info else None
    runs = _runs(spec, plans, chosen)
    return PlanReport(spec, shape, gpu_bytes, label, plans, chosen, runs, length, info, peak, note, times, price,
                      notes, reference=reference)  # fmt: skip


def _peak(info: gpu_catalogue.GpuInfo | None, precision: str) -> tuple[float | None, str]:
    if precision == "fp32":
        return None, "no time estimate for training.precision fp32 (the catalogue holds 16-bit peaks)"
    if info is None or info.tflops16 is None:
        return None, "no time estimate: name a catalogue GPU (hardware.gpus.type or --gpus) for its peak"
    return info.tflops16, ""


def _runs(spec: JobSpec, plans: list[memory.TierPlan], chosen: memory.TierPlan | None) -> memory.TierPlan | None:
    """The tier the runner ends up training at: the chosen one, else (memory.fallback) the next that fits."""
    if chosen is None or chosen.fits:
        return chosen
    if spec.memory.tier == "auto" or not spec.memory.fallback:
        return None
    by_tier, tier = {p.tier: p for p in plans}, chosen.tier
    while (step := tiers.next_tier(tier, spec.world_size)) is not None:
        tier = step
        if by_tier[tier].fits:
            return by_tier[tier]
    return None
