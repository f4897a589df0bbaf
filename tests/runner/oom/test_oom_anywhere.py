"""OOM at any op (runner/oom/anywhere.py, bench/oom_anywhere.py): the dispatch-mode injector, a fixed-seed sample of the
recovery matrix on one rank and on two, and the H100 record's failures reproduced on the CPU.

Real training of the tiny preset; the only fake is the OOM itself, a real `torch.OutOfMemoryError` raised before the
k-th allocating op of a region, which takes the same path as an allocator's."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import oom_anywhere as sweep
from jobspec.contract import EXIT_OK
from runner.oom.anywhere import OpFault
from runner.oom.detect import is_oom
from runner.oom.faults import ENV_VAR, parse_rules
from tests.runner.train_helpers import ROOT, records, tiny_spec, train_in_process

SEED = 20261127


def _loud(n: int, op: str) -> str:
    return f"CUDA out of memory (test: op {n}, {op})"


def test_the_mode_counts_allocating_ops_only_and_raises_a_real_oom_once():
    x = torch.randn(4, 4, requires_grad=True)
    with OpFault(10**9, "cpu", _loud) as counting:
        y = (x @ x).relu()  # mm, relu: 2
        y.t()  # a view: 0
        z = torch.empty(4, 4)  # 1
        z.fill_(1.0)  # in place: 0
        torch.mul(y.detach(), 2, out=z)  # a view, and an out= op: 0
        y.sum().backward()  # sum, and backward's ones_like, threshold_backward, 2 mm, add: 6
    assert counting.ops == 9 and not counting.fired
    fired: list[int] = []
    with pytest.raises(torch.OutOfMemoryError) as err, OpFault(3, "cpu", _loud, lambda: fired.append(1)) as mode:
        (x @ x).relu().sum()
    assert is_oom(err.value) and "op 3, aten.sum" in str(err.value) and fired == [1] and mode.ops == 3
    with mode:  # fired: the same mode lets everything through
        (x @ x).relu().sum()
    with OpFault(1, "cuda", _loud) as elsewhere:  # only allocations on the training device count
        (x @ x).sum()
    assert elsewhere.ops == 0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("step=2,op=0", "op=K counts from 1"),
        ("step=2,op=3,op=4", "op=N is given twice"),
        ("step=2,during=eval", "needs op=N"),
        ("step=2,op=3,during=lunch", "unknown region during='lunch'"),
        ("step=2,op=3,backward", "keep one"),
    ],
)
def test_bad_op_rules_are_refused(text, needle):
    from jobspec.errors import ConfigError

    with pytest.raises(ConfigError, match=ENV_VAR) as err:
        parse_rules(text)
    assert needle in str(err.value)


def test_op_rules_parse():
    rules = parse_rules("step=3,op=41,during=probe,rank=1")
    assert (rules.op, rules.during, rules.probes, rules.rank, rules.steps) == (41, "probe", True, 1, frozenset({3}))


def _matrix(cfgs, tmp_path, points=1):
    logging.disable(logging.WARNING)
    try:
        return sweep.sweep_configs(cfgs, tmp_path, points=points, seed=SEED, budget_s=1e9, log=lambda _m: None)
    finally:
        logging.disable(logging.NOTSET)


def _assert_recovered(out):
    bad = [r for r in out["rows"] if not r["ok"]]
    assert not bad, "\n".join(f"{r['config']} op {r['op']}: {r['outcome']}: {r['problems']}" for r in bad)
    assert out["points"] > 0


def test_one_rank_every_tier_and_region_recovers_at_a_sampled_op(tmp_path):
    """A sampled op at micro-batch 1 of every tier (nothing left to shrink: the step-down from each tier), and every
    other region (first step, a later step, evaluation, checkpoint, probe step) at one tier each, in turn; LoRA and
    checkpointing alternating: training goes on and ends where a clean run ends. The whole tier x region matrix (30
    runs, several minutes on 2 cores) is `python -m bench.oom_anywhere --ranks 1`."""
    tiers, others = list(sweep.TIERS), [r for r in sweep.REGIONS if r != "train-mb1"]
    pairs = [(tier, "train-mb1") for tier in tiers] + [(tiers[j % len(tiers)], r) for j, r in enumerate(others)]
    cfgs = [sweep.Config(tier, 1, "all", lora=i % 2 == 1, checkpointing=i % 3 == 0, region=region)
            for i, (tier, region) in enumerate(pairs)]  # fmt: skip
    out = _matrix(cfgs, tmp_path)
    _assert_recovered(out)
    seen = {r["outcome"] for r in out["rows"]}
    assert {"shrink", "step-down", "retry", "eval-shrink"} <= seen, seen


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tier", "oom_on", "region"),
    [("zero3", "one", "train"),
     # the sweep tier (pytest -m sweep; 40-90 s each on 2 cores): the default tier keeps the one above (an OOM on both
     # ranks at once: test_oom_recovery's two-rank cases and the one-rank matrix's eval regions)
     pytest.param("zero2", "all", "eval", marks=pytest.mark.sweep),
     pytest.param("fast", "one", "train-mb1", marks=pytest.mark.sweep),
     pytest.param("zero3", "one", "save", marks=pytest.mark.sweep),
     # every rank probes though one has the rule, DDP's exchange after agreeing
     pytest.param("fast", "one", "probe", marks=pytest.mark.sweep)],
)
def test_two_ranks_recover_at_a_sampled_op_with_no_hang(tmp_path, tier, oom_on, region):
    """Two ranks on gloo, the OOM on rank 1 alone or on both: every rank agrees, nobody waits in a collective the
    other will not join, both train the clean run's samples to the same weights."""
    out = _matrix([sweep.Config(tier, 2, oom_on, region=region)], tmp_path)
    _assert_recovered(out)


