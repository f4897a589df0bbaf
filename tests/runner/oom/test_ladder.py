"""runner.oom.ladder: persisted tier state, the step-down, the tenacity relaunch loop, the message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobspec.catalog.tiers import TIERS
from jobspec.contract import EXIT_OK, EXIT_OOM_LAST_TIER, EXIT_OOM_RETRY_TIER, TIER_STATE_FILE
from jobspec.errors import ConfigError
from runner.oom.ladder import (
    MESSAGE_LIMIT,
    RetryAtNextTier,
    TierState,
    current_tier,
    fail_tier,
    load_state,
    micro_batch_cap,
    next_tier,
    record_attempt,
    record_cap,
    record_failure,
    relaunch_policy,
    save_state,
    termination_message,
    tiers_left,
)
from runner.oom.relaunch import supervise


def test_next_tier_skips_shard_only_tiers_on_one_rank() -> None:
    assert [next_tier(t, 2) for t in TIERS] == [*TIERS[1:], None]
    assert next_tier("fast", 1) == "zero2_offload"
    assert next_tier("zero2_offload", 1) == "minimal"
    assert next_tier("minimal", 1) is None
    assert (tiers_left("fast", 1), tiers_left("fast", 8), tiers_left("minimal", 8)) == (2, 4, 0)
    with pytest.raises(ConfigError, match="unknown memory tier"):
        next_tier("turbo")


def test_no_state_means_the_spec_tier(tmp_path: Path) -> None:
    assert current_tier(tmp_path, "auto") == "auto"
    assert current_tier(tmp_path, "zero2") == "zero2"


def test_record_failure_persists_and_every_start_reads_it(tmp_path: Path) -> None:
    assert record_failure(tmp_path, "fast", "OutOfMemoryError: CUDA out of memory", world_size=2) == "zero2"
    raw = json.loads((tmp_path / TIER_STATE_FILE).read_text())
    assert raw["tier"] == "zero2" and raw["failed"][0]["tier"] == "fast" and raw["failed"][0]["at"] > 0
    assert "CUDA out of memory" in raw["failed"][0]["reason"]
    # Every rank and pod at start, whatever the spec said (auto or the failed tier): the persisted one.
    assert current_tier(tmp_path, "auto") == current_tier(tmp_path, "fast") == "zero2"
    # A spec that asks for a later (safer) tier than the state wins.
    assert current_tier(tmp_path, "zero3") == "zero3"


def test_record_failure_is_idempotent(tmp_path: Path) -> None:
    assert record_failure(tmp_path, "fast", "oom", world_size=2) == "zero2"
    assert record_failure(tmp_path, "fast", "oom again, second writer", world_size=2) == "zero2"
    state = load_state(tmp_path)
    assert state is not None and state.tier == "zero2" and state.failed_tiers() == ["fast"]


def test_the_ladder_ends_after_the_last_tier(tmp_path: Path) -> None:
    tier: str | None = "fast"
    seen = []
    while tier is not None:
        seen.append(tier)
        tier = record_failure(tmp_path, tier, f"oom at {tier}", world_size=1)
    assert seen == ["fast", "zero2_offload", "minimal"]
    state = load_state(tmp_path)
    assert state is not None and state.exhausted and state.tier == "minimal"
    assert record_failure(tmp_path, "minimal", "again") is None


def test_fallback_off_records_but_does_not_step_down(tmp_path: Path) -> None:
    assert record_failure(tmp_path, "fast", "oom", fallback=False) is None
    state = load_state(tmp_path)
    assert state is not None and state.exhausted and state.tier == "fast"
    assert fail_tier(tmp_path / "other", "fast", "oom", fallback=False) == EXIT_OOM_LAST_TIER


def test_fail_tier_exit_codes_and_single_writer(tmp_path: Path) -> None:
    # A non-writer rank computes the same code and writes nothing.
    assert fail_tier(tmp_path, "fast", "oom", world_size=2, writer=False) == EXIT_OOM_RETRY_TIER
    assert not (tmp_path / TIER_STATE_FILE).exists()
    assert fail_tier(tmp_path, "fast", "oom", world_size=2) == EXIT_OOM_RETRY_TIER
    assert fail_tier(tmp_path, "minimal", "oom", world_size=2) == EXIT_OOM_LAST_TIER


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    save_state(tmp_path, TierState("zero2"))
    save_state(tmp_path, TierState("zero3", attempts=2))
    assert [p.name for p in tmp_path.iterdir()] == [TIER_STATE_FILE]
    state = load_state(tmp_path)
    assert state is not None and (state.tier, state.attempts) == ("zero3", 2)


@pytest.mark.parametrize("content", ["{half", '{"tier": "turbo"}', '{"failed": []}'])
def test_corrupt_state_is_a_config_error_naming_the_file(tmp_path: Path, content: str) -> None:
    (tmp_path / TIER_STATE_FILE).write_text(content)
    with pytest.raises(ConfigError, match=TIER_STATE_FILE):
        load_state(tmp_path)


def test_record_attempt_counts_starts(tmp_path: Path) -> None:
    record_attempt(tmp_path, "fast")
    assert record_attempt(tmp_path, "fast").attempts == 2


def test_termination_message(tmp_path: Path) -> None:
    for tier in ("fast", "zero2_offload", "minimal"):
        record_failure(tmp_path, tier, f"CUDA out of memory at {tier}")
    text = termination_message(tmp_path)
    assert text.startswith("out of memory at the last memory tier (minimal) with micro-batch 1")
    assert "fast: CUDA out of memory at fast" in text and "max_seq_len" in text
    assert "model.quantize: nf4" in text  # the next knob for a run already on LoRA
    off = tmp_path / "off"
    record_failure(off, "fast", "x" * 10_000, fallback=False)
    text = termination_message(off, fallback=False)
    assert "memory.fallback is false" in text and len(text.encode()) <= MESSAGE_LIMIT


def test_relaunch_policy_retries_only_the_next_tier_outcome() -> None:
    calls = []
    for attempt in relaunch_policy("fast", 1, wait_s=0):
        with attempt:
            calls.append(1)
            if len(calls) < 3:
                raise RetryAtNextTier("fast", "zero2_offload")
    assert len(calls) == 3
    with pytest.raises(RetryAtNextTier):  # 1 + tiers_left("fast", 1) = 3 launches, then it gives up
        for attempt in relaunch_policy("fast", 1, wait_s=0):
            with attempt:
                raise RetryAtNextTier("fast", "zero2_offload")
    tries = []
    with pytest.raises(KeyError):  # anything else is not retried
        for attempt in relaunch_policy("fast", 8, wait_s=0):
            with attempt:
                tries.append(1)
                raise KeyError("boom")
    assert len(tries) == 1


def _launcher(tmp_path: Path, fail_at: set[str], log: list[str], code_on_fail: int = EXIT_OOM_RETRY_TIER):
    """A fake worker group: OOMs at the tiers in `fail_at` (recording it like a worker), else succeeds."""

    def launch(tier: str) -> int:
        log.append(tier)
        if tier in fail_at:
            return fail_tier(tmp_path, tier, f"oom at {tier}", world_size=1)
        return EXIT_OK

    return launch


def test_supervise_steps_down_and_completes(tmp_path: Path) -> None:
    launched: list[str] = []
    result = supervise(_launcher(tmp_path, {"fast"}, launched), tmp_path, "fast", wait_s=0)
    assert (result.exit_code, result.message, launched) == (EXIT_OK, "", ["fast", "zero2_offload"])
    state = load_state(tmp_path)
    assert state is not None and state.attempts == 1  # one relaunch
    again: list[str] = []  # a second restart of the finished run keeps the persisted tier
    supervise(_launcher(tmp_path, {"fast"}, again), tmp_path, "fast", wait_s=0)
    assert again == ["zero2_offload"]


def test_supervise_all_tiers_fail(tmp_path: Path) -> None:
    launched: list[str] = []
    result = supervise(_launcher(tmp_path, set(TIERS), launched), tmp_path, "fast", wait_s=0)
    assert launched == ["fast", "zero2_offload", "minimal"]
    assert result.exit_code == EXIT_OOM_LAST_TIER and "last memory tier (minimal)" in result.message


def test_supervise_without_relaunch_passes_75_through(tmp_path: Path) -> None:
    launched: list[str] = []
    result = supervise(_launcher(tmp_path, {"fast"}, launched), tmp_path, "fast", relaunch=False, wait_s=0)
    assert result.exit_code == EXIT_OOM_RETRY_TIER and launched == ["fast"]
    assert "next start uses tier zero2_offload" in result.message


def test_supervise_guards_against_a_worker_that_records_nothing(tmp_path: Path) -> None:
    result = supervise(lambda tier: EXIT_OOM_RETRY_TIER, tmp_path, "fast", wait_s=0)
    assert result.exit_code == EXIT_OOM_LAST_TIER and result.launches == 1


def test_supervise_bounded_by_max_launches(tmp_path: Path) -> None:
    launched: list[str] = []
    result = supervise(_launcher(tmp_path, set(TIERS), launched), tmp_path, "fast", wait_s=0, max_launches=2)
    assert result.exit_code == EXIT_OOM_LAST_TIER and len(launched) == 2 and "relaunch limit" in result.message


def test_micro_batch_caps_only_go_down_and_survive_a_reload(tmp_path: Path) -> None:
    assert micro_batch_cap(tmp_path, "zero3") is None
    record_cap(tmp_path, "zero3", 4, "oom on rank 1")
    record_cap(tmp_path, "zero3", 8, "a late writer with an older view")
    assert micro_batch_cap(tmp_path, "zero3") == 4 and micro_batch_cap(tmp_path, "zero2") is None
    record_failure(tmp_path, "zero3", "oom at 1", world_size=2)
    state = load_state(tmp_path)
    assert state is not None and state.caps == {"zero3": 4} and state.tier == "minimal"


def test_supervise_relaunches_the_same_tier_after_a_cap_bounded_by_the_divisors(tmp_path: Path) -> None:
    launched: list[str] = []

    def launch(tier: str) -> int:  # a sharded tier whose rank 1 runs out alone: a cap per launch
        launched.append(tier)
        cap = micro_batch_cap(tmp_path, "zero3")
        if cap == 2:
            return EXIT_OK
        record_cap(tmp_path, "zero3", (cap or 8) // 2, "rank 1")
        return EXIT_OOM_RETRY_TIER

    result = supervise(launch, tmp_path, "zero3", world_size=2, per_rank_batch=8, wait_s=0)
    assert result.exit_code == EXIT_OK and launched == ["zero3", "zero3", "zero3"]
    stuck = tmp_path / "stuck"  # a cap every time: bounded by 1 + tiers left (1) + smaller divisors of 8 (3)
    count: list[str] = []

    def always(tier: str) -> int:
        count.append(tier)
        record_cap(stuck, "zero3", 8 - len(count), "rank 1")
        return EXIT_OOM_RETRY_TIER

    result = supervise(always, stuck, "zero3", world_size=2, per_rank_batch=8, wait_s=0)
    assert result.exit_code == EXIT_OOM_LAST_TIER and len(count) == 5 and "relaunch limit" in result.message


def test_termination_message_stays_json_within_the_kubelet_limit() -> None:
    import json

    from runner.oom.ladder import MESSAGE_LIMIT
    from runner.process.supervisor import Outcome

    for reason in ("short", "é" * 5000, "x" * 10_000):
        text = Outcome(76, reason, {"tier": "minimal", "step": 3, "loss": 1.5}).message()
        assert len(text.encode()) <= MESSAGE_LIMIT
        record = json.loads(text)
        assert record["exit_code"] == 76 and record["tier"] == "minimal" and record["reason"]
