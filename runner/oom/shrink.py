"""OOM recovery in the training loop: shrink the micro-batch in process, else hand over to the tier ladder.

`Stepper.train_step` agrees with every rank after each micro-step (one all-reduce of [stop, oom,
rank]) and raises `StepOOM` on all of them together when any rank ran out of memory in a forward or
backward; the weights are untouched then. `run_step` catches it, drops to the next smaller divisor of
the per-rank batch (grad_accum grows to match: the global batch is unchanged) and redoes the SAME
step from the SAME sample ids, with the RNG state it started with. At micro-batch 1, or when the
optimizer step itself ran out (Adam's state does not shrink with the micro-batch), it raises
`TierOOM`: the worker writes a checkpoint when the weights are intact, persists "tier X failed"
(runner.oom.ladder) and exits EXIT_OOM_RETRY_TIER or EXIT_OOM_LAST_TIER.

Why the gradients of DDP are exchanged by `all_reduce_grads` after the agreement rather than by DDP's
reducer during the last backward: a rank that runs out of memory in that backward would leave the
others waiting in an all-reduce it never joins. Sharded tiers (FSDP) gather weights and reduce-scatter
gradients inside forward and backward: there the same agreement runs before each of FSDP's collectives
(runner/oom/fsdp.py), so a rank-local OOM shrinks every rank in process too. Where that cannot be
done (an OOM in the optimizer step of a sharded tier, a torch without the API), `RankOOM` restarts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from jobspec.catalog.tiers import HOST_OPTIMIZER_TIERS, divisors
from jobspec.contract import EXIT_OOM_LAST_TIER, EXIT_OOM_RETRY_TIER, TIER_STATE_FILE
from jobspec.errors import JobspecError
from runner import internals
from runner.oom import ladder
from runner.oom.detect import Headroom, allocated_bytes, guarded, next_micro_batch, release_memory
from runner.oom.faults import install_from_env
from runner.oom.regrow import TRIES, Regrow
from runner.phase import phase
from runner.sizing.plan import Plan, with_micro_batch

log = logging.getLogger("jobspec.runner")


class StepOOM(Exception):
    """Raised on every rank: some rank ran out of memory in this step's forward/backward (weights intact).
    `room`: the tightest of the ranks' allocator numbers (largest bytes per sample, least room), if any.
    `update`: it was the optimizer step's preparation (runner/train/update.py), twice: weights intact, and a
    smaller micro-batch would not help (activations are gone by then), so the next tier takes the step."""

    def __init__(self, reason: str, rank: int, room: Headroom | None = None, *, update: bool = False):
        super().__init__(reason)
        self.reason, self.rank, self.room, self.update = reason, rank, room, update


class OptimizerOOM(StepOOM):
    """Raised on every rank: some rank ran out in the optimizer step and could not finish it alone (runner/train/
    update.py); the ranks' weights may differ."""


class RankOOM(StepOOM):
    """Raised on the rank that ran out only, on a sharded tier with several ranks, where the others may wait
    in a collective this rank will not join: FSDP's gathers when the pre-collective agreement is off
    (runner/oom/fsdp.py). No agreement is attempted. The rank persists a micro-batch cap and exits 75; the
    supervisor restarts all ranks."""


class TierOOM(JobspecError):
    """Micro-batch 1 (or the optimizer step) ran out of memory at `tier`: the ladder takes over. With `cap`
    (RankOOM) only this rank knows: it records "restart at micro-batch `cap`" instead of a tier failure."""

    def __init__(self, tier: str, reason: str, *, weights_intact: bool, cap: int | None = None, local: bool = False):
        super().__init__(reason)
        self.tier, self.reason, self.weights_intact, self.cap, self.local = tier, reason, weights_intact, cap, local


_NO_ROOM = 1e30  # "no numbers from this rank" in the MAX of -room