def test_an_oom_anywhere_in_the_optimizer_step_is_absorbed_with_bit_identical_weights(tmp_path, monkeypatch):
    """The last allocating ops of a step are the optimizer step's preparation (runner/train/update.py): an OOM there
    is retried in place, and the run trains exactly the clean run's weights, bit for bit."""
    logging.disable(logging.WARNING)
    cfg = sweep.Config("fast", 1, "all", region="train")
    clean = sweep.run(cfg, tmp_path / "clean", None)
    n, _ = sweep.region_ops(cfg, tmp_path / "count")
    absorbed = 0
    for k in range(n - 7, n + 1):
        got = sweep.run(cfg, tmp_path / f"op{k}", cfg.fault(k))
        outcome, problems, _ = sweep.check(cfg, got, clean)
        assert not problems, (k, problems)
        if outcome == "absorbed":
            absorbed += 1
            assert all(torch.equal(got.weights[name], w) for name, w in clean.weights.items()), k
    logging.disable(logging.NOTSET)
    assert absorbed >= 4


def test_an_oom_inside_optimizer_step_is_finished_alone_from_where_it_stopped(tmp_path, monkeypatch):
    """`optimizer.step()` itself fails (the second parameter group, once): the group already stepped is not stepped
    again, Adam's step counters are put back, and the weights equal a clean run's bit for bit."""
    clean_code, clean = train_in_process(tiny_spec(tmp_path / "clean", training={"steps": 3}))
    calls = {"n": 0}
    real = torch.optim.AdamW.step

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # step 2's second group (each step steps its two groups one at a time)
            raise torch.OutOfMemoryError("CUDA out of memory (test: in the fused AdamW kernel)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", flaky)
    code, got = train_in_process(tiny_spec(tmp_path / "got", training={"steps": 3}))
    assert clean_code == code == EXIT_OK and calls["n"] == 7
    a, b = (r.accelerator.unwrap_model(r.model).state_dict() for r in (got, clean))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert float(next(iter(got.stepper.inner.state.values()))["step"]) == 3.0


def test_evaluation_that_runs_out_even_one_sample_at_a_time_is_skipped_and_training_goes_on(tmp_path, monkeypatch):
    from runner.train.step import Stepper

    def no_room(self, ids):
        raise torch.OutOfMemoryError("CUDA out of memory (test: evaluation)")

    monkeypatch.setattr(Stepper, "_eval_micro_step", no_room)
    run_dir = tmp_path / "run"
    code, recipe = train_in_process(tiny_spec(run_dir, training={"steps": 4, "eval_every": 2}))
    assert code == EXIT_OK and recipe.step == 4
    assert [(e["event"], e["step"]) for e in records(run_dir, "event")] == [("eval_skipped", 2), ("eval_skipped", 4)]
    assert not records(run_dir, "eval") and recipe.stepper.eval_micro_batch == 1


