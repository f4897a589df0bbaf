"""The runner's starting micro-batch from a trace of its own step (runner/sizing/traced.py, `memory.trace`).

The trace runs for real (a process of its own, the tiny preset on fake tensors); only its failure is faked, at the
boundary (run_trace)."""

from __future__ import annotations

import pytest

from jobspec.catalog.tiers import divisors
from jobspec.plan import memory
from jobspec.plan.traced import TraceFailed
from runner.sizing import traced
from runner.sizing.hostmem import HostInfo
from runner.sizing.plan import initial_plan
from runner.sizing.probe import DeviceInfo
from runner.train.trace import trace_spec
from tests.runner.train_helpers import tiny_spec, train_in_process

GiB = 1024**3
HOST = HostInfo(64 * GiB, 60 * GiB, 16)
# a GPU whose budget, after the model's 1 GiB allowance, leaves the tiny model room for a few dozen samples
GPU = DeviceInfo("cuda", "small", int(1.3 * GiB), int(1.3 * GiB), (9, 0), True, 1, "pynvml")


def _spec(tmp_path, **memory_section):
    return tiny_spec(tmp_path, data={"max_seq_len": 512}, training={"global_batch": 256, "precision": "bf16"},
                     memory={"tier": "fast", **memory_section})  # fmt: skip


def from_trace(plan, spec, share, *, is_main):
    """`from_traces` at the tier the spec names: it never steps to another."""
    return traced.from_traces(plan, spec, share, is_main=is_main, replan=lambda tier: pytest.fail(f"replanned {tier}"))


def test_only_where_it_is_wanted(tmp_path):
    auto, on, off = (_spec(tmp_path, trace=t) for t in ("auto", "on", "off"))
    assert traced.wanted(auto, on_gpu=True) and not traced.wanted(auto, on_gpu=False)
    assert traced.wanted(on, on_gpu=False) and not traced.wanted(off, on_gpu=True)
    fixed = tiny_spec(tmp_path, training={"micro_batch": 2}, memory={"trace": "on"})
    assert not traced.wanted(fixed, on_gpu=True)  # the spec's micro-batch: nothing to choose


