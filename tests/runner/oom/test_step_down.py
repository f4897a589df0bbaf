"""The in-process tier step-down hands the trained state over in memory (runner/train/handoff.py): the redone step
uses the same samples and gives the same result as the checkpoint path and as a run started at the new tier
from the checkpoint written before the step-down. Real training on CPU; the OOM fires mid-backward."""

from __future__ import annotations

import itertools
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from jobspec.contract import EXIT_OK
from runner.checkpoint import store
from runner.data.dataset import DataOrder, load_data
from runner.data.tokenizer import ByteTokenizer
from runner.oom.faults import ENV_VAR
from runner.train import handoff
from tests.runner.train_helpers import records, run_supervisor, tiny_spec, tiny_spec_dict, train_in_process, write_spec

FAULT = "step=4,backward"  # step 4 runs out in its first micro-step's backward: steps 1-3 are kept
SECTIONS = {"training": {"micro_batch": 1, "steps": 6}, "checkpoints": {"every_steps": 100}}


def tier_change(run_dir: Path) -> dict:
    (event,) = [r for r in records(run_dir, "event") if r.get("event") == "tier_change"]
    return event


def samples(run_dir: Path, rank: int = 0) -> dict[int, list[int]]:
    lines = (run_dir / f"samples-rank{rank}.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert len({r["step"] for r in recs}) == len(recs), "a step was trained twice: work was lost"
    return {r["step"]: r["ids"] for r in recs}


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir)}


def weights(recipe) -> dict[str, torch.Tensor]:
    model = recipe.accelerator.unwrap_model(recipe.model)
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def faulted(run_dir: Path, monkeypatch, how: str | None = None, **sections: dict):
    monkeypatch.setenv(ENV_VAR, FAULT)
    monkeypatch.setenv("JOBSPEC_RECORD_SAMPLES", "1")
    if how is None:
        monkeypatch.delenv("JOBSPEC_STEP_DOWN", raising=False)
    else:
        monkeypatch.setenv("JOBSPEC_STEP_DOWN", how)
    code, recipe = train_in_process(tiny_spec(run_dir, **SECTIONS, **sections))
    assert code == EXIT_OK
    return recipe


def test_the_state_in_memory_trains_as_the_checkpoint_and_as_a_run_started_from_it(tmp_path, monkeypatch):
    memory = faulted(tmp_path / "memory", monkeypatch)
    event = tier_change(tmp_path / "memory")
    assert (event["from_tier"], event["to_tier"], event["step"], event["state"]) == (
        "fast",
        "zero2_offload",
        3,
        "memory",
    )
    assert memory.plan.tier == "zero2_offload"
    # The checkpoint the step-down wrote before rebuilding (the fallback should the process die) is there.
    assert store.verify(tmp_path / "memory" / "step-3") is None

    from_checkpoint = faulted(tmp_path / "checkpoint", monkeypatch, "checkpoint")
    assert tier_change(tmp_path / "checkpoint")["state"] == "checkpoint"

    # A run that starts at the new tier from that checkpoint, with no fault.
    started = tmp_path / "started"
    started.mkdir()
    shutil.copytree(tmp_path / "memory" / "step-3", started / "step-3")
    monkeypatch.delenv(ENV_VAR)
    code, fresh = train_in_process(tiny_spec(started, memory={"tier": "zero2_offload"}, **SECTIONS))
    assert code == EXIT_OK and [(p["tier"], p["step"]) for p in records(started, "plan")] == [("zero2_offload", 3)]

    # Same samples for every step, each trained once; step 4 redone from the planned ids.
    order = DataOrder(len(load_data(tiny_spec(started), ByteTokenizer()).train), 8, 42)
    planned = {k: order.step_samples(k - 1) for k in range(1, 7)}
    assert samples(tmp_path / "memory") == samples(tmp_path / "checkpoint") == planned
    assert samples(started) == {k: planned[k] for k in (4, 5, 6)}
    # Same results: the state handed over is the checkpoint's, bit for bit (fp32 on CPU, same order of sums).
    got = losses(tmp_path / "memory")
    assert got == losses(tmp_path / "checkpoint")
    assert {k: got[k] for k in (4, 5, 6)} == losses(started)
    a, b, c = weights(memory), weights(from_checkpoint), weights(fresh)
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k


def test_a_new_tier_that_cannot_take_the_state_loads_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(handoff, "fits", lambda *_: "test: another layout")
    faulted(tmp_path / "refused", monkeypatch)
    assert tier_change(tmp_path / "refused")["state"] == "checkpoint"
    monkeypatch.undo()
    faulted(tmp_path / "memory", monkeypatch)
    assert losses(tmp_path / "refused") == losses(tmp_path / "memory")


@pytest.mark.parametrize(
    ("sections", "steps_down"),
    [({"model": {"preset": "tiny", "lora": {"rank": 4, "targets": ["c_attn"], "dropout": 0.1}}},
      ("fast", "zero2_offload")),  # adapters only, and dropout: the RNG state is handed over too
     ({"memory": {"tier": "zero2_offload"}}, ("zero2_offload", "minimal"))],  # FSDP2 shards to FSDP2 shards
    ids=["lora-dropout", "fsdp-to-fsdp"],
)  # fmt: skip
def test_memory_and_checkpoint_step_downs_train_alike(tmp_path, monkeypatch, sections, steps_down):
    faulted(tmp_path / "memory", monkeypatch, **sections)
    faulted(tmp_path / "checkpoint", monkeypatch, "checkpoint", **sections)
    for how in ("memory", "checkpoint"):
        event = tier_change(tmp_path / how)
        assert (event["from_tier"], event["to_tier"], event["step"], event["state"]) == (*steps_down, 3, how)
    assert losses(tmp_path / "memory") == losses(tmp_path / "checkpoint")
    assert samples(tmp_path / "memory") == samples(tmp_path / "checkpoint")