def _checkpoints_run_out(monkeypatch, times: int, prefix: str = ".tmp-step-") -> dict[str, int]:
    """The next `times` checkpoint writes whose temp dir starts with `prefix` run out of memory staging their shards."""
    from runner.checkpoint import store

    real = store._write_rank_files
    left = {"left": times}

    def tight(tmp, state, rank, ctrl, *rest):
        if tmp.name.startswith(prefix) and left["left"]:
            left["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (test: staging a checkpoint)")
        return real(tmp, state, rank, ctrl, *rest)

    monkeypatch.setattr(store, "_write_rank_files", tight)
    return left


def test_a_checkpoint_that_runs_out_twice_is_skipped_cleanly_and_the_next_one_is_written(tmp_path, monkeypatch):
    from runner.checkpoint import store

    left = _checkpoints_run_out(monkeypatch, 2, ".tmp-step-2")
    run_dir = tmp_path / "run"
    code, _ = train_in_process(tiny_spec(run_dir, training={"steps": 4}, checkpoints={"every_steps": 2}))
    assert code == EXIT_OK and left["left"] == 0
    assert [(e["event"], e["step"]) for e in records(run_dir, "event")] == [("checkpoint_skipped", 2)]
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith((".tmp", "step-"))) == ["step-4"]
    assert store.verify(run_dir / "step-4") is None


def test_the_final_checkpoint_that_runs_out_twice_steps_the_tier_down_and_is_written_there(tmp_path, monkeypatch):
    from runner.checkpoint import store

    left = _checkpoints_run_out(monkeypatch, 4)  # twice in the loop, twice more in the ladder's save at the old tier
    run_dir = tmp_path / "run"
    code, recipe = train_in_process(tiny_spec(run_dir, training={"steps": 3}, checkpoints={"every_steps": 100}))
    assert code == EXIT_OK and recipe.plan.tier == "zero2_offload" and left["left"] == 0
    assert store.verify(run_dir / "step-3") is None and (run_dir / "model" / "config.json").exists()


# --- what the H100 record showed (bench/gpu/records/2026-11-25-h100) -------------------------------------------------


def test_a_torch_without_reset_iter_state_still_shrinks_fsdp2_in_process(tmp_path, monkeypatch):
    """torch 2.11 (the H100's) has no FSDPModule.reset_iter_state: the shrink at a sharded tier became a restart
    (exit 75), which is how the in-process step-down to zero2_offload ended. The reset by hand keeps it in process."""
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "reset_iter_state", raising=False)  # torch 2.11 and 2.12 have none
    monkeypatch.setenv(ENV_VAR, "mbs>2,backward")
    run_dir = tmp_path / "run"
    code, _ = train_in_process(tiny_spec(run_dir, training={"micro_batch": 4, "steps": 3}, memory={"tier": "zero3"}))
    assert code == EXIT_OK
    shrinks = [e for e in records(run_dir, "event") if e["event"] == "oom_shrink"]
    assert [(e["from_micro_batch"], e["to_micro_batch"]) for e in shrinks] == [(4, 2)]
    # The H100's scenario: fast runs out at every micro-batch, the tier steps down to zero2_offload in process, and an
    # OOM there (step 3) shrinks in process instead of ending the run with exit 75.
    monkeypatch.setenv(ENV_VAR, "tier=fast,step=3,backward")
    down = tmp_path / "down"
    code, recipe = train_in_process(tiny_spec(down, training={"micro_batch": 2, "steps": 4}))
    assert code == EXIT_OK and recipe.plan.tier == "zero2_offload"
    events = [(e["event"], e["step"], e.get("to_micro_batch")) for e in records(down, "event")
              if e["event"] != "oom_recovered"]  # fmt: skip
    assert events == [("oom_shrink", 1, 1), ("tier_change", 0, None), ("oom_shrink", 3, 1)], events


def test_no_accelerate_engine_switch_outlives_a_sharded_tier(tmp_path, monkeypatch):
    """accelerate sets ACCELERATE_USE_FSDP=true in the environment when given an FSDP plugin; a process started after
    a sharded tier ran (the bench's relaunch, a supervisor's worker) inherited it, and its `fast` Accelerator wrapped
    the model in FSDP1 on the GPU: "Expects the handle training to be IDLE but got BACKWARD_PRE" after an OOM."""
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    code, _ = train_in_process(tiny_spec(tmp_path / "a", training={"steps": 3}, memory={"tier": "zero3"}))
    assert code == EXIT_OK and "ACCELERATE_USE_FSDP" not in os.environ
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('ACCELERATE_USE_FSDP'))"],
                           capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert child.stdout.strip() == "None"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # a launcher's, or a shell's
    code, recipe = train_in_process(tiny_spec(tmp_path / "b", training={"steps": 3}))
    assert code == EXIT_OK and "ACCELERATE_USE_FSDP" not in os.environ
    assert getattr(recipe.accelerator.state, "fsdp_plugin", None) is None