def agreement(stop: bool, oom: str, rank: int, world_size: int, room: Headroom | None = None) -> list[float]:
    """This rank's part of the per-micro-step all-reduce MAX: [stop, oom, world - rank when it ran out,
    bytes per sample, -room]. The third value's MAX names the lowest rank that ran out (world - max); the
    last two give every rank the same, tightest, allocator numbers (the largest need, the least room)."""
    per_sample, minus_room = (room.per_sample, -room.room) if room is not None else (0.0, -_NO_ROOM)
    return [float(stop), float(bool(oom)), float(world_size - rank) if oom else 0.0, per_sample, minus_room]


def raise_agreed(flags: Sequence[float], oom: str, world_size: int, *, optimizer: bool = False) -> None:
    """Raise (Optimizer)StepOOM on every rank when the reduced flags say any rank ran out."""
    if not flags[1]:
        return
    first = world_size - int(flags[2])
    reason = oom or f"out of memory on rank {first}"
    room = Headroom(flags[3], -flags[4]) if len(flags) > 4 and flags[3] > 0 and -flags[4] < _NO_ROOM else None
    raise (OptimizerOOM if optimizer else StepOOM)(reason, first, room)


@dataclass(frozen=True)
class Shrink:
    """One in-process shrink, as recorded in metrics.jsonl (`kind: event, event: oom_shrink`)."""

    step: int
    tier: str
    from_mbs: int
    to_mbs: int
    from_accum: int
    to_accum: int
    rank: int  # lowest rank that ran out
    reason: str
    oom_at: float  # unix time the agreed OOM reached the shrink loop (before memory is released)

    def record(self) -> dict[str, Any]:
        return {
            "kind": "event", "event": "oom_shrink", "step": self.step, "tier": self.tier,
            "from_micro_batch": self.from_mbs, "to_micro_batch": self.to_mbs,
            "from_grad_accum": self.from_accum, "to_grad_accum": self.to_accum,
            "oom_rank": self.rank, "reason": self.reason, "oom_at": round(self.oom_at, 3),
        }  # fmt: skip