def test_take_cuts_each_rank_its_fsdp_chunk():
    """A replicated tensor is cut as FSDP2 shards dim 0 (torch.chunk); ranks past the last chunk hold none."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    parts = [handoff.take(model, opt, rank=r, world=4, trainable_only=False) for r in range(4)]
    for name, p in model.named_parameters():
        assert torch.equal(torch.cat([h.params[name] for h in parts]), p.detach())
        assert torch.equal(torch.cat([h.state[name]["exp_avg"] for h in parts]), opt.state[p]["exp_avg"])
    assert [tuple(h.params["1.weight"].shape) for h in parts] == [(1, 5), (1, 5), (0, 5), (0, 5)]
    refused = handoff.take(model, opt, rank=0, world=1, trainable_only=False, room=1)  # 1 byte of host room
    assert isinstance(refused, str) and "host copies would take" in refused


@pytest.mark.slow
@pytest.mark.parametrize(("tier", "to_tier"), [("fast", "zero2"),
                                               pytest.param("zero2", "zero2_offload", marks=pytest.mark.sweep)])
def test_two_ranks_hand_their_shards_over_as_the_checkpoint_would(tmp_path, tier, to_tier):
    """fast (DDP, replicated) -> zero2 (FSDP2 over 2 ranks): each rank keeps its chunk; zero2 -> zero2_offload:
    each keeps its shard. Same losses and samples as the step-down that reads the checkpoint back."""
    runs = {}
    for how in ("in_process", "checkpoint"):
        run_dir = tmp_path / how
        spec = write_spec(tmp_path / f"{how}.yaml", tiny_spec_dict(run_dir, memory={"tier": tier}, **SECTIONS))
        result = run_supervisor([str(spec), "--nproc", "2"], JOBSPEC_RECORD_SAMPLES="1", JOBSPEC_STEP_DOWN=how,
                                **{ENV_VAR: FAULT})  # fmt: skip
        assert result.returncode == EXIT_OK, result.stderr[-3000:]
        assert "relaunching" not in result.stderr
        event = tier_change(run_dir)
        assert (event["from_tier"], event["to_tier"], event["step"]) == (tier, to_tier, 3)
        assert event["state"] == ("memory" if how == "in_process" else "checkpoint")
        runs[how] = run_dir
    assert losses(runs["in_process"]) == pytest.approx(losses(runs["checkpoint"]), rel=1e-6)
    for rank in (0, 1):
        assert samples(runs["in_process"], rank) == samples(runs["checkpoint"], rank)


def test_every_phase_of_a_step_down_is_logged_when_it_starts_and_ends(tmp_path, monkeypatch, caplog):
    """Never silent (issue 41: the H200 run printed nothing for 32 s while it stepped down): the give-up, the state
    taken, the old tier released, the next planned and built (its model built without weights, placed, the state
    handed over) each log a line when they start and one with their duration when they end, in that order; the
    phases account for the step-down's time, and no two lines are further apart than the slowest phase took."""
    caplog.set_level(logging.INFO, logger="jobspec.runner")
    faulted(tmp_path, monkeypatch)
    lines = [(r.created, r.getMessage()) for r in caplog.records if r.name == "jobspec.runner"]
    first = next(i for i, (_, m) in enumerate(lines) if m.startswith("out of memory at tier") and m.endswith(" ..."))
    last = next(i for i, (_, m) in enumerate(lines) if "in process in" in m)
    window = lines[first : last + 1]
    phases = [
        "out of memory at tier fast",
        "stepping down tier fast -> zero2_offload: saving the state in memory",
        "stepping down tier fast -> zero2_offload: releasing tier fast",
        "stepping down tier fast -> zero2_offload: planning tier zero2_offload",
        "stepping down tier fast -> zero2_offload: building tier zero2_offload from the state in memory",
        "building the model without weights (the state in memory has them)",
        "placing the model for tier zero2_offload",
        "setting up the step at tier zero2_offload",
        "handing the state in memory over to tier zero2_offload",
    ]
    starts = [next(i for i, (_, m) in enumerate(window) if m.startswith(p) and m.endswith(" ...")) for p in phases]
    ends = [next(i for i, (_, m) in enumerate(window) if m.startswith(p) and ": done in " in m) for p in phases]
    assert starts == sorted(starts) and all(s < e for s, e in zip(starts, ends, strict=True))
    done = [re.search(r": done in ([0-9.]+) s", window[e][1]) for e in ends]
    took = {p: float(d.group(1)) for p, d in zip(phases, done, strict=True) if d is not None}
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(window)]
    assert max(gaps) <= max(took.values()) + 0.05, (max(gaps), took)
    event = tier_change(tmp_path)
    parts = sum(event[k] for k in ("take_state_s", "teardown_s", "plan_s", "build_s"))
    assert parts <= event["seconds"] <= parts + 0.25  # nothing silent between the phases
    assert event["give_up_s"] == pytest.approx(took[phases[0]], abs=0.01)
