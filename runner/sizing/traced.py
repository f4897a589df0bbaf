"""The starting micro-batch from a trace of the runner's own step, where time allows (`memory.trace`).

The memory model (jobspec/plan/memory.py) is fitted to traces of this step and stays within a few percent of them
on the shapes it was fitted on; a model it was not fitted on may differ more. With `memory.trace` (auto: on a GPU,
unless the spec fixes the micro-batch) rank 0 traces the planned tier at two micro-batches in a process of its own
(runner/train/trace.py builds a fake process group, and this process has a real one), within
`memory.trace_seconds`. The peak is affine in the micro-batch once the activations dominate, so the line through
the two traces gives the bytes at any micro-batch: every rank sizes its micro-batch from rank 0's line, by the
model's own budget rule (its fixed 1 GiB and 5 % allowance on top of the traced bytes, which leave them out), and
the probe steps then verify it as they verify the model's. A trace that fails or runs out of time is logged and
the model's plan kept; so is a tier this run directory measured on the GPU before (its measured peak corrects the
model: runner/sizing/plan.py `_measured_scale`, and beats any trace). Under `memory.tier: auto`, a tier the model
chose but the trace fits no micro-batch of is left for the next one, traced in turn.

Start-up does not trace what it need not (issue 41: a 1B model's two traces took 33-35 s of a 57-67 s start-up on
an H200): under `memory.trace: auto` no trace runs when the model's plan takes the whole per-rank batch within
`CLEAR_MARGIN` of the budget on every rank (a trace could not raise it; the probe steps verify it), and a line traced
before for the same step is read back from runner/sizing/trace_cache.py (content-addressed, beside the data cache).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from jobspec.catalog.tiers import SHARD_ONLY, TIERS, divisors
from jobspec.errors import JobspecError
from jobspec.plan import memory
from jobspec.plan.planner import lora_shape, model_shape, rows_per_sample
from jobspec.plan.traced import TraceFailed, run_trace
from jobspec.spec.models import JobSpec
from jobspec.spec.units import human_bytes as gib
from runner.data.cache import usable_root
from runner.phase import phase
from runner.sizing import trace_cache
from runner.sizing.plan import Plan, with_micro_batch

log = logging.getLogger("jobspec.runner")
CLEAR_MARGIN = 0.8  # the model's plan at the whole per-rank batch within this share of the budget: no trace needed
Share = Callable[[Sequence[float]], Sequence[float]]  # all-reduce MAX over ranks (rank 0 sends, the others 0)


def wanted(spec: JobSpec, on_gpu: bool) -> bool:
    """Whether this run sizes its micro-batch from a trace: `memory.trace` on, or auto on a GPU; never when the
    spec fixes the micro-batch (nothing to choose)."""
    if spec.memory.trace == "off" or isinstance(spec.training.micro_batch, int):
        return False
    return spec.memory.trace == "on" or on_gpu


def trace_line(
    spec: JobSpec,
    tier: str,
    world_size: int,
    precision: str,
    micro_batches: tuple[int, int],
    timeout_s: float,
    quantize: str | None = None,
) -> tuple[int, int]:
    """(bytes at micro-batch 0, bytes per sample) on the line through traces of `tier` at two micro-batches; the
    spec as this process has it (overrides and a hub model's local snapshot included) goes to the trace as a file,
    with the base the plan holds (`quantize`: `model.quantize: auto` decided per tier)."""
    with tempfile.TemporaryDirectory(prefix="jobspec-trace-") as tmp:
        path = Path(tmp) / "spec.yaml"
        path.write_text(yaml.safe_dump(trace_spec(spec, quantize), sort_keys=False))
        rows = run_trace(str(path), (), [(tier, m) for m in micro_batches], world_size, precision, timeout_s)
    (m1, p1), (m2, p2) = sorted((int(r["micro_batch"]), int(r["peak"])) for r in rows)
    if m2 == m1 or p2 <= p1:
        raise TraceFailed(f"the traced peak does not grow from micro-batch {m1} ({p1:,} B) to {m2} ({p2:,} B)")
    per_sample = math.ceil((p2 - p1) / (m2 - m1))
    return max(0, p1 - per_sample * m1), per_sample


def trace_spec(spec: JobSpec, quantize: str | None) -> dict[str, Any]:
    """The spec as the trace process reads it: with the base the plan holds (`model.quantize: auto` decided)."""
    data = spec.to_yaml_dict()
    if spec.model.lora is not None:
        data["model"] = {**data["model"], "quantize": quantize or "none"}
    return data


def skipped(plan: Plan, why: str, *, warn: bool = False) -> Plan:
    """`plan` as the model made it, with the reason there is no trace in its log."""
    note = f"trace: none ({why}); the model's micro-batch {plan.micro_batch} kept"
    log.log(logging.WARNING if warn else logging.INFO, "plan: %s", note)
    return dataclasses.replace(plan, reasons=(*plan.reasons, note))


def _with_overhead(traced: int) -> int:
    """Traced bytes with the model's allowance on top (memory.overhead_bytes)."""
    return traced + memory.overhead_bytes(traced)


def from_traces(plan: Plan, spec: JobSpec, share: Share, *, is_main: bool, replan: Callable[[str], Plan]) -> Plan:
    """`plan` at the largest micro-batch the traced line fits in its budget (a divisor of the per-rank batch), the
    same on every rank (rank 0 traces, `share` hands its line to all); `plan` as it was when the trace fails. Under
    `memory.tier: auto`, the next tier (`replan`: the model's plan there) whenever the trace says not even
    micro-batch 1 fits the tier the model chose, within `memory.trace_seconds` in all: the tier is then the trace's
    choice as well as the micro-batch. Every rank takes the same steps (each decision comes from rank 0's shared
    line); the last tier traced, or the model's plan of it, when time or tiers run out."""
    clear = plan.micro_batch == plan.per_rank and plan.estimated_bytes <= CLEAR_MARGIN * plan.budget_bytes
    # `memory.trace: auto` only (`on` asks for the trace); one all-reduce: every rank has the margin, or none skips
    if spec.memory.trace == "auto" and not share([0.0 if clear else 1.0])[0]:
        return skipped(plan, f"the model fits the whole per-rank batch ({plan.micro_batch}) in "
                             f"{plan.estimated_bytes / max(plan.budget_bytes, 1):.0%} of the budget: a trace could not "
                             "raise it, and the probe steps verify it")  # fmt: skip
    deadline = time.monotonic() + float(spec.memory.trace_seconds)
    sized, top = _traced(plan, spec, share, is_main=is_main, timeout_s=float(spec.memory.trace_seconds))
    alone = plan.world_size == 1  # sharding without offload saves nothing on one rank (the model's auto skips it)
    later = [t for t in TIERS[TIERS.index(plan.tier) + 1 :] if not (alone and t in SHARD_ONLY)]
    while spec.memory.tier == "auto" and top == 0 and later:
        left = deadline - time.monotonic()
        tier = later.pop(0)
        nxt = replan(tier)
        why = f"the trace of tier {sized.tier} fits no micro-batch: tier {tier}, by the model and then the trace"
        nxt = dataclasses.replace(nxt, reasons=(*nxt.reasons, why))
        log.info("plan: %s", why)
        sized, top = _traced(nxt, spec, share, is_main=is_main, timeout_s=left)
    return sized


def _traced(plan: Plan, spec: JobSpec, share: Share, *, is_main: bool, timeout_s: float) -> tuple[Plan, int | None]:
    """(`plan` sized from rank 0's traced line, the largest micro-batch the line fits: 0 for none), or (`plan` with
    the reason, None) when rank 0 could not trace within `timeout_s`."""
    line, why = [0.0, 0.0], ""
    m1 = max(1, plan.micro_batch)
    if is_main:
        digest, parts = trace_cache.key(trace_spec(spec, plan.quantize), tier=plan.tier, world_size=plan.world_size,
                                        precision=plan.precision, micro_batches=(m1, 2 * m1),
                                        quantize=plan.quantize)  # fmt: skip
        root = usable_root(spec)
        hit = trace_cache.read(root, digest)
        if hit is not None:
            line = [float(hit[0]), float(hit[1])]
            log.info("plan: trace of tier %s at micro-batches %d and %d from the cache %s", plan.tier, m1, 2 * m1,
                     trace_cache.path(root, digest))  # type: ignore[arg-type]  # fmt: skip
        else:
            with phase("plan: tracing tier %s at micro-batches %d and %d", plan.tier, m1, 2 * m1):
                try:
                    if timeout_s < 1:
                        raise TraceFailed(f"no time left of memory.trace_seconds {spec.memory.trace_seconds}")
                    fixed, per_sample = trace_line(spec, plan.tier, plan.world_size, plan.precision, (m1, 2 * m1),
                                                   timeout_s, plan.quantize)  # fmt: skip
                    line = [float(fixed), float(per_sample)]
                    trace_cache.write(root, digest, fixed, per_sample, parts)
                except (TraceFailed, JobspecError, OSError) as err:
                    why = str(err).splitlines()[0]
    fixed, per_sample = (int(x) for x in share(line))
    if per_sample <= 0:
        return skipped(plan, why or "rank 0 could not trace", warn=True), None
    if plan.optimizer != "adamw":  # the trace steps AdamW (torchao's compiled step runs on no fakes)
        fixed += memory.optimizer_change(model_shape(spec), plan.tier, plan.world_size, lora_shape(spec), plan.quantize,
                                         plan.optimizer)  # fmt: skip
    if spec.training.objective == "grpo":  # each prompt's rows are sampled first: their KV cache, where larger
        rows = rows_per_sample(spec)
        per_sample = max(per_sample, memory.sampling_bytes(model_shape(spec), rows * spec.data.max_seq_len, rows,
                                                           plan.precision))  # fmt: skip
    top = 0
    while _with_overhead(fixed + per_sample * (top + 1)) <= plan.budget_bytes:
        top += 1
        if top >= plan.per_rank:  # nothing above the per-rank batch is of use
            break
    mbs = max((d for d in divisors(plan.per_rank) if d <= top), default=1)
    traced = dataclasses.replace(
        plan,
        fixed_bytes=_with_overhead(fixed),
        per_sample_bytes=per_sample + per_sample * memory.OVERHEAD_PERCENT // 100,
        model_max_micro_batch=top,
    )
    fits = "" if top else "; not even micro-batch 1 fits by the trace: probe steps decide"
    reason = (
        f"micro-batch {plan.micro_batch} -> {mbs} from the trace of tier {plan.tier}: {gib(traced.fixed_bytes)} + "
        f"{gib(traced.per_sample_bytes)} per sample with the overhead (the model: {gib(plan.fixed_bytes)} + "
        f"{gib(plan.per_sample_bytes)}), {top} fit {gib(plan.budget_bytes)}{fits}"
    )
    return with_micro_batch(traced, mbs, reason), top
