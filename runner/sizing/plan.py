"""The run's plan: tier, micro-batch, gradient accumulation, precision and dataloader settings.

`initial_plan` asks the memory model for the cheapest tier and largest micro-batch that fit the probed
device, `verify_micro_batch` checks the guess with real steps, `agree` makes all ranks use one plan. The
effective batch never changes: micro_batch (a divisor of the per-rank batch) * grad_accum * world_size ==
global_batch. Every decision is logged ("jobspec.runner") and kept in `Plan.reasons` with its numbers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobspec.catalog import tiers
from jobspec.catalog.presets import ModelShape
from jobspec.contract import EXIT_OOM_LAST_TIER, EXIT_OOM_RETRY_TIER, METRICS_FILE, TIER_STATE_FILE
from jobspec.errors import ConfigError, JobspecError
from jobspec.plan import calibration, capacity, memory
from jobspec.plan.planner import estimate_kwargs, fixed_micro_batch, model_label, model_shape
from jobspec.spec.models import JobSpec
from jobspec.spec.units import human_bytes as gib
from runner.sizing.hostmem import HOST_OFFLOAD_SHARE, HOST_PROCESS_BYTES, HostInfo, loader_settings, offload_fits
from runner.sizing.probe import DeviceInfo, largest_passing, resolve_precision

log = logging.getLogger("jobspec.runner")
PRECISIONS = ("bf16", "fp16", "fp32")


class NoFit(JobspecError):
    """Micro-batch 1 does not fit at this tier: the OOM ladder moves to `next_tier` (None: nothing left)."""

    def __init__(self, tier: str, message: str, world_size: int):
        super().__init__(message)
        self.tier = tier
        self.next_tier = tiers.next_tier(tier, world_size)
        self.exit_code = EXIT_OOM_RETRY_TIER if self.next_tier else EXIT_OOM_LAST_TIER


@dataclass(frozen=True)
class Plan:
    """What one rank runs. Persisted with the checkpoints (`to_dict`) so a resume uses the same plan."""

    tier: str
    micro_batch: int  # samples per forward pass on one rank
    grad_accum: int  # micro-batches per optimizer step
    global_batch: int  # samples per optimizer step over all ranks (the spec's, never changed)
    world_size: int
    checkpointing: bool  # activation (gradient) checkpointing
    precision: str  # autocast dtype: bf16 | fp16 | fp32
    num_workers: int  # DataLoader workers per rank
    pin_memory: bool
    seq_len: int  # the longest sequence: what the plan and the probe steps are sized at
    estimated_bytes: int  # memory model's GPU bytes at micro_batch (host bytes on CPU)
    budget_bytes: int  # target_utilization x free memory at probe time
    fixed_bytes: int = 0  # model's bytes at micro-batch 0: states + overhead
    per_sample_bytes: int = 0  # model's bytes each sample of the micro-batch adds
    model_max_micro_batch: int = 0  # largest micro-batch the model says fits, before rounding to a divisor
    micro_batch_fixed: bool = False  # set in the spec: never raised, only lowered when it does not fit
    probes: int = 0  # real probe steps run by verify_micro_batch
    reasons: tuple[str, ...] = field(default_factory=tuple)
    quantize: str | None = None  # the LoRA base's blocks in 4 bits ("nf4": `model.quantize`), None: 16 bits
    optimizer: str = "adamw"  # the optimizer's states at this tier: "adamw_8bit" as `training.optimizer` planned

    def __post_init__(self) -> None:
        if self.tier not in tiers.TIERS or self.precision not in PRECISIONS:
            raise ValueError(f"plan: tier {self.tier!r} / precision {self.precision!r} unknown")
        if self.world_size < 1 or self.global_batch % self.world_size:
            raise ValueError(f"plan: global batch {self.global_batch} does not split over {self.world_size} ranks")
        if self.micro_batch < 1 or self.micro_batch * self.grad_accum * self.world_size != self.global_batch:
            raise ValueError(
                f"plan: micro-batch {self.micro_batch} x accumulation {self.grad_accum} x {self.world_size} ranks "
                f"!= global batch {self.global_batch}"
            )

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if unknown := sorted(set(data) - {f.name for f in dataclasses.fields(cls)}):
            raise ValueError(f"plan: unknown keys {unknown} (written by a newer jobspec?)")
        return cls(**{**data, "reasons": tuple(data.get("reasons", ()))})


def _note(reasons: list[str], text: str) -> None:
    log.info("plan: %s", text)
    reasons.append(text)


def _amend(plan: Plan, reason: str, **changes: Any) -> Plan:
    _note(reasons := list(plan.reasons), reason)
    return dataclasses.replace(plan, reasons=tuple(reasons), **changes)


def with_micro_batch(plan: Plan, micro_batch: int, reason: str, **changes: Any) -> Plan:
    """The plan at another micro-batch (a divisor of the per-rank batch, else ValueError), accumulation recomputed."""
    est = plan.fixed_bytes + plan.per_sample_bytes * micro_batch  # the model's line (runner.sizing.plan._sized)
    accum = plan.per_rank // micro_batch
    return _amend(plan, reason, micro_batch=micro_batch, grad_accum=accum, estimated_bytes=est, **changes)


def _local(device: DeviceInfo, world_size: int, local_ranks: int | None) -> int:
    """Training processes on this node: given, else one per visible GPU (all of them on CPU)."""
    return local_ranks or (max(1, min(world_size, device.count)) if device.is_gpu else world_size)


def _inputs(spec: JobSpec, device: DeviceInfo, world_size: int, local: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(memory.estimate keywords, plan_tier's budget keywords), the same for every tier; checks the batch."""
    gb, mbs = spec.training.global_batch, spec.training.micro_batch
    if world_size < 1 or gb % world_size:
        raise ConfigError(f"training.global_batch {gb} does not split over {world_size} ranks")
    if isinstance(mbs, int) and (gb // world_size) % mbs:
        msg = f"training.micro_batch {mbs} does not divide the per-rank batch {gb // world_size} ({gb} / {world_size})"
        raise ConfigError(msg)
    precision = resolve_precision(spec.training.precision, device)[0]  # fp32 keeps activations twice as wide
    est = estimate_kwargs(spec, world_size, precision)
    # On CPU the ranks of this node share the host memory the probe reported.
    free = device.free_bytes if device.is_gpu else device.free_bytes // local
    return est, dict(gpu_bytes=free, global_batch=gb, utilization=spec.memory.target_utilization)


def _micro_batch(asked: int | str, per_rank: int, tp: memory.TierPlan, per_sample: str, budget: str) -> tuple[int, str]:
    """(micro-batch, reason): the spec's number, or the model's largest divisor of `per_rank` that fits."""
    if isinstance(asked, int):
        fit = "fits" if asked <= tp.max_micro_batch else "does NOT fit; probe steps decide"
        return asked, f"micro-batch {asked} from the spec: the model {fit} (max {tp.max_micro_batch}, {budget})"
    if not tp.fits:
        return 1, f"micro-batch auto -> 1 at tier {tp.tier}: the model says none fits ({tp.reason}); probes decide"
    mbs, top = tp.micro_batch, tp.max_micro_batch
    cap = "" if mbs == top else ", capped at the per-rank batch" if mbs == per_rank else f" -> {mbs}, largest divisor"
    return mbs, f"micro-batch auto -> {mbs} of {per_rank}: {budget} / {per_sample} = {top}{cap}"


def _sized(shape: ModelShape, tier: str, kw: dict[str, Any], bkw: dict[str, Any]) -> tuple[memory.TierPlan, int, int]:
    """(tier plan, fixed bytes, bytes per sample) from the memory model."""
    tp = memory.plan_tier(shape, tier=tier, **kw, **bkw)
    kw["quantize"] = tp.quantize  # `model.quantize: auto` decided at this tier
    kw["optimizer"] = tp.optimizer  # and `training.optimizer: auto`
    # the line through micro-batch 0 and the model's largest: the loss's one chunk of logits makes the first
    # samples dearer than the later ones, so the slope of the first alone would understate what fits
    top = max(1, min(tp.max_micro_batch, bkw["global_batch"]))
    e0, top_e = (memory.estimate(shape, tier=tier, micro_batch=m, **kw) for m in (0, top))
    return tp, e0.gpu_bytes, -(-(top_e.gpu_bytes - e0.gpu_bytes) // top)


def size_for_tier(
    spec: JobSpec,
    device: DeviceInfo,
    host: HostInfo,
    world_size: int,
    tier: str,
    *,
    local_ranks: int | None = None,
    reasons: Iterable[str] = (),
    low_bit: Collection[str] = (),
) -> Plan:
    """The plan at a given tier (the OOM ladder re-plans here after stepping down a tier). `low_bit`: the tiers whose
    AdamW moments ran out at micro-batch 1 before (runner/oom/ladder.py `low_bit_tiers`), planned with 8-bit ones
    under `training.optimizer: auto`."""
    gb, local, notes = spec.training.global_batch, _local(device, world_size, local_ranks), list(reasons)
    kw, bkw = _inputs(spec, device, world_size, local)
    if tier in low_bit and kw["optimizer"] == "auto":
        kw["optimizer"] = "adamw_8bit"
        _note(notes, f"optimizer auto -> adamw_8bit: AdamW's fp32 moments ran out at micro-batch 1 at tier {tier} "
                     f"({TIER_STATE_FILE})")  # fmt: skip
    per_rank_batch, shape = gb // world_size, model_shape(spec)
    if device.is_gpu:
        kw["sample_scale"] = _measured_scale(spec, shape, tier, kw, notes)
    precision, why_precision = resolve_precision(spec.training.precision, device)
    tp, fixed, per_sample = _sized(shape, tier, kw, bkw)
    if tp.note:
        _note(notes, tp.note)
    free, where = gib(bkw["gpu_bytes"]), "free" if device.is_gpu else f"host / {local} ranks"
    budget = f"({gib(tp.budget)} budget [{bkw['utilization']:.2f} x {free} {where}] - {gib(fixed)} states+overhead)"
    wide = " (fp32: activations x2)" if precision == "fp32" else ""
    sample = f"{gib(per_sample)} per sample at seq {kw['seq_len']}{wide}"
    mbs, why = _micro_batch(spec.training.micro_batch, per_rank_batch, tp, sample, budget)
    _note(notes, why)
    offload = f"tier {tier} offloads {gib(tp.estimate.host)} per rank x {local} to {gib(host.available_bytes)} of host"
    if tp.estimate.host and not offload_fits(tp.estimate.host, local, host):
        _note(notes, offload + ": expect a host OOM")
    _note(notes, why_precision)
    estimated = memory.estimate(shape, tier=tier, micro_batch=mbs, grad_accum=per_rank_batch // mbs, **kw).gpu_bytes
    need = HOST_PROCESS_BYTES + tp.estimate.host if device.is_gpu else estimated
    nw = None if spec.data.num_workers == "auto" else spec.data.num_workers
    loader = loader_settings(host, on_gpu=device.is_gpu, local_ranks=local, need_per_rank=need, requested=nw)
    for text in loader.reasons:
        _note(notes, text)
    return Plan(
        tier=tier, micro_batch=mbs, grad_accum=per_rank_batch // mbs, global_batch=gb, world_size=world_size,
        checkpointing=tp.estimate.checkpointing, precision=precision, num_workers=loader.num_workers,
        pin_memory=loader.pin_memory, seq_len=spec.data.max_seq_len, estimated_bytes=estimated,
        budget_bytes=tp.budget, fixed_bytes=fixed, per_sample_bytes=per_sample,
        model_max_micro_batch=tp.max_micro_batch, micro_batch_fixed=isinstance(spec.training.micro_batch, int),
        reasons=tuple(notes), quantize=tp.quantize, optimizer=tp.optimizer,
    )  # fmt: skip


def _measurement(spec: JobSpec, tier: str) -> calibration.Measured | None:
    """What an earlier run in this run directory measured at `tier` on a GPU, if it did."""
    metrics = Path(spec.run_dir) / METRICS_FILE
    if not metrics.is_file():
        return None
    try:
        measured = calibration.read_run(metrics.parent).get(tier)
    except JobspecError:
        return None
    return measured if measured is not None and measured.device == "cuda" else None


def measured_here(spec: JobSpec, tier: str) -> bool:
    """Whether an earlier run in this run directory measured its GPU peak at `tier`: a measurement beats a trace."""
    return _measurement(spec, tier) is not None


def _measured_scale(spec: JobSpec, shape: ModelShape, tier: str, kw: dict[str, Any], notes: list[str]) -> float:
    """The per-sample correction an earlier run in this run directory measured at `tier` on a GPU (the same
    one `jobspec plan --from` applies; jobspec/plan/calibration.py), else 1."""
    measured = _measurement(spec, tier)
    if measured is None:
        return 1.0
    scale, line = calibration.sample_scale(shape, measured, **kw)
    if scale is None:
        return 1.0
    _note(notes, f"per-sample bytes x{scale:.2f} from this run directory's earlier measurement ({line})")
    return scale


def choose_tier(spec: JobSpec, device: DeviceInfo, host: HostInfo, world_size: int, local: int) -> tuple[str, str]:
    """(tier, reason): the spec's tier, or for `auto` the cheapest the memory model says fits."""
    if spec.memory.tier != "auto":
        return spec.memory.tier, f"tier {spec.memory.tier} from the spec"
    if not device.is_gpu:
        return "fast", "tier auto -> fast: CPU, one process per rank, nothing to shard or offload"
    kw, bkw = _inputs(spec, device, world_size, local)
    plans = memory.plan_all(model_shape(spec), **kw, **bkw, micro_batch=fixed_micro_batch(spec))
    skipped: list[str] = []
    for tp in plans:
        if tp.useful and tp.fits and offload_fits(tp.estimate.host, local, host):
            why = "; ".join(skipped) or "the cheapest"
            return tp.tier, (
                f"tier auto -> {tp.tier}: {gib(tp.estimate.gpu_bytes)} at micro-batch {tp.micro_batch} "
                f"of {gib(tp.budget)} budget ({why})"
            )
        host_why = f"host RAM {gib(tp.estimate.host * local)} > {HOST_OFFLOAD_SHARE} x {gib(host.available_bytes)}"
        skipped.append(f"{tp.tier}: {tp.reason or host_why}")
    last = next(tp.tier for tp in reversed(plans) if tp.useful)
    return last, f"tier auto -> {last}: no tier fits per the model ({'; '.join(skipped)}); probe steps decide"


def check_capacity(spec: JobSpec, device: DeviceInfo, host: HostInfo, world_size: int, local: int) -> None:
    """ConfigError (exit 2) before the model is built when its states fit no tier of this device and host
    (jobspec.plan.capacity; `jobspec plan` makes the same check). On CPU the ranks share the host memory."""
    kw, _ = _inputs(spec, device, world_size, local)
    per_rank_host = host.available_bytes // local
    if device.is_gpu:
        capacity.check(model_shape(spec), device_bytes=device.total_bytes, host_bytes=per_rank_host,
                       where=model_label(spec), **kw)  # fmt: skip
    else:
        capacity.check(model_shape(spec), device_bytes=per_rank_host, host_bytes=None, where=model_label(spec),
                       tier_names=("fast",), **kw)  # fmt: skip


def initial_plan(
    spec: JobSpec, device: DeviceInfo, host: HostInfo, world_size: int, *, local_ranks: int | None = None,
    low_bit: Collection[str] = (),
) -> Plan:
    """Tier, micro-batch, accumulation, precision and loader settings from the spec and the probes.

    `local_ranks`: training processes on this node (default: one per visible GPU up to world_size;
    on CPU all of world_size), which share the host's CPUs and memory. `low_bit`: as `size_for_tier`'s.
    """
    local = _local(device, world_size, local_ranks)
    check_capacity(spec, device, host, world_size, local)
    tier, why = choose_tier(spec, device, host, world_size, local)
    log.info("plan: %s", why)
    return size_for_tier(spec, device, host, world_size, tier, local_ranks=local, reasons=[why], low_bit=low_bit)


def verify_micro_batch(
    plan: Plan,
    try_step: Callable[[int], bool],
    *,
    max_probes: int | None = None,
    reduce_min: Callable[[int], int] | None = None,
) -> Plan:
    """The largest divisor of the per-rank batch that real steps run, from the model's guess; NoFit if not even 1.

    `try_step(mbs)`: forward, backward and optimizer.step() at `plan.seq_len`, False on OOM (`probe.oom_guard`).
    Candidates: every divisor of the per-rank batch (up to the spec's micro-batch when fixed), so a memory
    model that is off by any factor still reaches the true maximum. The guess, its neighbour, then
    bisection: at most 2 + ceil(log2(#candidates)) <= log2(per-rank batch) + 3 probes.
    `reduce_min` (all-reduce MIN) agrees each outcome, so every rank ends on the same micro-batch.
    """
    upper = plan.micro_batch if plan.micro_batch_fixed else plan.per_rank
    cands = [d for d in tiers.divisors(plan.per_rank) if d <= upper]

    def probe(mbs: int) -> bool:
        ok = bool(try_step(mbs))
        if reduce_min is not None:
            ok = bool(reduce_min(int(ok)))
        log.info("plan: probe step micro-batch %d at seq %d: %s", mbs, plan.seq_len, "ok" if ok else "OOM")
        return ok

    found, results, done = largest_passing(cands, plan.micro_batch, probe, max_probes)
    tried = ", ".join(f"{m} {'ok' if ok else 'OOM'}" for m, ok in sorted(results.items()))
    if found is None:
        msg = f"tier {plan.tier}: no micro-batch fits at seq {plan.seq_len} ({len(results)} probe steps: {tried})"
        raise NoFit(plan.tier, msg, plan.world_size)
    note = f"micro-batch {plan.micro_batch} -> {found} by {len(results)} probe steps at seq {plan.seq_len} ({tried})"
    if not done:
        note += f"; stopped at the probe limit {max_probes}"
    elif found == cands[-1] and found < plan.per_rank:
        note += f"; the spec's micro-batch {upper} is the upper bound"
    if plan.model_max_micro_batch and found > 2 * plan.model_max_micro_batch:
        note += f"; the memory model said {plan.model_max_micro_batch}: it overestimates this run's memory"
    return with_micro_batch(plan, found, note, probes=plan.probes + len(results))


def agree(plan: Plan, reduce_min: Callable[[int], int], *, replan: Callable[[str], Plan] | None = None) -> Plan:
    """The plan every rank uses: the most conservative tier, then the smallest micro-batch.

    `reduce_min(x)` is an all-reduce MIN over ranks; it is called the same number of times (three)
    on every rank. When this rank's tier differs from the agreed one, `replan(tier)` re-sizes it
    (e.g. `size_for_tier`); without it the micro-batch is kept (a later tier never needs more memory).
    """
    tier = tiers.TIERS[-reduce_min(-tiers.TIERS.index(plan.tier))]
    if tier != plan.tier:
        why = f"tier {plan.tier} -> {tier}: another rank's plan needs it"
        if replan is not None:
            new = replan(tier)
            plan = _amend(dataclasses.replace(new, reasons=plan.reasons + new.reasons), why)
        else:
            plan = _amend(plan, why, tier=tier, checkpointing=plan.checkpointing or tiers.CHECKPOINTING[tier])
    order = ("fp32", "fp16", "bf16")  # least capable first: the MIN over ranks is what all can run
    precision = order[reduce_min(order.index(plan.precision))]
    if precision != plan.precision:
        plan = _amend(plan, f"precision {plan.precision} -> {precision}: another rank lacks it", precision=precision)
    mbs = reduce_min(plan.micro_batch)
    if mbs != plan.micro_batch:
        why = f"micro-batch {plan.micro_batch} -> {mbs}: the smallest over {plan.world_size} ranks"
        plan = with_micro_batch(plan, mbs, f"{why}; accumulation {plan.grad_accum} -> {plan.per_rank // mbs}")
    return plan