def _rng() -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def run_step(
    train_step: Callable[[Sequence[int], int], Any],
    ids: Sequence[int],
    plan: Plan,
    *,
    step: int,
    zero_grad: Callable[[], None],
    reset: Callable[[], bool] = lambda: True,
    on_shrink: Callable[[Shrink], None] | None = None,
    on_retry: Callable[[int, str, str], None] | None = None,
    last_tier: bool = False,
    on_recovered: Callable[[dict[str, float]], None] | None = None,
) -> tuple[Any, Plan]:
    """`train_step(ids, micro_batch)` with in-process shrink; returns (its result, the plan it ran with).

    `step` is the 1-based number of the step being computed (for logs and metrics). `reset()` restores
    the wrapper's per-iteration state after the aborted step (`reset_wrapper`); False: it cannot, and the
    shrink happens by a restart instead. Raises TierOOM when micro-batch 1 ran out (at the `last_tier` the run may use,
    twice: the second try comes after the cache is emptied, `on_retry(step, tier, reason)`), or when the optimizer
    step did. After a step that ran out and then finished, `on_recovered` gets where the time went: `release_s`
    (dropping the failed attempts' gradients, resetting the wrapper, freeing memory) and `attempts_s` (the failed
    attempts themselves, up to each OOM), and `redo_s` (the attempt that finished, its loader misses included).
    """
    retried = False
    rng = _rng()
    baseline = allocated_bytes()  # weights and optimizer state: what must stay once the failed step is freed
    timings = {"attempts_s": 0.0, "release_s": 0.0}
    while True:
        started = time.perf_counter()
        try:
            result = train_step(ids, plan.micro_batch)
            if timings["release_s"] and on_recovered is not None:
                on_recovered({**timings, "redo_s": time.perf_counter() - started})
            return result, plan
        except RankOOM as err:
            nxt = next_micro_batch(plan.micro_batch, plan.per_rank)
            where = f"step {step} on rank {err.rank} of a sharded tier"
            raise TierOOM(plan.tier, f"out of memory at micro-batch {plan.micro_batch}, {where}: {err.reason}",
                          weights_intact=False, cap=nxt, local=True) from None  # fmt: skip
        except OptimizerOOM as err:
            why, rank, room = err.reason, err.rank, None
            intact, update = False, True
        except StepOOM as err:
            why, rank, room = err.reason, err.rank, err.room
            intact, update = True, err.update
        # Out of the except block: the failed attempt's frames are gone; drop its gradients, then free.
        caught, t0 = time.time(), time.perf_counter()
        timings["attempts_s"] += t0 - started
        with phase("step %d: out of memory at micro-batch %d on rank %d (%s); releasing the attempt's memory", step,
                   plan.micro_batch, rank, why[:200]):  # fmt: skip
            zero_grad()
            restored = reset()
            release_memory(baseline)
        timings["release_s"] += time.perf_counter() - t0
        if not intact:
            raise TierOOM(plan.tier, f"out of memory in the optimizer step {step} on rank {rank}: {why}",
                          weights_intact=False)  # fmt: skip
        if update:  # the step's gradients were there; what ran out does not shrink with the micro-batch
            raise TierOOM(plan.tier, f"out of memory preparing the optimizer step {step} on rank {rank}: {why}",
                          weights_intact=True)  # fmt: skip
        nxt = next_micro_batch(plan.micro_batch, plan.per_rank, room)
        if nxt is None and restored and not retried and last_tier:
            # micro-batch 1 at the last tier the run may use: no shrink and no step-down left, only the end of the job.
            # The caching allocator's free blocks went back to the device just now (release_memory); an OOM from
            # fragmentation or another process's spike passes with that, so the step is tried once more, for the cost
            # of one step, before the job is given up. At other tiers the step-down is the answer.
            retried = True
            log.warning("out of memory at micro-batch 1, step %d, rank %d (%s): trying the step once more at tier %s "
                        "with the cache emptied", step, rank, why, plan.tier)  # fmt: skip
            if on_retry is not None:
                on_retry(step, plan.tier, why)
            _set_rng(rng)
            continue
        if nxt is None:
            raise TierOOM(plan.tier, f"out of memory at micro-batch 1, step {step}, rank {rank}: {why}",
                          weights_intact=True)  # fmt: skip
        if not restored:
            why = f"the model wrapper cannot redo it in process (FSDP2 needs torch >= 2.13): {why}"
            raise TierOOM(plan.tier, f"out of memory at step {step} on rank {rank}; {why}", weights_intact=False,
                          cap=nxt)  # fmt: skip
        old = plan
        measured = "" if room is None else (
            f" (allocator: {room.room / 2**20:,.0f} MiB of room, >= {room.per_sample / 2**20:,.1f} MiB a sample)"
        )
        note = (
            f"micro-batch {old.micro_batch} -> {nxt}{measured} after OOM at step {step} on rank {rank}: {why}; "
            f"accumulation {old.grad_accum} -> {old.per_rank // nxt}, global batch {old.global_batch} unchanged"
        )
        plan = with_micro_batch(old, nxt, note)  # logs the note
        log.info("step %d: redoing it at micro-batch %d x %d ...", step, nxt, plan.grad_accum)  # its end: on_recovered
        if on_shrink is not None:
            on_shrink(Shrink(step, plan.tier, old.micro_batch, nxt, old.grad_accum, plan.grad_accum, rank, why,
                             caught))  # fmt: skip
        _set_rng(rng)  # the redo draws the same random numbers as a first attempt would


