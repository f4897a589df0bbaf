"""An in-process tier step-down: the next memory tier in the same process, after micro-batch 1 ran out of memory.

`Recipe.train` (runner/train/recipe.py) calls `step_down` once the OOM guard has given the tier up (runner/oom/shrink.py
`RecipeGuard.give_up`: a checkpoint of the finished steps, the tier's failure in tier_state.json) and `can_step_down`
said this process may go on. Its phases, each logged when it starts and when it ends with its duration
(runner/phase.py), so that a user never waits on a silent process:

1. take the state: the trained weights, optimizer state and RNG cut to this rank's share at the next tier
   (runner/train/handoff.py), when every rank can and the weights are intact; else the checkpoint is read back;
2. tear down the old tier (model, optimizer, accelerator, loader; the process group stays);
3. plan the next tier (the model's plan, no trace: the step that follows tries it, the shrink corrects it);
4. build it: a preset is built on the meta device with no init pass when the state in memory has every weight
   (runner/model/build.py `weights="none"`), the state handed over, no probe steps.

Measured on the H200 before the meta build (gpt2-small): give_up 2.58 s, take_state 1.12, teardown 0.36, plan 0.03,
build 4.37 (most of it the random init of weights the hand-over then overwrote).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from jobspec.catalog import tiers
from runner.oom import ladder
from runner.oom.shrink import TierOOM, apply_cap, low_bit_rung
from runner.phase import phase
from runner.sizing.plan import agree, size_for_tier
from runner.sizing.probe import probe_host
from runner.train import handoff

log = logging.getLogger("jobspec.runner")


def can_step_down(recipe: Any, err: TierOOM) -> bool:
    """Whether the next tier can start in this process: every rank knows (not a rank-local FSDP OOM),
    and the device still works (a CUDA error can leave the context unusable: then a new process)."""
    if err.local or err.cap is not None:
        return False
    if os.environ.get("JOBSPEC_STEP_DOWN", "in_process") == "restart":  # the fallback path, for benchmarks
        log.info("JOBSPEC_STEP_DOWN=restart: leaving the tier step-down to a new process")
        return False
    if recipe.device.type == "cuda":
        try:
            torch.cuda.synchronize(recipe.device)
        except Exception as exc:  # a sticky CUDA error: only a new process recovers
            log.warning("device unusable after the OOM (%s): relaunching instead of stepping down in process", exc)
            return False
    return True


def step_down(r: Any, err: TierOOM, oom_at: float, give_up_s: float = 0.0) -> None:
    """The next tier in recipe `r`'s process: release everything, plan the tier, rebuild, and go on from the step
    the OOM interrupted, redone from the same samples. When the weights were intact (give_up has written them as a
    checkpoint, the fallback should this process die), the state is handed over in memory (runner/train/handoff.py);
    otherwise, or when the new tier cannot take it, it comes from the newest checkpoint. No probe steps: the planner's
    micro-batch for the new tier is tried by the step itself, and the in-process shrink corrects it (probes cost
    several full steps at the longest rows, on a GPU most of a step-down's time). `oom_at`: when the OOM reached
    `train` (unix time); `give_up_s`: the checkpoint and tier state written before (both for the event, with where
    the rest of the time went)."""
    t0, old = time.perf_counter(), r.plan
    rung = low_bit_rung(r.spec, old, err.tier)  # the same tier with 8-bit Adam moments first (optimizer auto)
    nxt = err.tier if rung else tiers.next_tier(err.tier, r.env.world_size)  # what give_up recorded, on every rank
    assert nxt is not None  # give_up returned 75: a next tier exists
    head = f"stepping down tier {old.tier} -> {nxt}" + (" with 8-bit Adam moments" if rung else "")
    parts = {"give_up_s": give_up_s}
    with phase("%s: saving the state in memory", head) as took:
        kept = take_state(r, err)
    parts["take_state_s"] = took.wall_s
    with phase("%s: releasing tier %s (model, optimizer, accelerator, loader)", head, old.tier) as took:
        r._teardown()
    parts["teardown_s"] = took.wall_s
    with phase("%s: planning tier %s", head, nxt) as took:
        why = [f"tier {old.tier} -> {nxt} in process after an OOM at micro-batch 1: {err.reason}"]
        local = r.env.local_world_size
        plan = size_for_tier(r.spec, r.dev, r.host, r.env.world_size, nxt, local_ranks=local, reasons=why,
                             low_bit=ladder.low_bit_tiers(r.root) | ({nxt} if rung else set()))  # fmt: skip
        r.plan = agree(apply_cap(plan, r.root), r.ctrl.reduce_min)
        resume = r._newest_checkpoint() if kept is None else None
    parts["plan_s"] = took.wall_s
    source = "the state in memory" if kept is not None else "the newest checkpoint"
    # give_up checkpointed the steps: a stop while building loses none
    with phase("%s: building tier %s from %s", head, r.plan.tier, source) as took, r.stop.immediate():
        r._build(resume, None, kept, verify=False)
    parts["build_s"] = took.wall_s
    del kept  # the host copies
    r.status.update(tier=r.plan.tier, step=r.step, reason="running")
    seconds = time.perf_counter() - t0
    source = {"memory": "the state handed over in memory", "checkpoint": f"checkpoint step-{r.step}"}[r.state_from]
    log.warning("tier %s -> %s in process in %.2f s (%s); resuming at step %d from %s, micro-batch %d x %d", old.tier,
                r.plan.tier, seconds, ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in parts.items()),
                r.step, source if r.step else "scratch", r.plan.micro_batch, r.plan.grad_accum)  # fmt: skip
    r.metrics.write({"kind": "event", "event": "tier_change", "step": r.step, "from_tier": old.tier,
                     "to_tier": r.plan.tier, "in_process": True, "seconds": round(seconds, 3),
                     "state": r.state_from if r.step else "none", "oom_at": round(oom_at, 3),
                     "reason": err.reason, **{k: round(v, 4) for k, v in parts.items()}})  # fmt: skip
    r._write_plan(resumed=r.step > 0)


def take_state(r: Any, err: TierOOM) -> handoff.Handoff | None:
    """The trained state to hand to the next tier in memory, when every rank can (weights intact: the
    OOM came before the optimizer step); None: the next tier loads the newest checkpoint."""
    if not err.weights_intact or os.environ.get("JOBSPEC_STEP_DOWN") == "checkpoint":
        log.info("tier step-down: the next tier loads the newest checkpoint (%s)",
                 "JOBSPEC_STEP_DOWN=checkpoint" if err.weights_intact else "the weights may have changed")  # fmt: skip
        return None
    room = None  # one CPU process: the host copies are the tensors themselves, or replace them
    if r.device.type != "cpu":
        room = int(handoff.HOST_SHARE * probe_host().available_bytes / r.env.local_world_size)
    try:
        kept = handoff.take(r.accelerator.unwrap_model(r.model), r.optimizer, rank=r.env.rank,
                            world=r.env.world_size, trainable_only=r.spec.model.lora is not None,
                            room=room)  # fmt: skip
    except (RuntimeError, MemoryError) as exc:  # the host copies did not fit: the checkpoint has it all
        kept = f"{type(exc).__name__}: {exc}"
    why = kept if isinstance(kept, str) else None
    if r.ctrl.any(why is not None):
        log.warning("tier step-down: the next tier loads the checkpoint instead of the state in memory (%s)",
                    why or "another rank cannot hand it over")  # fmt: skip
        return None
    return kept  # type: ignore[return-value]


def give_state(r: Any, kept: handoff.Handoff) -> bool:
    """Write the handed-over state into the new tier; False on every rank when any cannot take it (the
    caller then loads the checkpoint, which overwrites whatever was written)."""
    model = r.accelerator.unwrap_model(r.model)
    why = handoff.fits(kept, model, r.optimizer)
    if why is None:
        try:
            handoff.give(kept, model, r.optimizer)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # an optimizer with its own layout
            why = f"{type(exc).__name__}: {exc}"
    if r.ctrl.any(why is not None):
        log.warning("tier step-down: loading the checkpoint, the new tier cannot take the state in memory (%s)",
                    why or "on another rank")  # fmt: skip
        return False
    return True