def test_the_line_through_two_traces_sizes_the_micro_batch(tmp_path):
    spec = _spec(tmp_path, trace="on")
    plan = initial_plan(spec, GPU, HOST, 1)
    new = from_trace(plan, spec, lambda line: list(line), is_main=True)
    # the process ran what the runner's trace runs in process, at the model's micro-batch and twice it
    m1 = plan.micro_batch
    low, high = (row["peak"] for row in trace_spec(spec, [(plan.tier, m1), (plan.tier, 2 * m1)], 1, plan.precision))
    per_sample = -(-(high - low) // m1)
    fixed = low - per_sample * m1
    assert per_sample > 0 and new.fixed_bytes == traced._with_overhead(fixed)
    assert new.per_sample_bytes == per_sample + per_sample * memory.OVERHEAD_PERCENT // 100
    budget = plan.budget_bytes
    fits = [m for m in range(1, plan.per_rank + 1) if traced._with_overhead(fixed + per_sample * m) <= budget]
    assert new.model_max_micro_batch == max(fits) and 1 < max(fits) < plan.per_rank
    assert new.micro_batch == max(d for d in divisors(plan.per_rank) if d <= max(fits))
    assert new.micro_batch * new.grad_accum == plan.per_rank and new.estimated_bytes <= plan.budget_bytes
    assert any(f"from the trace of tier {plan.tier}" in r for r in new.reasons)


def test_a_failed_trace_keeps_the_models_plan(tmp_path, monkeypatch):
    spec = _spec(tmp_path, trace="on")
    plan = initial_plan(spec, GPU, HOST, 1)

    def slow(*args, **kwargs):
        raise TraceFailed("the trace took longer than 180 s", timed_out=True)

    monkeypatch.setattr(traced, "run_trace", slow)
    kept = from_trace(plan, spec, lambda line: list(line), is_main=True)
    assert (kept.micro_batch, kept.fixed_bytes, kept.per_sample_bytes) == (
        plan.micro_batch, plan.fixed_bytes, plan.per_sample_bytes)  # fmt: skip
    assert "trace: none (the trace took longer than 180 s)" in kept.reasons[-1]


def test_every_rank_sizes_from_rank_0s_line(tmp_path, monkeypatch):
    """Rank 0 traces; the others, which send zeros, take its line from the all-reduce MAX and end on its plan."""
    spec = _spec(tmp_path, trace="on")
    plan = initial_plan(spec, GPU, HOST, 1)
    sent: list[list[float]] = []

    def rank0_share(line):
        sent.append(list(line))
        return list(line)

    rank0 = from_trace(plan, spec, rank0_share, is_main=True)
    monkeypatch.setattr(traced, "run_trace", pytest.fail)  # another rank never traces
    rank1 = from_trace(plan, spec, lambda line: [max(a, b) for a, b in zip(line, sent[0], strict=True)],
                              is_main=False)  # fmt: skip
    assert (rank1.micro_batch, rank1.fixed_bytes, rank1.per_sample_bytes) == (
        rank0.micro_batch, rank0.fixed_bytes, rank0.per_sample_bytes)  # fmt: skip


@pytest.mark.slow
def test_a_run_starts_from_the_trace(tmp_path):
    """`memory.trace: on` on this CPU machine: the worker traces, plans from the line and trains."""
    spec = tiny_spec(tmp_path, training={"steps": 3}, memory={"trace": "on"})
    code, worker = train_in_process(spec)
    assert code == 0
    assert any("from the trace of tier fast" in r for r in worker.plan.reasons)


def test_a_tier_measured_on_the_gpu_before_is_not_traced(tmp_path):
    """An earlier run's measured peak in the run directory corrects the model (tests/test_calibration.py) and wins
    over a trace: the recipe asks `measured_here` first."""
    from runner.sizing.plan import measured_here
    from tests.test_calibration import write_run

    spec = _spec(tmp_path / "run", trace="on")
    assert not measured_here(spec, "fast")
    write_run(tmp_path / "run", tier="fast", micro_batch=4, peak=3 * GiB, step_s=1.0, device="cpu")
    assert not measured_here(spec, "fast")  # a CPU run measures no device memory
    write_run(tmp_path / "run", tier="fast", micro_batch=4, peak=3 * GiB, step_s=1.0)
    assert measured_here(spec, "fast") and not measured_here(spec, "zero3")
    plan = initial_plan(spec, GPU, HOST, 1)
    kept = traced.skipped(plan, "this run directory measured the tier on the GPU before, which wins")
    assert kept.micro_batch == plan.micro_batch and "trace: none (this run directory measured" in kept.reasons[-1]


def test_under_tier_auto_a_tier_the_trace_fits_nothing_of_passes_to_the_next(tmp_path, monkeypatch):
    """The model chose `fast`; the trace of `fast` (faked here at `trace_line`, the subprocess's result) says not even
    micro-batch 1 fits: the runner plans `zero2_offload` (zero2 saves nothing on one rank) and traces that."""
    from runner.sizing.plan import size_for_tier

    spec = _spec(tmp_path, trace="on", tier="auto")
    plan = initial_plan(spec, GPU, HOST, 1)
    assert plan.tier == "fast"
    asked: list[str] = []

    def line(spec, tier, world_size, precision, micro_batches, timeout_s, quantize=None):
        asked.append(tier)
        return (2 * GiB, 1024**2) if tier == "fast" else (GiB // 8, 1024**2)  # fast: the states alone overflow

    monkeypatch.setattr(traced, "trace_line", line)
    replan = lambda tier: size_for_tier(spec, GPU, HOST, 1, tier)  # noqa: E731
    new = traced.from_traces(plan, spec, lambda x: list(x), is_main=True, replan=replan)
    assert asked == ["fast", "zero2_offload"]
    assert new.tier == "zero2_offload" and new.model_max_micro_batch > 0
    assert any("the trace of tier fast fits no micro-batch: tier zero2_offload" in r for r in new.reasons)
    assert any("from the trace of tier zero2_offload" in r for r in new.reasons)

    fixed_tier = _spec(tmp_path, trace="on", tier="fast")  # a tier the spec names is kept: the probes decide
    asked.clear()
    kept = traced.from_traces(initial_plan(fixed_tier, GPU, HOST, 1), fixed_tier, lambda x: list(x), is_main=True,
                              replan=replan)  # fmt: skip
    assert asked == ["fast"] and kept.tier == "fast" and kept.model_max_micro_batch == 0


def test_the_step_down_stops_when_the_trace_time_is_spent(tmp_path, monkeypatch):
    spec = _spec(tmp_path, trace="on", tier="auto", trace_seconds=10)
    plan = initial_plan(spec, GPU, HOST, 1)
    clock = iter([0.0, 100.0, 100.0, 100.0])
    monkeypatch.setattr(traced.time, "monotonic", lambda: next(clock, 100.0))
    monkeypatch.setattr(traced, "trace_line", lambda *a: (2 * GiB, 1024**2))
    from runner.sizing.plan import size_for_tier

    new = traced.from_traces(plan, spec, lambda x: list(x), is_main=True,
                             replan=lambda tier: size_for_tier(spec, GPU, HOST, 1, tier))  # fmt: skip
    assert new.tier == "zero2_offload"  # planned by the model, not traced: no time was left
    assert "trace: none (no time left of memory.trace_seconds 10)" in new.reasons[-1]


def test_a_traced_line_is_read_back_from_the_cache_for_the_same_step_only(tmp_path, monkeypatch):
    """The line is stored beside the data cache by everything the trace depends on (runner/sizing/trace_cache.py): the
    same step reads it back without tracing, and plans the same; another step, a forged or linked file trace again."""
    from runner.data.cache import usable_root
    from runner.sizing import trace_cache

    calls: list[tuple] = []

    def line(*args):
        calls.append(args)
        return 2 * GiB // 10, 8 * 1024**2

    monkeypatch.setattr(traced, "trace_line", line)
    spec = _spec(tmp_path, trace="on")
    plan = initial_plan(spec, GPU, HOST, 1)
    first = from_trace(plan, spec, lambda x: list(x), is_main=True)
    again = from_trace(plan, spec, lambda x: list(x), is_main=True)
    assert len(calls) == 1 and again == first and "from the trace of tier fast" in first.reasons[-1]
    (stored,) = usable_root(spec).glob("trace-*.json")
    other = _spec(tmp_path, trace="on", trace_seconds=99)  # memory.* is in the key (the spec as the trace reads it)
    from_trace(initial_plan(other, GPU, HOST, 1), other, lambda x: list(x), is_main=True)
    assert len(calls) == 2 and len(list(usable_root(spec).glob("trace-*.json"))) == 2
    key, _ = trace_cache.key(traced.trace_spec(spec, None), tier="fast", world_size=1, precision="bf16",
                             micro_batches=(plan.micro_batch, 2 * plan.micro_batch), quantize=None)  # fmt: skip
    assert stored.name == f"trace-{key}.json"
    zero2, _ = trace_cache.key(traced.trace_spec(spec, None), tier="zero2", world_size=1, precision="bf16",
                               micro_batches=(plan.micro_batch, 2 * plan.micro_batch), quantize=None)  # fmt: skip
    assert zero2 != key
    # a file naming another key (copied from another entry), and then a link in its place: traced again each time
    stored.write_text(stored.read_text().replace(key, "0" * 64))
    from_trace(plan, spec, lambda x: list(x), is_main=True)
    assert len(calls) == 3 and key in stored.read_text()  # traced, and written again
    target = tmp_path / "elsewhere.json"
    target.write_text(stored.read_text())
    stored.unlink()
    stored.symlink_to(target)
    from_trace(plan, spec, lambda x: list(x), is_main=True)
    assert len(calls) == 4 and not stored.is_symlink()  # the link was not followed, and was replaced


def test_no_trace_when_every_ranks_model_plan_has_clear_margin(tmp_path, monkeypatch):
    """`memory.trace: auto`: the model takes the whole per-rank batch within CLEAR_MARGIN of the budget, so a trace
    could not raise the micro-batch: none runs (the probe steps verify it). One rank without that margin: all trace."""
    big = DeviceInfo("cuda", "big", 80 * GiB, 80 * GiB, (9, 0), True, 1, "pynvml")
    spec = tiny_spec(tmp_path, data={"max_seq_len": 512}, training={"global_batch": 16, "precision": "bf16"},
                     memory={"tier": "fast", "trace": "auto"})  # fmt: skip
    plan = initial_plan(spec, big, HOST, 1)
    assert plan.micro_batch == plan.per_rank and plan.estimated_bytes <= traced.CLEAR_MARGIN * plan.budget_bytes
    monkeypatch.setattr(traced, "trace_line", lambda *a: pytest.fail("traced with clear margin"))
    kept = from_trace(plan, spec, lambda x: list(x), is_main=True)
    assert kept.micro_batch == plan.micro_batch and "could not raise it" in kept.reasons[-1]
    monkeypatch.setattr(traced, "trace_line", lambda *a: (GiB // 10, 1024**2))
    another = from_trace(plan, spec, lambda x: [1.0] if len(x) == 1 else list(x), is_main=True)  # a rank says trace
    assert "from the trace of tier fast" in another.reasons[-1]