def reset_wrapper(model: torch.nn.Module) -> bool:
    """After an OOM inside the wrapped model's forward or backward: DDP's reducer forgets the half-done
    gradient reduction (else the redo's forward raises "Expected to have finished reduction in the prior
    iteration"); FSDP2 resets its iteration state and drops a partial backward's gradients. True when the
    wrapper is ready for the redo; False when this torch cannot (runner/internals/): the shrink restarts."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        if not internals.reset_ddp(model):
            log.warning("cannot reset DDP after the OOM: the shrink happens by a restart")
            return False
        return True
    return internals.reset_fsdp(model)


def apply_cap(plan: Plan, root: Any) -> Plan:
    """The plan with its micro-batch lowered to the cap a restart shrink persisted for its tier, if any."""
    cap = ladder.micro_batch_cap(root, plan.tier)
    if cap is None or plan.micro_batch <= cap:
        return plan
    mbs = max(d for d in divisors(plan.per_rank) if d <= cap)
    return with_micro_batch(
        plan, mbs, f"micro-batch {plan.micro_batch} -> {mbs}: capped in {TIER_STATE_FILE} after an OOM"
    )


def low_bit_rung(spec: Any, plan: Plan, tier: str) -> bool:
    """Whether an OOM at micro-batch 1 at `tier` retries it with 8-bit Adam moments instead of the next tier:
    `training.optimizer: auto`, AdamW's fp32 moments now, and a tier that keeps them on the GPU. The same on every
    rank (the spec and the agreed plan)."""
    return spec.training.optimizer == "auto" and plan.optimizer == "adamw" and tier not in HOST_OPTIMIZER_TIERS


def tier_failed(root: Any, tier: str, reason: str, *, world_size: int, fallback: bool, writer: bool) -> tuple[int, str]:
    """Persist the tier failure (writer only) -> (exit code, the reason for the termination message)."""
    code = ladder.fail_tier(root, tier, reason, world_size=world_size, fallback=fallback, writer=writer)
    if code == EXIT_OOM_LAST_TIER:
        return code, ladder.termination_message(root, fallback=fallback) if writer else reason
    nxt = ladder.next_tier(tier, world_size)
    return code, f"out of memory at tier {tier} ({reason}); the next start uses tier {nxt}"


class RecipeGuard:
    """A recipe's OOM handling: fault injection, shrink events in metrics, the hand-over to the ladder.

    Installed by `Recipe.setup()` once the plan is final (the planner's probe steps run without the
    injected faults); `Recipe.train_step` goes through `train_step` here.
    """

    def __init__(self, recipe: Any):
        self.recipe = recipe
        model = recipe.accelerator.unwrap_model(recipe.model)
        env = recipe.env
        self.injector = install_from_env(model, rank=env.rank, tier=recipe.plan.tier, run_dir=recipe.root)
        if self.injector is not None:
            self.injector.per_sample_bytes = recipe.plan.per_sample_bytes
            recipe.stepper.faults = self.injector.region
        self.shrinks: list[Shrink] = []
        self.regrow = Regrow(recipe.spec.memory.regrow_after)

    def train_step(self, step: int) -> Any:
        """Optimizer step `step` (0-based) with in-process shrink; updates `recipe.plan` when it shrinks, and
        tries the larger micro-batch again after `memory.regrow_after` clean steps (runner/oom/regrow.py)."""
        r = self.recipe
        if self.injector is not None:
            self.injector.step = step + 1
        larger = self.regrow.proposal(r.plan.micro_batch)
        if larger is not None:
            self._grow(step + 1, larger)
        result, r.plan = run_step(
            lambda ids, mbs: r.stepper.train_step(ids, mbs, r.lr(step)), r.step_ids(step), r.plan, step=step + 1,
            zero_grad=lambda: r.stepper.inner.zero_grad(set_to_none=True), reset=lambda: reset_wrapper(r.model),
            on_shrink=self._shrunk, on_retry=self._retried, on_recovered=partial(self._recovered, step + 1),
            last_tier=not r.spec.memory.fallback or ladder.next_tier(r.plan.tier, r.env.world_size) is None,
        )  # fmt: skip
        self.regrow.stepped(r.plan.micro_batch)
        return result

    def _grow(self, step: int, larger: int) -> None:
        r, g = self.recipe, self.regrow
        old = r.plan
        note = (f"micro-batch {old.micro_batch} -> {larger}: trying the micro-batch from before the OOM again at "
                f"step {step}, after {g.since} steps without one (try {g.failed + 1} of {TRIES}); accumulation "
                f"{old.grad_accum} -> {old.per_rank // larger}, global batch {old.global_batch} unchanged")  # fmt: skip
        r.plan = with_micro_batch(old, larger, note)
        if r.metrics is not None:
            r.metrics.write({"kind": "event", "event": "oom_regrow", "step": step, "tier": old.tier,
                             "from_micro_batch": old.micro_batch, "to_micro_batch": larger, "try": g.failed + 1})

    def region(self, during: str, step: int) -> AbstractContextManager[Any]:
        """The fault injector's region (`op=N` rules) for an evaluation or a checkpoint after `step` steps (the
        stepper opens the evaluation's itself: `during` "eval" only sets the step)."""
        if self.injector is None:
            return nullcontext()
        self.injector.step = step
        return nullcontext() if during == "eval" else self.injector.region(during, self.recipe.plan.micro_batch)

    def close(self) -> None:
        """Take the fault injector's hook off the model (an in-process tier step-down builds a new one)."""
        if self.injector is not None:
            self.injector.remove()

    def _recovered(self, step: int, timings: dict[str, float]) -> None:
        """Where the time from the OOM to the end of the redone step went (`run_step`), with the loader's part."""
        r = self.recipe
        loader = r.stepper.prefetch.take_miss_seconds() if r.stepper.prefetch is not None else 0.0
        parts = {k: round(v, 4) for k, v in {**timings, "loader_s": loader}.items()}
        log.info("step %d recovered from its OOM: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
        if r.metrics is not None:
            r.metrics.write({"kind": "event", "event": "oom_recovered", "step": step, "tier": r.plan.tier, **parts})

    def _retried(self, step: int, tier: str, reason: str) -> None:
        if self.recipe.metrics is not None:
            self.recipe.metrics.write({"kind": "event", "event": "oom_retry", "step": step, "tier": tier,
                                       "micro_batch": 1, "reason": reason})  # fmt: skip

    def _shrunk(self, shrink: Shrink) -> None:
        self.shrinks.append(shrink)
        self.regrow.shrunk(shrink.from_mbs)
        if self.recipe.metrics is not None:
            self.recipe.metrics.write(shrink.record())

    def give_up(self, err: TierOOM) -> int:
        """Checkpoint the finished steps when the weights are intact, persist the failure, return 75 or 76."""
        r = self.recipe
        # Every rank is here (the OOM was agreed), so the collective save is safe.
        if err.weights_intact and r.step > max(r.saved_step, 0) and guarded(r._save).oom:
            log.warning("out of memory writing checkpoint %d; the next start resumes from step %d", r.step,
                        max(r.saved_step, 0))  # fmt: skip
        if err.cap is not None:  # this rank alone ran out on a sharded tier: restart all ranks at a smaller one
            ladder.record_cap(r.root, err.tier, err.cap, err.reason)
            r.status["reason"] = f"{err.reason}; restarting at micro-batch {err.cap}"
            return EXIT_OOM_RETRY_TIER
        if low_bit_rung(r.spec, r.plan, err.tier):  # the same tier with 8-bit moments, before the next one
            if r.env.is_main or err.local:
                ladder.record_low_bit(r.root, err.tier, err.reason)
            r.status["reason"] = f"{err.reason}; retrying tier {err.tier} with 8-bit Adam moments"
            return EXIT_OOM_RETRY_TIER
        code, reason = tier_failed(r.root, err.tier, err.reason, world_size=r.env.world_size,
                                   fallback=r.spec.memory.fallback, writer=r.env.is_main or err.local)  # fmt: skip
        r.status["reason"] = reason
        return code
