"""`jobspec plan`'s table: memory, speed and duration per tier, and the time model's assumptions."""

from __future__ import annotations

from jobspec.catalog.presets import ModelShape
from jobspec.plan import memory, throughput
from jobspec.plan.planner import GiB, PlanReport, assumptions, lora_shape
from jobspec.spec.models import REFERENCE_OBJECTIVES


def plan_table(report: PlanReport) -> str:
    spec = report.spec
    head = (
        f"{spec.name}: {report.shape.params / 1e6:,.0f}M params, seq {spec.data.max_seq_len}, "
        f"global batch {spec.training.global_batch} over {spec.world_size} rank(s), {report.gpu_label} per GPU"
    )
    priced = report.price is not None
    dpo = spec.training.objective in REFERENCE_OBJECTIVES  # DPO's, IPO's, KTO's reference pass, once before training
    rows = [("tier", "GiB/GPU", "host GiB", "fits", "micro", "accum", "ckpt", "step", "tok/s", "MFU", "time")]
    rows[0] += ("ref pass",) * dpo + ("cost",) * priced + ("note",)
    for p in report.plans:
        mark = "<- " + ("auto" if spec.memory.tier == "auto" else "spec") if p is report.chosen else ""
        if p is report.runs and p is not report.chosen:
            mark = "<- runs here (memory.fallback)"
        t = report.times.get(p.tier)
        cost = report.tier_cost(p.tier)
        rows.append(
            (
                p.tier,
                f"{p.estimate.gpu_bytes / GiB:.1f}",
                f"{p.estimate.host / GiB:.1f}" if p.estimate.host else "-",
                "yes" if p.fits else "no",
                str(p.micro_batch or "-"),
                str(p.grad_accum or "-"),
                "yes" if p.estimate.checkpointing else "no",
                f"{t.step_seconds:.3g} s" if t else "-",
                f"{t.tokens_per_second:,.0f}" if t else "-",
                f"{t.mfu:.0%}" if t else "-",
                throughput.format_duration(t.total_seconds) if t else "-",
                *((throughput.format_duration(report.reference.get(p.tier)),) if dpo else ()),
                *((f"{cost:,.2f}" if cost is not None else "-",) if priced else ()),
                "  ".join(filter(None, (p.reason, f"{p.quantize} base" if p.quantize else "", mark))),
            )
        )
    lines = [head, "", *format_columns(rows)]
    if report.runs is None:
        lines.append("\nnothing fits: use a larger GPU, more GPUs, a shorter data.max_seq_len, or LoRA")
    elif report.chosen is not report.runs and report.chosen is not None:
        lines.append(f"\ntier {report.chosen.tier} does not fit: memory.fallback steps down to {report.runs.tier}")
    lines += [f"{p.tier}: {p.note}" for p in report.plans if p.note]  # `model.quantize: auto`'s choices
    budget = f"{spec.memory.target_utilization:.0%}"
    fixed = next((p for p in report.plans if p.fixed), None)
    if fixed is not None:
        spare = ", ".join(f"{p.tier} {p.margin / GiB:+.1f}" for p in report.plans)
        lines.append(
            f"\nmicro-batch {fixed.estimate.micro_batch} from the spec (training.micro_batch); GiB to spare at it "
            f"(negative: short): {spare}"
        )
        lines.append(f"GiB/GPU is at that micro-batch; sized to {budget} of the GPU.")
    else:
        lines.append(f"\nGiB/GPU is at the micro-batch shown (1 when nothing fits); sized to {budget} of the GPU.")
    eight = [p.tier for p in report.plans if p.optimizer == "adamw_8bit"]
    if spec.training.optimizer == "sgd":
        lines.append("optimizer: sgd (training.optimizer): plain SGD, no optimizer state on the GPU or the host")
    elif spec.training.optimizer != "adamw":
        where = ", ".join(eight) if eight else "none of the tiers"
        lines.append(f"optimizer: {spec.training.optimizer} (training.optimizer): Adam's moments in 8 bits at {where}, "
                     "with the step's fp32 working copies of the largest parameter; fp32 moments elsewhere (the "
                     "offload tiers keep theirs on the host)")  # fmt: skip
    if report.measured:
        lines.append("\nmeasured (--from): " + "\n  ".join(report.measured))
    if report.traced:
        lines.append("\ntraced (--trace): the runner's own step on fake tensors, GiB per GPU without context and "
                     "fragmentation, against the model's same terms:")  # fmt: skip
        for p in report.plans:
            row = report.traced.get(p.tier)
            if row:
                model = (p.estimate.gpu_bytes - p.estimate.overhead) / GiB
                off = model * GiB / row["peak"] - 1
                lines.append(f"  {p.tier:14s} micro-batch {row['micro_batch']:<5} traced {row['peak'] / GiB:7.2f}  "
                             f"model {model:7.2f}  ({off:+.1%})  {row['seconds']:.1f} s")  # fmt: skip
    return "\n".join([*lines, *time_notes(report)])