@pytest.mark.sweep  # the bench's own command line (15-25 s on 2 cores); the matrix it runs is tested above
def test_sweep_cli_prints_the_matrix(tmp_path):
    out = subprocess.run([sys.executable, "bench/oom_anywhere.py", "--ranks", "1", "--tiers", "zero2", "--regions",
                          "save", "--lora", "off", "--checkpointing", "off", "--points", "1", "--json",
                          str(tmp_path / "m.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| zero2 x1 full ckpt:off save |" in out.stdout and "1 of 1 points recovered" in out.stdout
    assert Path(tmp_path / "m.json").exists()


COLLECTIVE_SCRIPT = """
import os, sys, torch, torch.distributed as dist
calls = {"n": 0}
name = os.environ["FLAKY"]
if name == "all_gather":  # FSDP2's, by torch version
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
real = getattr(dist, name)
def flaky(*args, **kwargs):  # rank 1's 5th call fails in the call itself, after the agreement before it
    calls["n"] += 1
    if os.environ["RANK"] == "1" and calls["n"] == 5:
        raise torch.OutOfMemoryError("CUDA out of memory (test: inside the collective call)")
    return real(*args, **kwargs)
setattr(dist, name, flaky)
from jobspec.spec.loader import load_spec
from runner.train.recipe import Recipe
r = Recipe(load_spec(sys.argv[1]))
r.setup()
code = r.train()
m = r.accelerator.unwrap_model(r.model)
torch.save({k: getattr(v, "full_tensor", lambda v=v: v)().detach() for k, v in m.state_dict().items()}, sys.argv[2])
r.cleanup()
from runner.process.worker import _exit
_exit(code if calls["n"] >= 5 else 99)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("tier", "collective"), [("zero3", "all_gather"), ("fast", "all_reduce")])
def test_an_oom_raised_by_a_collective_call_on_one_rank_joins_the_others(tmp_path, tier, collective):
    """Rank 1's collective call itself (FSDP2's all-gather; the all-reduce of DDP's exchange or of an agreement)
    raises an OOM while rank 0 waits inside it: rank 1 issues it again and joins, nobody hangs, both end on the same
    weights."""
    from tests.runner.oom.test_oom_recovery import _free_port
    from tests.runner.train_helpers import Drained, communicate_or_fail, tiny_spec_dict, write_spec

    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", training={"micro_batch": 4, "steps": 3},
                                                          memory={"tier": tier}))  # fmt: skip
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "FLAKY": collective}  # fmt: skip
    procs = [Drained([sys.executable, "-c", COLLECTIVE_SCRIPT, str(spec), str(tmp_path / f"w{r}.pt")],
                              cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]  # fmt: skip
    try:
        errs = [communicate_or_fail(p, f"rank {r}", timeout=300)[1] for r, p in enumerate(procs)]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [EXIT_OK, EXIT_OK], errs[1][-3000:]
    assert "out of memory issuing" in errs[1] and "issuing it again" in errs[1]
    w0, w1 = (torch.load(tmp_path / f"w{r}.pt") for r in (0, 1))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.parametrize(("objective", "tier", "region"),
                         [("dpo", "zero3", "train-mb1"), ("simpo", "zero2", "train-1"),
                          # the sweep tier (pytest -m sweep)
                          pytest.param("dpo", "fast", "train", marks=pytest.mark.sweep),
                          pytest.param("orpo", "fast", "eval", marks=pytest.mark.sweep)])  # fmt: skip
def test_a_preference_objective_recovers_at_a_sampled_op(tmp_path, objective, tier, region):
    """The same matrix on preference pairs (a micro-batch of 2m rows, the pair loss, DPO's cached reference): an OOM at
    a sampled op ends with the clean run's pairs at every step and its weights."""
    out = _matrix([sweep.Config(tier, 1, "all", region=region, objective=objective)], tmp_path)
    _assert_recovered(out)
