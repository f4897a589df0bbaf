"""The supervisor's relaunch loop over the memory-tier ladder (runner.oom.ladder holds the state and policy).

One node: a launch that ends with EXIT_OOM_RETRY_TIER after the workers moved the tier state on (a
failed tier, or a micro-batch cap for a restart shrink) is relaunched at once, under the tenacity policy
`ladder.relaunch_policy` (bounded). Several nodes (`relaunch=False`): 75 is passed through and the Job's
podFailurePolicy restarts the pods, which read the same state at start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jobspec.catalog.tiers import HOST_OPTIMIZER_TIERS, TIERS, divisors
from jobspec.contract import EXIT_OOM_LAST_TIER, EXIT_OOM_RETRY_TIER
from runner.oom.ladder import (
    RetryAtNextTier,
    TierState,
    current_tier,
    load_state,
    record_attempt,
    relaunch_policy,
    termination_message,
)


@dataclass(frozen=True)
class LadderResult:
    exit_code: int
    message: str  # termination message ("" on success)
    launches: int
    tier: str  # the tier of the last launch


def _mark(state: TierState | None) -> tuple[object, ...]:
    """What a worker that exits 75 must have changed: the tier, the failures, a micro-batch cap, or a tier moved to
    8-bit Adam moments."""
    return () if state is None else (state.tier, len(state.failed), state.exhausted, sorted(state.caps.items()),
                                     sorted(state.low_bit))  # fmt: skip


def supervise(
    launch: Callable[[str], int],
    run_dir: str | Path,
    spec_tier: str,
    *,
    world_size: int = 1,
    per_rank_batch: int = 1,
    fallback: bool = True,
    low_bit: bool = False,
    relaunch: bool = True,
    wait_s: float = 1.0,
    max_launches: int | None = None,
) -> LadderResult:
    """The launch loop: `launch(tier) -> exit code`, relaunched while it exits 75 with the state moved on.

    Bounded: one launch per tier left, plus (several ranks: sharded tiers shrink by restarting) one per
    smaller divisor of the per-rank batch, or `max_launches`. A 75 that left the tier state as it was
    ends as EXIT_OOM_LAST_TIER rather than looping. `relaunch=False` passes 75 through after one launch. `low_bit`
    (`training.optimizer: auto`): one more launch per tier that keeps Adam's moments on the GPU, retried with 8-bit
    ones before the next tier.
    """
    launched, tier = 0, current_tier(run_dir, spec_tier)
    shrinks = len(divisors(per_rank_batch)) - 1 if world_size > 1 else 0
    shrinks += (len(TIERS) - len(HOST_OPTIMIZER_TIERS)) * low_bit  # a tier retried with 8-bit Adam moments
    limit = max_launches if relaunch else 1
    policy = relaunch_policy(tier, world_size, wait_s=wait_s, max_launches=limit, extra=shrinks)
    try:
        for attempt in policy:
            with attempt:
                tier = current_tier(run_dir, spec_tier)
                if launched:  # a relaunch: count it (a first launch leaves no state behind)
                    record_attempt(run_dir, tier)
                launched += 1
                before = _mark(load_state(run_dir))
                code = launch(tier)
                if code != EXIT_OOM_RETRY_TIER:
                    msg = termination_message(run_dir, fallback=fallback) if code == EXIT_OOM_LAST_TIER else ""
                    return LadderResult(code, msg, launched, tier)
                state = load_state(run_dir)
                if state is None or state.exhausted or _mark(state) == before:
                    why = "a worker asked for a restart but left the tier state unchanged"
                    return LadderResult(EXIT_OOM_LAST_TIER, f"out of memory at tier {tier}: {why}", launched, tier)
                failed = state.failed[-1].tier if state.failed and state.tier != tier else tier
                if not relaunch:
                    cap = state.caps.get(state.tier)
                    msg = f"out of memory at tier {failed}; the next start uses tier {state.tier}" + (
                        f" at micro-batch {cap} at most" if cap else ""
                    )
                    return LadderResult(EXIT_OOM_RETRY_TIER, msg, launched, tier)
                raise RetryAtNextTier(failed, state.tier)
    except RetryAtNextTier as exc:
        msg = f"out of memory at tier {exc.failed_tier}; relaunch limit ({launched} launches) reached"
        return LadderResult(EXIT_OOM_LAST_TIER, msg, launched, tier)
    raise AssertionError("unreachable: the retry loop either returns or raises")  # pragma: no cover
