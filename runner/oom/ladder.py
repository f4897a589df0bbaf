"""The memory-tier ladder: which tier a (re)started run uses, and what happens when a tier fails.

State lives in `TIER_STATE_FILE` in the run directory, beside the checkpoints, so every rank and
every pod of a restarted Job reads the same tier. Global rank 0 records tier failures, the supervisor
its relaunches, and a rank that ran out of memory alone on a sharded tier a micro-batch cap (a shrink
that needs a restart, see runner.oom.shrink). Writes are atomic (temp file, fsync, rename) and
`record_failure` is idempotent: a second writer reporting the same failed tier does not step down twice.

One node: the in-pod supervisor relaunches the workers at the next tier (runner.oom.relaunch, with the
tenacity policy `relaunch_policy`). Several nodes: each pod exits with EXIT_OOM_RETRY_TIER, the Job's
podFailurePolicy counts it and recreates the pods, and `current_tier` points them all at the same tier.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt, wait_fixed

from jobspec import shared_dir
from jobspec.catalog.tiers import TIERS, next_tier  # one ladder for the planner, `jobspec plan` and the runner
from jobspec.contract import EXIT_OOM_LAST_TIER, EXIT_OOM_RETRY_TIER, TIER_STATE_FILE
from jobspec.errors import ConfigError
from jobspec.untrusted import json_loads, read_bounded

log = logging.getLogger("jobspec.runner")
STATE_VERSION = 1
MAX_STATE_BYTES = 1 << 20  # a tier, a few failures and caps: hundreds of bytes
MESSAGE_LIMIT = 4096  # Kubernetes keeps at most 4096 bytes of a termination message


@dataclass(frozen=True)
class TierFailure:
    tier: str
    reason: str
    at: float  # unix time


@dataclass
class TierState:
    """What `TIER_STATE_FILE` holds."""

    tier: str  # the tier the next start must use
    failed: list[TierFailure] = field(default_factory=list)
    attempts: int = 0  # relaunches made by the supervisor (`record_attempt`)
    exhausted: bool = False  # the last tier failed too (or fallback is off): nothing left to try
    caps: dict[str, int] = field(default_factory=dict)  # tier -> largest micro-batch to plan (restart shrink)
    low_bit: list[str] = field(default_factory=list)  # tiers whose AdamW moments ran out at micro-batch 1: planned
    # with 8-bit ones from then on (`training.optimizer: auto`, the rung before the next tier)
    version: int = STATE_VERSION

    def failed_tiers(self) -> list[str]:
        return [f.tier for f in self.failed]


def state_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / TIER_STATE_FILE


def load_state(run_dir: str | Path) -> TierState | None:
    """The persisted state; None when there is none. A corrupt file is a ConfigError naming it."""
    path = state_path(run_dir)
    if not os.path.lexists(path):
        return None
    try:
        raw: dict[str, Any] = json_loads(read_bounded(path, MAX_STATE_BYTES, what="tier state", follow=False))
        failed = [TierFailure(str(f["tier"]), str(f["reason"]), float(f["at"])) for f in raw.get("failed", [])]
        caps = {str(t): int(m) for t, m in raw.get("caps", {}).items()}
        low_bit = [str(t) for t in raw.get("low_bit", [])]
        state = TierState(str(raw["tier"]), failed, int(raw.get("attempts", 0)), bool(raw.get("exhausted")), caps,
                          low_bit)  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: unreadable tier state ({exc}); delete it to start from the spec's tier") from exc
    if state.tier not in TIERS:
        raise ConfigError(f"{path}: unknown tier {state.tier!r}; delete the file to start from the spec's tier")
    return state


def save_state(run_dir: str | Path, state: TierState) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    path = state_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    shared_dir.write_atomic(path, json.dumps(asdict(state), indent=2).encode())  # never through a planted link
    with contextlib.suppress(OSError):  # make the rename itself durable (a no-op where directories cannot be opened)
        shared_dir.fsync_dir(path.parent)


def tiers_left(tier: str, world_size: int = 1) -> int:
    """How many more tiers the ladder can step down to from `tier`."""
    n, t = 0, next_tier(tier, world_size)
    while t is not None:
        n, t = n + 1, next_tier(t, world_size)
    return n


def current_tier(run_dir: str | Path, spec_tier: str) -> str:
    """The tier this start must use: the persisted one, unless the spec asks for a later (safer) one.

    `spec_tier` is `memory.tier` ("auto" or a tier). Without state the spec's value is returned as
    is ("auto" lets the planner choose). Every rank and pod calls this at start, so all agree.
    """
    state = load_state(run_dir)
    if state is None:
        return spec_tier
    if spec_tier != "auto" and spec_tier in TIERS and TIERS.index(spec_tier) > TIERS.index(state.tier):
        log.info("memory tier %s from the spec (persisted state says %s, an earlier one)", spec_tier, state.tier)
        return spec_tier
    if spec_tier != state.tier:
        failed = ", ".join(state.failed_tiers()) or "none"
        log.info("memory tier %s from %s (spec: %s; failed: %s)", state.tier, state_path(run_dir), spec_tier, failed)
    return state.tier


def record_failure(
    run_dir: str | Path, tier: str, reason: str, *, world_size: int = 1, fallback: bool = True
) -> str | None:
    """Persist "tier X failed: reason"; return the tier to restart at, or None when none is left.

    Idempotent: reporting a tier that is already recorded as failed changes nothing and returns what
    the state says. With `fallback=False` the ladder is off: the failure is recorded, None returned.
    """
    state = load_state(run_dir) or TierState(tier)
    if tier in state.failed_tiers():
        return None if state.exhausted else state.tier
    state.failed.append(TierFailure(tier, reason, time.time()))
    nxt = next_tier(tier, world_size) if fallback else None
    state.tier, state.exhausted = (nxt, False) if nxt else (tier, True)
    save_state(run_dir, state)
    if nxt:
        log.warning("memory tier %s failed (%s); the next start uses tier %s", tier, reason, nxt)
    else:
        why = "memory.fallback is false" if not fallback else "it is the last tier"
        log.error("memory tier %s failed (%s) and %s: giving up", tier, reason, why)
    return nxt


def record_low_bit(run_dir: str | Path, tier: str, reason: str) -> None:
    """Persist "plan `tier` with 8-bit Adam moments": AdamW's ran out at micro-batch 1 there under
    `training.optimizer: auto`, the rung the ladder takes before the next tier. Idempotent; the tier stays."""
    state = load_state(run_dir) or TierState(tier)
    if tier not in state.low_bit:
        state.low_bit.append(tier)
    save_state(run_dir, state)
    log.warning("memory tier %s ran out at micro-batch 1 with AdamW's fp32 moments (%s); it goes on with 8-bit ones "
                "(training.optimizer auto) before any other tier", tier, reason)  # fmt: skip


def low_bit_tiers(run_dir: str | Path) -> frozenset[str]:
    """The tiers `record_low_bit` moved to 8-bit Adam moments."""
    state = load_state(run_dir)
    return frozenset(state.low_bit) if state else frozenset()


def record_cap(run_dir: str | Path, tier: str, micro_batch: int, reason: str) -> None:
    """Persist "plan at most `micro_batch` at `tier`": a shrink that needs a restart (see runner.oom.shrink)."""
    state = load_state(run_dir) or TierState(tier)
    state.caps[tier] = min(micro_batch, state.caps.get(tier, micro_batch))
    save_state(run_dir, state)
    log.warning("tier %s: the next start plans micro-batch %d at most (%s)", tier, state.caps[tier], reason)


def micro_batch_cap(run_dir: str | Path, tier: str) -> int | None:
    state = load_state(run_dir)
    return state.caps.get(tier) if state else None


def record_attempt(run_dir: str | Path, tier: str) -> TierState:
    """Count one relaunch (the supervisor calls it before each launch after the first)."""
    state = load_state(run_dir) or TierState(tier)
    state.attempts += 1
    save_state(run_dir, state)
    return state


def exit_code_for(next_tier_: str | None) -> int:
    """What a worker exits with after `record_failure`: retry at the next tier, or the last-tier code."""
    return EXIT_OOM_RETRY_TIER if next_tier_ else EXIT_OOM_LAST_TIER


def termination_message(run_dir: str | Path, *, fallback: bool = True) -> str:
    """The text for the termination message when the ladder ends in OOM (at most MESSAGE_LIMIT bytes)."""
    state = load_state(run_dir)
    if state is None or not state.failed:
        return "out of memory: no tier failure recorded"
    last = state.failed[-1]
    head = (
        f"out of memory at tier {last.tier} with micro-batch 1 and memory.fallback is false: {last.reason}"
        if not fallback
        else f"out of memory at the last memory tier ({last.tier}) with micro-batch 1: {last.reason}"
    )
    tried = "; ".join(f"{f.tier}: {f.reason}" for f in state.failed[:-1])
    fix = (
        "set memory.fallback: true to step down to the next tier, or "
        if not fallback
        else "fix: a GPU with more memory, more GPUs, "
    ) + "a shorter data.max_seq_len, LoRA (model.lora) and a 4-bit base (model.quantize: nf4), or a smaller model"
    text = "\n".join(x for x in (head, f"tiers tried before: {tried}" if tried else "", fix) if x)
    data = text.encode()
    return text if len(data) <= MESSAGE_LIMIT else data[: MESSAGE_LIMIT - 3].decode(errors="ignore") + "..."


class RetryAtNextTier(Exception):
    """A launch ended with EXIT_OOM_RETRY_TIER and the state names a tier to retry at."""

    def __init__(self, failed_tier: str, next_tier_: str):
        then = f"at {next_tier_}" if next_tier_ != failed_tier else "at the same tier, with a smaller micro-batch"
        super().__init__(f"tier {failed_tier} ran out of memory; relaunching {then}")
        self.failed_tier, self.next_tier = failed_tier, next_tier_


def relaunch_policy(
    tier: str, world_size: int = 1, *, wait_s: float = 1.0, max_launches: int | None = None, extra: int = 0
) -> Retrying:
    """Tenacity policy for the supervisor's launch loop (runner.oom.relaunch.supervise).

    Retries only `RetryAtNextTier` (any other outcome returns or raises at once), at most
    1 + tiers_left(tier) + `extra` launches (capped by `max_launches`), with a short fixed wait so the
    device releases the dead workers' memory. Usage:

        for attempt in relaunch_policy(tier):
            with attempt:
                code = launch(current_tier(run_dir, spec_tier)) ...  # raise RetryAtNextTier on 75
    """
    launches = extra + (1 + tiers_left(tier, world_size) if tier in TIERS else 1 + len(TIERS))
    if max_launches is not None:
        launches = max(1, min(launches, max_launches))

    def _log(rs: RetryCallState) -> None:
        exc = rs.outcome.exception() if rs.outcome else None
        log.warning("relaunch %d of at most %d: %s", rs.attempt_number, launches - 1, exc)

    return Retrying(
        retry=retry_if_exception_type(RetryAtNextTier),
        stop=stop_after_attempt(launches),
        wait=wait_fixed(wait_s),
        before_sleep=_log,
        reraise=True,
    )


def fail_tier(
    run_dir: str | Path, tier: str, reason: str, *, world_size: int = 1, fallback: bool = True, writer: bool = True
) -> int:
    """A worker whose micro-batch 1 ran out at `tier`: persist it (writer only) and return its exit code.

    Every rank calls this with the same arguments and gets the same code (the next tier is a pure
    function of tier, world size and fallback); only `writer` (global rank 0) touches the file.
    """
    if writer:
        nxt = record_failure(run_dir, tier, reason, world_size=world_size, fallback=fallback)
    else:
        nxt = next_tier(tier, world_size) if fallback else None
    return exit_code_for(nxt)
