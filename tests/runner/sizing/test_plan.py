"""The planner with faked probes: tier and micro-batch match the memory model, the batch stays exact.

Only the GPU is fake (a DeviceInfo built by hand); the spec, the memory model and the planner are real.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobspec.catalog import tiers
from jobspec.catalog.presets import PRESETS
from jobspec.contract import EXIT_OOM_LAST_TIER, EXIT_OOM_RETRY_TIER
from jobspec.errors import ConfigError
from jobspec.plan import memory
from jobspec.spec.models import JobSpec
from runner.sizing.hostmem import HostInfo
from runner.sizing.plan import NoFit, Plan, agree, initial_plan, size_for_tier, verify_micro_batch, with_micro_batch
from runner.sizing.probe import DeviceInfo, largest_passing

GiB = 1024**3
SEQ = {"gpt2-small": 1024, "qwen-1.8b": 2048}
BIG_HOST = HostInfo(total_bytes=1024 * GiB, available_bytes=900 * GiB, cpus=64)


def make_spec(preset: str = "gpt2-small", world: int = 1, global_batch: int = 64, **sections: Any) -> JobSpec:
    data: dict[str, Any] = {
        "name": "t",
        "model": {"preset": preset},
        "data": {"max_seq_len": SEQ.get(preset, 128)},
        "training": {"global_batch": global_batch},
        "hardware": {"gpus": world},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return JobSpec.model_validate(data)


def gpu(total_gib: float, *, used_gib: float = 0.5, count: int = 8, bf16: bool = True) -> DeviceInfo:
    total = int(total_gib * GiB)
    return DeviceInfo("cuda", f"fake-{total_gib}G", total, total - int(used_gib * GiB), (9, 0), bf16, count, "pynvml")


def cpu_device(host: HostInfo) -> DeviceInfo:
    return DeviceInfo("cpu", "cpu", host.total_bytes, host.available_bytes, None, False, 0, "cpu")


def assert_exact(plan: Plan) -> None:
    assert plan.per_rank % plan.micro_batch == 0
    assert plan.micro_batch * plan.grad_accum * plan.world_size == plan.global_batch


# -- initial_plan against the memory model ---------------------------------------------------------


@pytest.mark.parametrize("preset", ["gpt2-small", "qwen-1.8b"])
@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("total_gib", [4, 8, 12, 20, 24, 80])
def test_plan_matches_memory_model(preset: str, world: int, total_gib: int) -> None:
    spec, device = make_spec(preset, world), gpu(total_gib, count=world)
    least = min(memory.estimate(PRESETS[preset], tier=t, seq_len=SEQ[preset], micro_batch=0, world_size=world)
                .gpu_bytes for t in tiers.TIERS)  # fmt: skip
    if least > device.total_bytes:  # the states alone fit no tier (qwen-1.8b on a 4 GiB card): exit 2 before a plan
        with pytest.raises(ConfigError, match="fit no memory tier here"):
            initial_plan(spec, device, BIG_HOST, world)
        return
    plan = initial_plan(spec, device, BIG_HOST, world)
    plans = memory.plan_all(
        PRESETS[preset],
        gpu_bytes=device.free_bytes,
        global_batch=64,
        world_size=world,
        seq_len=SEQ[preset],
        utilization=spec.memory.target_utilization,
    )
    expected = memory.pick_tier(plans)
    if expected is None:  # nothing fits per the model: the least demanding tier at 1, probes decide
        assert (plan.tier, plan.micro_batch) == ("minimal", 1)
        assert "no tier fits" in plan.reasons[0]
    else:
        assert (plan.tier, plan.micro_batch) == (expected.tier, expected.micro_batch)
        assert plan.grad_accum == expected.grad_accum
        assert plan.model_max_micro_batch == expected.max_micro_batch
        assert plan.estimated_bytes == expected.estimate.gpu_bytes
        assert plan.checkpointing == expected.estimate.checkpointing
    assert_exact(plan)
    assert plan.budget_bytes == int(0.9 * device.free_bytes)
    assert plan.precision == "bf16"
    assert plan.reasons[0].startswith("tier auto -> ")
    assert any(r.startswith("micro-batch auto -> ") and "GiB" in r for r in plan.reasons)


def test_hand_checked_gpt2_small_on_24_gib() -> None:
    # gpt2-small: P = 124,439,808. fast, 1 rank (tests/test_memory.py test_plan_tier_hand_checked): states 18P,
    # 1 GiB + 5 % overhead; at micro-batch b: + one loss chunk and the head's gradient + b * 574,111,744 (activations
    # and the loss's per-token bytes). The largest that fits 0.9 * 24 GiB is 22 (total 22,585,460,258).
    p = 124_439_808
    fixed = 18 * p + 18 * p * 5 // 100 + GiB
    assert fixed == 3_425_654_195
    per_sample = -(-(22_585_460_258 - fixed) // 22)  # the plan's line: micro-batch 0 to the largest that fits
    assert per_sample == 870_900_276
    budget = int(0.9 * 24 * GiB)
    assert (budget - fixed) // per_sample == 22  # 16 is the largest divisor of 64 below it
    device = DeviceInfo("cuda", "L4", 24 * GiB, 24 * GiB, (8, 9), True, 1, "pynvml")
    plan = initial_plan(make_spec("gpt2-small", 1, 64), device, BIG_HOST, 1)
    assert (plan.tier, plan.micro_batch, plan.grad_accum, plan.model_max_micro_batch) == ("fast", 16, 4, 22)
    assert (plan.fixed_bytes, plan.per_sample_bytes) == (fixed, per_sample)
    assert (
        "micro-batch auto -> 16 of 64: " in plan.reasons[1]
        and "per sample at seq 1024 = 22 -> 16, largest divisor" in plan.reasons[1]
    )


def test_hand_checked_qwen_on_one_32_gib_gpu_offloads() -> None:
    # qwen-1.8b (P = 1,836,681,216): fast holds 18P = 30.8 GiB of states, more than a 32 GiB card's 28.8 GiB budget;
    # zero2 saves nothing on one rank; zero2_offload keeps 10 B/param on the GPU (FSDP2's fp32 shard and gradient,
    # the bf16 gather held through backward); at seq 2048, checkpointed, micro-batch 1 the step peaks in backward at
    # the untied head: its fp32 gradient reduce-scattered and, on one rank, the scatter's output a whole fp32 copy
    # beside it, (4 + 4)*311,164,928 = 2,489,319,424, + the checkpointed inputs 24*2*2048*2048 = 201,326,592 + the
    # loss's kept hidden states 2048*(10*2048 + 16) = 41,975,808 = 2,732,621,824 (the end of backward, the
    # embedding's bf16 gradient, fp32 copy and output with the kept bf16 weights gone, is less). 10P 18,366,812,160
    # + 2,732,621,824 -> body 21,099,433,984 (the trace: 21,092,164,104) + 5 % 1,054,971,699 + GiB = 23,228,147,507
    # (21.6 GiB): just over a 24 GiB card's 21.6 GiB budget, within a 32 GiB card's 28.8.
    device = DeviceInfo("cuda", "V100-32GB", 32 * GiB, 32 * GiB, (7, 0), False, 1, "pynvml")
    plan = initial_plan(make_spec("qwen-1.8b", 1, 64), device, BIG_HOST, 1)
    assert plan.tier == "zero2_offload"
    assert plan.checkpointing is True
    assert "fast: needs" in plan.reasons[0] and "zero2: one rank" in plan.reasons[0]
    e = memory.estimate(PRESETS["qwen-1.8b"], tier="zero2_offload", seq_len=2048, micro_batch=1, world_size=1)
    assert e.gpu_bytes == 23_228_147_507
    small = DeviceInfo("cuda", "RTX4090", 24 * GiB, 24 * GiB, (8, 9), True, 1, "pynvml")
    on_24 = initial_plan(make_spec("qwen-1.8b", 1, 64), small, BIG_HOST, 1)
    assert on_24.tier == "minimal" and "zero2_offload: needs 21.6 GiB" in on_24.reasons[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    per_rank=st.integers(1, 256),
    world=st.sampled_from([1, 2, 3, 4, 8]),
    free_gib=st.floats(4, 160),  # below, qwen-1.8b's states fit no tier of one card (capacity: exit 2)
    preset=st.sampled_from(["gpt2-small", "qwen-1.8b"]),
)
def test_property_batch_exact_and_matches_model(per_rank: int, world: int, free_gib: float, preset: str) -> None:
    spec = make_spec(preset, world, per_rank * world)
    device = gpu(free_gib + 1, used_gib=1, count=world)
    plan = initial_plan(spec, device, BIG_HOST, world)
    assert_exact(plan)
    assert plan.global_batch == per_rank * world
    tp = memory.plan_tier(
        PRESETS[preset],
        tier=plan.tier,
        gpu_bytes=device.free_bytes,
        global_batch=per_rank * world,
        world_size=world,
        seq_len=SEQ[preset],
    )
    assert plan.micro_batch == (tp.micro_batch or 1)
    if tp.fits:  # never more than the model says fits, and never a smaller divisor than it allows
        assert plan.estimated_bytes <= plan.budget_bytes


def test_cpu_plan_uses_host_memory_split_over_local_ranks() -> None:
    host = HostInfo(total_bytes=16 * GiB, available_bytes=12 * GiB, cpus=8)
    spec = make_spec("tiny", 2, 16, hardware={"vendor": "cpu"}, data={"max_seq_len": 128})
    plan = initial_plan(spec, cpu_device(host), host, 2)
    assert (plan.tier, plan.precision, plan.pin_memory) == ("fast", "fp32", False)
    assert plan.budget_bytes == int(0.9 * (12 * GiB // 2))
    assert plan.micro_batch == 8 and plan.grad_accum == 1  # the tiny model fits the whole per-rank batch
    assert plan.num_workers == 0  # CPU training: collating in process leaves every core to torch
    assert "tier auto -> fast: CPU" in plan.reasons[0]


def test_fp32_widens_the_activations() -> None:
    # CPU training runs fp32: every saved tensor fp32, no 16-bit copies (traced: 32*h + 20*i a GPT-2 layer and token).
    host = HostInfo(24 * GiB, 22 * GiB, 2)
    spec = make_spec("gpt2-medium", 1, 32, hardware={"vendor": "cpu"}, data={"max_seq_len": 1024})
    plan = initial_plan(spec, cpu_device(host), host, 1)
    shape = PRESETS["gpt2-medium"]
    e1 = memory.estimate(shape, tier="fast", seq_len=1024, micro_batch=1, world_size=1, precision="fp32")
    b1 = memory.estimate(shape, tier="fast", seq_len=1024, micro_batch=1, world_size=1)
    assert plan.precision == "fp32"
    assert e1.activations == 24 * (32 * 1024 + 20 * 4096) * 1024 > b1.activations
    assert plan.model_max_micro_batch == (plan.budget_bytes - plan.fixed_bytes) // plan.per_sample_bytes
    assert plan.per_rank % plan.micro_batch == 0 and plan.micro_batch <= plan.model_max_micro_batch


def test_spec_micro_batch_is_kept_and_flagged() -> None:
    spec = make_spec("gpt2-small", 1, 64, training={"global_batch": 64, "micro_batch": 32}, memory={"tier": "fast"})
    plan = initial_plan(spec, gpu(8), BIG_HOST, 1)
    assert (plan.micro_batch, plan.grad_accum, plan.micro_batch_fixed) == (32, 2, True)
    assert any("micro-batch 32 from the spec: the model does NOT fit" in r for r in plan.reasons)
    # tier auto picks the first tier where the spec's micro-batch fits
    auto = initial_plan(make_spec("gpt2-small", 1, 64, training={"micro_batch": 32}), gpu(8), BIG_HOST, 1)
    assert (auto.tier, auto.micro_batch) == ("zero2_offload", 32)
    assert any("micro-batch 32 from the spec: the model fits" in r for r in auto.reasons)


def test_spec_tier_is_kept() -> None:
    spec = make_spec("gpt2-small", 2, 64, memory={"tier": "zero3"})
    plan = initial_plan(spec, gpu(80, count=2), BIG_HOST, 2)
    assert plan.tier == "zero3" and plan.checkpointing
    assert plan.reasons[0] == "tier zero3 from the spec"


def test_bad_world_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="does not split over 3 ranks"):
        initial_plan(make_spec("gpt2-small", 1, 64), gpu(24), BIG_HOST, 3)
    spec = make_spec("gpt2-small", 1, 12, training={"global_batch": 12, "micro_batch": 4})
    with pytest.raises(ConfigError, match="micro_batch 4 does not divide the per-rank batch 6"):
        initial_plan(spec, gpu(24), BIG_HOST, 2)


@pytest.mark.parametrize(
    ("asked", "bf16", "vendor", "expected"),
    [("auto", True, "cuda", "bf16"), ("auto", False, "cuda", "fp16"), ("auto", False, "cpu", "fp32"),
     ("fp32", True, "cuda", "fp32"), ("bf16", False, "cuda", "bf16")],
)  # fmt: skip
def test_precision(asked: str, bf16: bool, vendor: str, expected: str) -> None:
    device = gpu(24, bf16=bf16) if vendor == "cuda" else cpu_device(BIG_HOST)
    spec = make_spec("gpt2-small", 1, 64, training={"global_batch": 64, "precision": asked})
    assert initial_plan(spec, device, BIG_HOST, 1).precision == expected


def test_workers_and_pinning_follow_host_memory() -> None:
    roomy = initial_plan(make_spec("gpt2-small", 2, 64), gpu(24, count=2), HostInfo(64 * GiB, 60 * GiB, 12), 2)
    assert (roomy.num_workers, roomy.pin_memory) == (5, True)  # 12 cpus / 2 ranks - 1
    tight = initial_plan(make_spec("gpt2-small", 2, 64), gpu(24, count=2), HostInfo(8 * GiB, 5 * GiB, 12), 2)
    assert (tight.num_workers, tight.pin_memory) == (0, False)
    assert any("host memory tight: 5.0 GiB available" in r for r in tight.reasons)
    spec = make_spec("gpt2-small", 2, 64, data={"num_workers": 7})
    asked = initial_plan(spec, gpu(24, count=2), HostInfo(8 * GiB, 5 * GiB, 12), 2)
    assert asked.num_workers == 7 and any("7 from the spec (auto would give 0" in r for r in asked.reasons)


def test_auto_skips_offload_tiers_the_host_cannot_hold() -> None:
    small_host = HostInfo(8 * GiB, 6 * GiB, 8)
    # 40 GiB: fast does not fit; zero2_offload's 21 GiB would fit the GPU (tests above); its 27.4 GiB of host state
    # does not (nor minimal's)
    plan = initial_plan(make_spec("qwen-1.8b", 1, 64), gpu(40, count=1), small_host, 1)
    assert plan.tier == "minimal"
    assert "zero2_offload: host RAM" in plan.reasons[0] and "no tier fits" in plan.reasons[0]


def test_path_model_is_sized_from_its_config_json(tmp_path) -> None:
    config = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
              "n_positions": 1024, "resid_pdrop": 0.0}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = make_spec("gpt2-small", 1, 64, model={"preset": None, "path": str(tmp_path)})
    from_path = initial_plan(spec, gpu(24, count=1), BIG_HOST, 1)
    from_preset = initial_plan(make_spec("gpt2-small", 1, 64), gpu(24, count=1), BIG_HOST, 1)
    assert (from_path.tier, from_path.micro_batch, from_path.estimated_bytes) == (
        from_preset.tier, from_preset.micro_batch, from_preset.estimated_bytes)  # fmt: skip
    # GPT-2's own configs train with residual dropout (0.1, also transformers' default): a 1-byte mask of each of
    # a block's two residual branches, 12 layers x 2 x 768 bytes a token more
    del config["resid_pdrop"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    dropout = initial_plan(spec, gpu(24, count=1), BIG_HOST, 1)
    assert dropout.per_sample_bytes > from_preset.per_sample_bytes


def test_size_for_tier_replans_at_a_given_tier() -> None:
    spec, device = make_spec("gpt2-small", 2, 64), gpu(24, count=2)
    fast = initial_plan(spec, device, BIG_HOST, 2)
    z3 = size_for_tier(spec, device, BIG_HOST, 2, "zero3", reasons=["OOM at fast"])
    assert z3.tier == "zero3" and z3.reasons[0] == "OOM at fast"
    assert z3.per_sample_bytes < fast.per_sample_bytes  # checkpointing keeps less per sample
    assert z3.micro_batch >= fast.micro_batch
    assert_exact(z3)


# -- Plan -------------------------------------------------------------------------------------------


def make_plan(per_rank: int, micro_batch: int, model_max: int | None = None, world: int = 1, **kw: Any) -> Plan:
    fields: dict[str, Any] = dict(
        tier="fast", micro_batch=micro_batch, grad_accum=per_rank // micro_batch, global_batch=per_rank * world,
        world_size=world, checkpointing=False, precision="bf16", num_workers=2, pin_memory=True, seq_len=1024,
        estimated_bytes=GiB + micro_batch * GiB // 2, budget_bytes=20 * GiB, fixed_bytes=GiB,
        per_sample_bytes=GiB // 2, model_max_micro_batch=micro_batch if model_max is None else model_max,
    )  # fmt: skip
    return Plan(**{**fields, **kw})


def test_plan_round_trips_through_json() -> None:
    plan = initial_plan(make_spec("gpt2-small", 2, 64), gpu(24, count=2), BIG_HOST, 2)
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    with pytest.raises(ValueError, match="unknown keys"):
        Plan.from_dict({**plan.to_dict(), "surprise": 1})
    with pytest.raises(ValueError, match="!= global batch"):
        Plan.from_dict({**plan.to_dict(), "grad_accum": plan.grad_accum + 1})


def test_with_micro_batch_recomputes_accumulation_and_estimate() -> None:
    plan = with_micro_batch(make_plan(48, 16), 6, "because")
    assert (plan.micro_batch, plan.grad_accum, plan.estimated_bytes) == (6, 8, GiB + 3 * GiB)
    assert plan.reasons[-1] == "because"
    with pytest.raises(ValueError):
        with_micro_batch(plan, 5, "not a divisor of 48")


# -- verify_micro_batch -----------------------------------------------------------------------------


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in tiers.divisors(n) if d <= limit)


@pytest.mark.parametrize("per_rank", [*range(1, 65), 96, 120, 128, 240, 360, 720, 1024])
def test_search_finds_the_largest_divisor_within_the_probe_bound(per_rank: int) -> None:
    cands = tiers.divisors(per_rank)
    bound = math.log2(per_rank) + 3
    for guess in cands:
        for true_max in range(0, per_rank + 2):
            calls: list[int] = []

            def ok(m: int, t: int = true_max, calls: list[int] = calls) -> bool:
                calls.append(m)
                return m <= t

            found, seen, done = largest_passing(cands, guess, ok)
            assert done and found == (largest_divisor_at_most(per_rank, true_max) if true_max else None)
            assert len(calls) == len(set(calls)) == len(seen) <= bound, (per_rank, guess, true_max, calls)


@pytest.mark.parametrize(
    ("per_rank", "guess", "model_max", "true_max", "expected", "max_calls"),
    [
        (64, 16, 26, 20, 16, 2),  # the model is right: the guess and its neighbour
        (64, 32, 40, 5, 4, 5),  # too optimistic: bisect down
        (96, 2, 3, 11, 8, 6),  # too pessimistic: climb over every divisor, no cap at the model's max
        (96, 2, 3, 3, 3, 5),
        (120, 8, 9, 1000, 120, 6),  # everything passes: the whole per-rank batch
        (128, 4, 4, 16, 16, 4),  # the model 4x too low still reaches the true maximum
        (7, 7, 7, 7, 7, 1),
    ],
)
def test_verify_micro_batch(per_rank: int, guess: int, model_max: int, true_max: int, expected: int,
                            max_calls: int) -> None:  # fmt: skip
    calls: list[int] = []
    plan = make_plan(per_rank, guess, model_max, world=2)
    out = verify_micro_batch(plan, lambda m: calls.append(m) is None and m <= true_max)
    assert out.micro_batch == expected and out.grad_accum == per_rank // expected
    assert out.probes == len(calls) <= max_calls
    assert all(per_rank % m == 0 for m in calls)
    assert f"micro-batch {guess} -> {expected} by {len(calls)} probe steps" in out.reasons[-1]
    assert out.estimated_bytes == GiB + expected * GiB // 2
    assert_exact(out)


def test_verify_reports_a_model_far_too_low_and_the_probe_limit() -> None:
    low = verify_micro_batch(make_plan(120, 8, 9), lambda m: m <= 60)
    assert low.micro_batch == 60 and "the memory model said 9: it overestimates" in low.reasons[-1]
    limited = verify_micro_batch(make_plan(1024, 4, 512), lambda m: m <= 300, max_probes=3)
    assert (limited.probes, limited.micro_batch) == (3, 128)  # 4 ok, 8 ok, 128 ok: out of probes before 256
    assert "stopped at the probe limit 3" in limited.reasons[-1]


def test_fixed_micro_batch_is_never_raised() -> None:
    calls: list[int] = []
    plan = make_plan(64, 8, 30, micro_batch_fixed=True)
    assert verify_micro_batch(plan, lambda m: calls.append(m) is None).micro_batch == 8 and calls == [8]
    assert verify_micro_batch(plan, lambda m: m <= 3).micro_batch == 2


def test_no_fit_raises_with_the_next_tier() -> None:
    with pytest.raises(NoFit) as err:
        verify_micro_batch(make_plan(64, 4, 4, world=2), lambda m: False)
    assert (err.value.tier, err.value.next_tier, err.value.exit_code) == ("fast", "zero2", EXIT_OOM_RETRY_TIER)
    with pytest.raises(NoFit) as one:  # one rank: sharding saves nothing, the ladder skips zero2 (as runner.oom.ladder)
        verify_micro_batch(make_plan(64, 4, 4), lambda m: False)
    assert one.value.next_tier == "zero2_offload"
    assert "no micro-batch fits" in str(err.value) and "1 OOM" in str(err.value)
    with pytest.raises(NoFit) as last:
        verify_micro_batch(make_plan(64, 4, 4, tier="minimal"), lambda m: False)
    assert last.value.next_tier is None and last.value.exit_code == EXIT_OOM_LAST_TIER


def test_verify_agrees_each_probe_over_ranks() -> None:
    # This rank fits 16, another only 6: with the MIN of every outcome all ranks end on the same answer.
    alone = verify_micro_batch(make_plan(48, 16, 16, world=2), lambda m: m <= 16, reduce_min=lambda ok: ok)
    assert alone.micro_batch == 16
    last: list[int] = []
    ranked = verify_micro_batch(
        make_plan(48, 16, 16, world=2),
        lambda m: last.append(m) is None and m <= 16,
        reduce_min=lambda ok: min(ok, int(last[-1] <= 6)),  # the other rank's outcome for the same probe
    )
    assert ranked.micro_batch == 6


# -- agree --------------------------------------------------------------------------------------------


def run_ranks(plans: list[Plan], **kw: Any) -> tuple[list[Plan], list[int]]:
    """agree() on one thread per rank with a real MIN collective over a barrier (a fake all_reduce)."""
    n = len(plans)
    barrier, lock = threading.Barrier(n, timeout=10), threading.Lock()
    slots: list[list[int]] = []
    calls = [0] * n
    out: list[Plan | None] = [None] * n

    def rank(i: int) -> None:
        def reduce_min(x: int) -> int:
            k = calls[i]
            calls[i] += 1
            with lock:
                if len(slots) <= k:
                    slots.append([])
                slots[k].append(x)
            barrier.wait()
            result = min(slots[k])
            barrier.wait()
            return result

        out[i] = agree(plans[i], reduce_min, **kw)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert all(p is not None for p in out)
    return out, calls  # type: ignore[return-value]


def test_agree_takes_the_smallest_micro_batch() -> None:
    plans = [make_plan(48, m, world=3) for m in (16, 6, 12)]
    out, calls = run_ranks(plans)
    assert [(p.micro_batch, p.grad_accum) for p in out] == [(6, 8)] * 3
    assert calls == [3, 3, 3]
    assert "micro-batch 16 -> 6: the smallest over 3 ranks; accumulation 3 -> 8" in out[0].reasons[-1]
    assert out[1] == plans[1]  # nothing changed on the rank that had the minimum
    for p in out:
        assert_exact(p)


def test_agree_takes_the_most_conservative_tier_and_precision() -> None:
    plans = [make_plan(32, 16, world=2), make_plan(32, 8, world=2, tier="zero3", checkpointing=True, precision="fp16")]
    out, _ = run_ranks(plans)
    assert {(p.tier, p.checkpointing, p.precision, p.micro_batch) for p in out} == {("zero3", True, "fp16", 8)}
    replanned = make_plan(32, 4, world=2, tier="zero3", checkpointing=True)
    out, _ = run_ranks([make_plan(32, 16, world=2), replanned], replan=lambda tier: replanned)
    assert {(p.tier, p.micro_batch) for p in out} == {("zero3", 4)}
    assert "tier fast -> zero3" in out[0].reasons[-1]
