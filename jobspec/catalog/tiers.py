"""The memory tier ladder, and the micro-batches a per-rank batch allows: the two ladders an OOM walks down.

Tiers are ordered by throughput cost (DESIGN.md, "Memory tiers"); `tier: auto` starts at the cheapest that
fits and an OOM at micro-batch 1 moves one step down. Within a tier the micro-batch is always an exact
divisor of the per-rank batch, so the effective batch never changes. One definition for the spec's
`memory.tier`, `jobspec plan`, the runner's planner and its OOM ladder.
"""

from __future__ import annotations

from jobspec.errors import ConfigError

TIERS: tuple[str, ...] = ("fast", "zero2", "zero2_offload", "zero3", "minimal")
# Activation checkpointing per tier unless overridden: on wherever the tier exists to save memory.
CHECKPOINTING: dict[str, bool] = dict(zip(TIERS, (False, False, True, True, True), strict=True))
SHARD_ONLY = ("zero2", "zero3")  # tiers that save nothing on one rank (no offload)
HOST_OPTIMIZER_TIERS = ("zero2_offload", "minimal")  # Adam's moments and step on the host (fp32 there, whatever
# `training.optimizer` says: they cost no GPU memory)


def next_tier(tier: str, world_size: int | None = None) -> str | None:
    """The tier an OOM at micro-batch 1 steps down to; None after the last.

    On one rank (`world_size == 1`) the shard-only tiers are skipped; `None` walks every tier.
    """
    for candidate in TIERS[tier_index(tier) + 1 :]:
        if world_size != 1 or candidate not in SHARD_ONLY:
            return candidate
    return None


def tier_index(tier: str) -> int:
    if tier not in TIERS:
        raise ConfigError(f"unknown memory tier {tier!r}; expected one of {', '.join(TIERS)}")
    return TIERS.index(tier)


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending."""
    if n < 1:
        raise ValueError(f"divisors() needs n >= 1, got {n}")
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