def format_columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns; the last (the note) unpadded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]).rstrip() for r in rows]


def time_notes(report: PlanReport, peak: str | None = None) -> list[str]:
    """The time model and its assumptions, stated under the table (`peak`: how to name the GPU's peak)."""
    if report.peak_tflops is None:
        return [report.time_note]
    spec, a = report.spec, assumptions(report)
    flops = throughput.flops_per_token(report.shape, a["s"], lora=lora_shape(spec), checkpointing=False).model
    eff = ", ".join(f"{t} {e:.0%}" for t, e in throughput.EFFICIENCY.items())
    length = report.length
    attention = f"6·{a['L']}·{a['h']}·{a['s']}"
    if spec.model.lora:  # the frozen base needs no weight gradients
        adapters = memory.trainable_params(report.shape, lora_shape(spec))
        formula = f"4N + 6·adapters + 6·L·h·s = 4·{a['N'] / 1e6:,.0f}M + 6·{adapters / 1e6:,.1f}M + {attention}"
    else:
        formula = f"6N + 6·L·h·s = 6·{a['N'] / 1e6:,.0f}M + {attention}"
    gpu = f"{report.gpu.name} " if report.gpu and peak is None else ""
    lines = [
        f"time: FLOPs/token {formula} = {flops / 1e9:,.2f} GFLOP (N: weights in matmuls, "
        f"L layers{_linear(report.shape)}, h hidden, s seq)",
        "  activation checkpointing (ckpt yes) runs the forward again: a third more work (half with LoRA)",
        f"  tokens/step {spec.training.global_batch}{_rows(spec.training.objective, a['rows'])} x "
        f"{spec.data.max_seq_len}: every row full length (an upper bound unless data.packing)",
        f"  peak: {peak or f'{gpu}{report.peak_tflops:g} TFLOPS'} (dense 16-bit, datasheet) per GPU "
        f"x {spec.world_size}; assumed share of peak: {eff}; communication hidden",
    ]
    if length:
        total = f" = {length.steps * length.tokens_per_step:,} tokens" if length.steps else ""
        lines.append(f"  job: {length.how}{total}")
    if spec.training.objective in REFERENCE_OBJECTIVES and length:
        forward = throughput.forward_flops(report.shape, a["s"], lora=lora_shape(spec))
        tokens = f" = {length.reference_tokens:,} tokens" if length.reference_tokens is not None else ""
        share = forward / flops  # a third of a full step's work; half of a LoRA step's (no weight gradients)
        name = spec.training.objective.upper()
        lines.append(f"  ref pass ({name}, once before training): the starting model forward only, 2N + 2·L·h·s = "
                     f"{forward / 1e9:,.2f} GFLOP/token ({share:.0%} of a step's), over {length.reference_how}{tokens},"
                     " shared by the ranks; not in the time column")  # fmt: skip
    return lines


def _rows(objective: str, rows: int) -> str:
    """What a sample's rows are: a pair's chosen and rejected chats, a KTO record and its KL row, or a GRPO prompt's
    group of completions (the sampling itself not counted: its forwards hold no gradients)."""
    if objective == "grpo":
        return f" prompts x {rows} completions (their sampling not counted)"
    if rows == 1:
        return ""
    return " records x 2 rows (with the KL row)" if objective == "kto" else " pairs x 2 rows"


def _linear(shape: ModelShape) -> str:
    """What L leaves out in a model with linear-attention layers (their work is in N)."""
    return f" with softmax attention, {len(shape.linear_at)} linear ones in N" if shape.linear else ""
