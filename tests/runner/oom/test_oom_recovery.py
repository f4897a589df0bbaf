"""OOM recovery with real training on CPU: in-process shrink, the tier ladder, two ranks, fault injection.

Faults come from JOBSPEC_FAULT_OOM (runner/oom/faults.py): a real torch.OutOfMemoryError raised in the
model's forward, so the runner takes the same path as for an allocator failure.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobspec.contract import EXIT_OK, EXIT_OOM_LAST_TIER, TIER_STATE_FILE
from runner.checkpoint import store
from runner.data.dataset import DataOrder
from runner.oom.faults import ENV_VAR
from runner.oom.ladder import load_state
from tests.runner.train_helpers import (
    ROOT,
    Drained,
    communicate_or_fail,
    records,
    run_supervisor,
    tiny_spec,
    tiny_spec_dict,
    train_in_process,
    write_spec,
)

# Same samples, same micro-batches, same order of accumulation: the trajectories agree to float32
# rounding (measured: bit-identical on CPU); 1e-6 relative leaves room for a BLAS that reorders sums.
LOSS_RTOL = 1e-6


def events(run_dir: Path, kind: str = "oom_shrink") -> list[dict]:
    return [r for r in records(run_dir, "event") if r.get("event") == kind]


def samples(run_dir: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"samples-rank{rank}.jsonl").read_text().splitlines()]


def order_of(run_dir: Path) -> DataOrder:
    from runner.data.dataset import load_data
    from runner.data.tokenizer import ByteTokenizer

    return DataOrder(len(load_data(tiny_spec(run_dir), ByteTokenizer()).train), 8, 42)


def weights(recipe) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in recipe.accelerator.unwrap_model(recipe.model).state_dict().items()}


def test_shrink_in_process_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBSPEC_RECORD_SAMPLES", "1")
    monkeypatch.setenv(ENV_VAR, "mbs>2")
    shrunk_dir = tmp_path / "shrunk"
    code, shrunk = train_in_process(tiny_spec(shrunk_dir, training={"micro_batch": 8, "steps": 6}))
    assert code == EXIT_OK
    monkeypatch.delenv(ENV_VAR)
    plain_dir = tmp_path / "plain"
    code, plain = train_in_process(tiny_spec(plain_dir, training={"micro_batch": 2, "steps": 6}))
    assert code == EXIT_OK
    # Metrics show the shrink at step 1, in one jump: the OOM's numbers say 2 samples fit, so 8 -> 2.
    shrinks = [(e["step"], e["from_micro_batch"], e["to_micro_batch"], e["to_grad_accum"]) for e in events(shrunk_dir)]
    assert shrinks == [(1, 8, 2, 4)]
    assert "mbs>2" in events(shrunk_dir)[0]["reason"]
    # Every optimizer step saw the whole global batch, each sample once, in the planned order.
    order = order_of(shrunk_dir)
    seen = samples(shrunk_dir)
    assert [s["step"] for s in seen] == [1, 2, 3, 4, 5, 6]
    for s in seen:
        assert s["ids"] == order.step_samples(s["step"] - 1) and (s["micro_batch"], s["grad_accum"]) == (2, 4)
    for r in records(shrunk_dir):
        assert r["micro_batch"] * r["grad_accum"] * r["world_size"] == r["global_batch"] == 8
    # The loss trajectory (and the weights) of an uninterrupted micro-batch-2 run.
    losses = [r["loss"] for r in records(shrunk_dir)]
    assert losses == pytest.approx([r["loss"] for r in records(plain_dir)], rel=LOSS_RTOL)
    a, b = weights(shrunk), weights(plain)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # The shrunk plan is what the checkpoint keeps, so a resume does not hit the OOM again.
    assert store.read_meta(store.latest(shrunk_dir))["plan"]["micro_batch"] == 2
    assert not (shrunk_dir / TIER_STATE_FILE).exists()  # no tier failed: no ladder state


def test_step_fault_fires_once_and_loses_no_sample(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBSPEC_RECORD_SAMPLES", "1")
    monkeypatch.setenv(ENV_VAR, "step=3")
    run_dir = tmp_path / "run"
    spec = tiny_spec(run_dir, training={"micro_batch": 4, "steps": 6}, checkpoints={"every_steps": 2})
    code, _ = train_in_process(spec)
    assert code == EXIT_OK
    assert [(e["step"], e["from_micro_batch"], e["to_micro_batch"]) for e in events(run_dir)] == [(3, 4, 2)]
    order = order_of(run_dir)
    seen = samples(run_dir)
    assert [s["step"] for s in seen] == [1, 2, 3, 4, 5, 6]  # step 3 recorded once: redone, not repeated
    assert [s["micro_batch"] for s in seen] == [4, 4, 2, 2, 2, 2]
    for s in seen:
        assert s["ids"] == order.step_samples(s["step"] - 1)
    all_ids = [i for s in seen for i in s["ids"]]
    assert len(all_ids) == len(set(all_ids)) == 6 * 8  # none lost, none counted twice
    # "Once" survives a restart: a new process resuming from step 2 redoes step 3 without an OOM.
    for late in ("step-4", "step-6"):
        checkpoint_dir = run_dir / late
        for p in sorted(checkpoint_dir.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        checkpoint_dir.rmdir()
    code, again = train_in_process(spec)
    assert code == EXIT_OK and again.guard.injector is not None and again.guard.injector.injected == 0
    assert len(events(run_dir)) == 1


def test_tier_fault_steps_down_in_process_from_the_checkpoint_and_stays_down(tmp_path):
    run_dir = tmp_path / "run"
    # A clean start that leaves checkpoint step-4 at tier fast.
    assert train_in_process(tiny_spec(run_dir, training={"micro_batch": 8, "steps": 4}))[0] == EXIT_OK
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run_dir, training={"micro_batch": 8, "steps": 6}))
    result = run_supervisor([str(spec)], JOBSPEC_RECORD_SAMPLES="1", **{ENV_VAR: "tier=fast"})
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert "tier fast -> zero2_offload in process" in result.stderr  # one rank: zero2 would save nothing
    assert "relaunching" not in result.stderr
    state = load_state(run_dir)
    assert state is not None and state.tier == "zero2_offload" and state.failed_tiers() == ["fast"]
    plans = records(run_dir, "plan")
    assert [(p["tier"], p["step"]) for p in plans] == [("fast", 0), ("fast", 4), ("zero2_offload", 4)]
    assert plans[1]["pid"] == plans[2]["pid"]  # one worker process: no relaunch
    change = events(run_dir, "tier_change")
    assert [(e["from_tier"], e["to_tier"], e["in_process"]) for e in change] == [("fast", "zero2_offload", True)]
    assert [r["step"] for r in records(run_dir) if r["tier"] == "zero2_offload"] == [5, 6]
    order = order_of(run_dir)
    assert [(s["step"], s["ids"]) for s in samples(run_dir)] == [(k, order.step_samples(k - 1)) for k in (5, 6)]
    # A second restart (the fault still set) starts at the persisted tier, with no new failure.
    code, again = train_in_process(tiny_spec(run_dir, training={"micro_batch": 8, "steps": 8}))
    assert code == EXIT_OK and again.plan.tier == "zero2_offload"
    assert load_state(run_dir).failed_tiers() == ["fast"] and records(run_dir)[-1]["step"] == 8


def test_an_in_process_step_down_trains_the_same_weights_as_an_unfaulted_run(tmp_path, monkeypatch):
    clean, faulted = tmp_path / "clean", tmp_path / "faulted"
    from safetensors.torch import load_file

    assert train_in_process(tiny_spec(clean, training={"micro_batch": 8, "steps": 6}))[0] == EXIT_OK
    monkeypatch.setenv(ENV_VAR, "tier=fast")
    code, got = train_in_process(tiny_spec(faulted, training={"micro_batch": 8, "steps": 6}))
    assert code == EXIT_OK and got.plan.tier == "zero2_offload"
    losses = {r["step"]: r["loss"] for r in records(clean)}
    assert {r["step"]: r["loss"] for r in records(faulted)} == pytest.approx(losses, rel=1e-5)
    a, b = (load_file(run / "model" / "model.safetensors") for run in (clean, faulted))  # the exported weights
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_every_tier_failing_exits_76_with_the_reason_and_keeps_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    assert train_in_process(tiny_spec(run_dir, training={"micro_batch": 2, "steps": 3}))[0] == EXIT_OK
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run_dir, training={"micro_batch": 2, "steps": 6}))
    term = tmp_path / "termination-log"
    fault = "tier=fast,tier=zero2_offload,tier=minimal"
    result = run_supervisor([str(spec)], JOBSPEC_TERMINATION_LOG=str(term), **{ENV_VAR: fault})
    assert result.returncode == EXIT_OOM_LAST_TIER, result.stderr[-3000:]
    message = json.loads(term.read_text())
    assert message["exit_code"] == EXIT_OOM_LAST_TIER
    assert "out of memory at the last memory tier (minimal) with micro-batch 1" in message["reason"]
    assert "fast:" in message["reason"] and "zero2_offload:" in message["reason"]
    assert [p["tier"] for p in records(run_dir, "plan")] == ["fast", "fast", "zero2_offload", "minimal"]
    # Nothing corrupted: step-3 is still the newest complete checkpoint, and it trains on.
    assert store.latest(run_dir) == run_dir / "step-3"
    code, _ = train_in_process(tiny_spec(run_dir, training={"micro_batch": 2, "steps": 4}))
    assert code == EXIT_OK and records(run_dir)[-1]["step"] == 4


def test_fallback_false_fails_at_once_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "tier=fast")
    run_dir = tmp_path / "run"
    code, recipe = train_in_process(tiny_spec(run_dir, training={"micro_batch": 2}, memory={"fallback": False}))
    assert code == EXIT_OOM_LAST_TIER
    assert "memory.fallback is false" in recipe.status["reason"]
    state = load_state(run_dir)
    assert state is not None and state.exhausted and state.tier == "fast"


RANK_SCRIPT = """
import sys, torch
from jobspec.spec.loader import load_spec
from runner.train.recipe import Recipe
r = Recipe(load_spec(sys.argv[1]))
r.setup()
code = r.train()
torch.save({k: v.detach() for k, v in r.accelerator.unwrap_model(r.model).state_dict().items()}, sys.argv[2])
r.cleanup()
from runner.process.worker import _exit
_exit(code)  # as the worker leaves: no C++ teardown of gloo's threads (std::terminate, -6, after a finished run)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_ranks_one_oom_no_hang_both_shrink_same_weights(tmp_path):
    run_dir = tmp_path / "run"
    # Per rank 4 samples at micro-batch 4: the OOM hits the only micro-step, the one whose backward
    # would carry DDP's gradient all-reduce: the case that hangs when gradients move inside backward.
    sections = {"training": {"micro_batch": 4, "steps": 4}, "checkpoints": {"every_steps": 2}}
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run_dir, **sections))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "JOBSPEC_RECORD_SAMPLES": "1",
           ENV_VAR: "mbs>2,rank=1"}  # fmt: skip
    procs = [
        Drained([sys.executable, "-c", RANK_SCRIPT, str(spec), str(tmp_path / f"w{r}.pt")], cwd=ROOT,
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    try:  # a hang fails here, bounded, naming the rank
        errs = [communicate_or_fail(p, f"rank {r} of the two-rank OOM run")[1] for r, p in enumerate(procs)]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [EXIT_OK, EXIT_OK], errs[1][-3000:]
    # Rank 1 ran out alone; both ranks agreed and shrank 4 -> 2 at step 1, and stayed there.
    assert [(e["step"], e["oom_rank"], e["from_micro_batch"], e["to_micro_batch"]) for e in events(run_dir)] == [
        (1, 1, 4, 2)
    ]
    order = order_of(run_dir)
    for rank in (0, 1):
        assert [(s["micro_batch"], s["grad_accum"]) for s in samples(run_dir, rank)] == [(2, 2)] * 4
    for s0, s1 in zip(samples(run_dir, 0), samples(run_dir, 1), strict=True):
        assert s0["ids"] + s1["ids"] == order.step_samples(s0["step"] - 1)
    w0, w1 = (torch.load(tmp_path / f"w{r}.pt") for r in (0, 1))
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    # Gradients exchanged after the agreement equal one process accumulating all 8 samples.
    one = tmp_path / "one"
    assert train_in_process(tiny_spec(one, **sections))[0] == EXIT_OK
    assert [r["loss"] for r in records(run_dir)] == pytest.approx([r["loss"] for r in records(one)], rel=1e-5)


FULL_WEIGHTS_SCRIPT = RANK_SCRIPT.replace(  # FSDP2 holds DTensor shards: gather each in full (collective)
    "{k: v.detach() for k, v in", "{k: getattr(v, 'full_tensor', lambda: v)().detach() for k, v in"
)


def run_two_ranks(tmp_path: Path, spec: Path, **env_vars: str) -> list[str]:
    """Both ranks of `spec` as two processes on loopback; their stderr. Each saves its full weights."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "JOBSPEC_RECORD_SAMPLES": "1", **env_vars}  # fmt: skip
    procs = [
        Drained([sys.executable, "-c", FULL_WEIGHTS_SCRIPT, str(spec), str(tmp_path / f"w{r}.pt")],
                         cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE,
                         text=True)
        for r in (0, 1)
    ]  # fmt: skip
    try:  # a hang fails here, bounded, naming the rank
        errs = [communicate_or_fail(p, f"rank {r} of the two-rank run")[1] for r, p in enumerate(procs)]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [EXIT_OK, EXIT_OK], errs[1][-3000:] + errs[0][-3000:]
    return errs


@pytest.mark.parametrize(
    ("tier", "where", "micro_batch"),
    [("zero2", "backward", 4), ("minimal", "backward", 4),
     # the sweep tier (pytest -m sweep; zero3 on two ranks by default: test_oom_anywhere's sampled-op case)
     pytest.param("zero3", "backward", 4, marks=pytest.mark.sweep),
     pytest.param("zero3", "forward", 4, marks=pytest.mark.sweep),
     # an accumulation micro-step (it reduce-scatters too: runner/train/step.py)
     pytest.param("zero2", "backward", 2, marks=pytest.mark.sweep)],
)  # fmt: skip
def test_sharded_tier_rank_local_oom_shrinks_every_rank_in_process(tmp_path, tier, where, micro_batch):
    """Rank 1 alone runs out, mid-backward (or before its forward): the ranks agree before FSDP's next
    collective (runner/oom/fsdp.py), both shrink in the same process, and redo the step from the same
    samples; the weights are the same on both ranks and the losses those of one process at the new size."""
    run_dir = tmp_path / "run"
    sections = {"training": {"micro_batch": micro_batch, "steps": 3}, "memory": {"tier": tier}}
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run_dir, **sections))
    limit = micro_batch // 2
    rules = f"mbs>{limit},rank=1" + (",backward" if where == "backward" else "")
    errs = run_two_ranks(tmp_path, spec, **{ENV_VAR: rules})
    # Rank 0 learnt of it inside FSDP, before a gather or reduce-scatter rank 1 would never have joined (every
    # micro-step's backward reduce-scatters: FSDP keeps its gradients sharded while accumulating).
    inside = "rank 0: rank 1 ran out of memory; agreed before an FSDP collective" in errs[0]
    assert inside, errs[0][-4000:]
    assert [(e["step"], e["oom_rank"], e["from_micro_batch"], e["to_micro_batch"]) for e in events(run_dir)] == [
        (1, 1, micro_batch, limit)
    ]
    assert [(p["tier"], p["micro_batch"]) for p in records(run_dir, "plan")] == [(tier, micro_batch)]  # no restart
    assert load_state(run_dir) is None or load_state(run_dir).caps == {}
    order = order_of(run_dir)
    for s0, s1 in zip(samples(run_dir, 0), samples(run_dir, 1), strict=True):
        assert s0["ids"] + s1["ids"] == order.step_samples(s0["step"] - 1)
        assert (s0["micro_batch"], s1["micro_batch"]) == (limit, limit)
    w0, w1 = (torch.load(tmp_path / f"w{r}.pt") for r in (0, 1))
    assert w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    one = tmp_path / "one"  # the same 8 samples a step, accumulated in one process at the new micro-batch
    assert train_in_process(tiny_spec(one, training={"micro_batch": limit, "steps": 3}))[0] == EXIT_OK
    assert [r["loss"] for r in records(run_dir)] == pytest.approx([r["loss"] for r in records(one)], rel=1e-5)


def test_sharded_tier_rank_local_oom_restarts_all_ranks_without_the_agreement(tmp_path):
    """JOBSPEC_FSDP_AGREE=0 (and a torch without FSDP2's custom collectives): no agreement before FSDP's
    collectives, so rank 1 records a micro-batch cap and exits 75, and the supervisor restarts both ranks."""
    run_dir = tmp_path / "run"
    sections = {"training": {"micro_batch": 4, "steps": 3}, "memory": {"tier": "zero3"}}
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run_dir, **sections))
    result = run_supervisor([str(spec), "--nproc", "2"], JOBSPEC_KILL_GRACE_S="5", JOBSPEC_FSDP_AGREE="0",
                            **{ENV_VAR: "mbs>2,rank=1"})  # fmt: skip
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert "relaunching at the same tier, with a smaller micro-batch" in result.stderr
    state = load_state(run_dir)
    assert state is not None and state.caps == {"zero3": 2} and state.failed == []
    assert [(p["tier"], p["micro_batch"]) for p in records(run_dir, "plan")] == [("zero3", 4), ("zero3", 2)]
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]


@pytest.mark.parametrize("tier", ["fast", "zero3"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_recovers_from_an_oom_inside_a_block(tmp_path, where, tier):
    """A real OOM escapes from the middle of a sharded model (one rank, FSDP2 zero3): the step is redone
    at a smaller micro-batch and the run matches an uninterrupted one at that micro-batch."""
    from runner.train.recipe import Recipe

    def run(run_dir: Path, micro_batch: int, fail: bool) -> list[float]:
        recipe = Recipe(tiny_spec(run_dir, training={"micro_batch": micro_batch, "steps": 3},
                                  memory={"tier": tier}))  # fmt: skip
        try:
            recipe.setup()
            block = recipe.accelerator.unwrap_model(recipe.model).transformer.h[1]
            fired: list[int] = []

            def boom(*_: object) -> None:
                if fail and not fired and recipe.step == 1:  # once, in optimizer step 2
                    fired.append(1)
                    raise torch.OutOfMemoryError(f"CUDA out of memory (test: inside a block's {where})")

            if where == "forward":
                block.register_forward_hook(lambda m, i, o: boom())
            else:
                block.register_full_backward_hook(lambda m, gi, go: boom())
            assert recipe.train() == EXIT_OK and fired == ([1] if fail else [])
        finally:
            recipe.cleanup()
        return [r["loss"] for r in records(run_dir)]

    shrunk = run(tmp_path / "shrunk", 4, True)
    assert [(e["step"], e["from_micro_batch"], e["to_micro_batch"]) for e in events(tmp_path / "shrunk")] == [(2, 4, 2)]
    assert shrunk == pytest.approx(run(tmp_path / "plain4", 4, False)[:1] + run(tmp_path / "plain2", 2, False)[1:],
                                   rel=1e-5)  # fmt: skip


def test_an_oom_mid_backward_under_the_supervisor_shrinks_in_process(tmp_path):
    """Under the supervisor accelerate wraps even one worker in DDP, whose reducer an OOM mid-backward leaves
    half done: the redo must reset it (else "Expected to have finished reduction in the prior iteration")."""
    run_dir = tmp_path / "run"
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run_dir, training={"micro_batch": 8, "steps": 3}))
    result = run_supervisor([str(spec)], **{ENV_VAR: "mbs>4,backward"})
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert [(e["step"], e["from_micro_batch"], e["to_micro_batch"]) for e in events(run_dir)] == [(1, 8, 4)]
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]


def test_a_shrink_logs_its_release_and_its_redo(tmp_path, monkeypatch, caplog):
    """Never silent: the OOM and the release of the failed attempt's memory (when it starts and ends, with its
    duration), the new micro-batch, the redo starting, and the step recovered, in that order."""
    import logging

    caplog.set_level(logging.INFO, logger="jobspec.runner")
    monkeypatch.setenv(ENV_VAR, "mbs>2")
    code, _ = train_in_process(tiny_spec(tmp_path, training={"micro_batch": 8, "steps": 3}))
    assert code == EXIT_OK
    lines = [r.getMessage() for r in caplog.records if r.name == "jobspec.runner"]
    wanted = [
        lambda m: m.startswith("step 1: out of memory at micro-batch 8 on rank 0") and m.endswith(" ..."),
        lambda m: m.startswith("step 1: out of memory at micro-batch 8 on rank 0") and ": done in " in m,
        lambda m: m.startswith("plan: micro-batch 8 -> 2 ") and "global batch 8 unchanged" in m,
        lambda m: m == "step 1: redoing it at micro-batch 2 x 4 ...",
        lambda m: m.startswith("step 1 recovered from its OOM"),
    ]
    at = [next(i for i, m in enumerate(lines) if want(m)) for want in wanted]
    assert at == sorted(at), [lines[i] for i in at]
