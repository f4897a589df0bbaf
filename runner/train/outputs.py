"""What a run writes besides its checkpoints: the train record of each logged step (and the memory check of the first
one on a GPU) and each evaluation in metrics.jsonl, the samples of each step (JOBSPEC_RECORD_SAMPLES), the summary at
the end, the exported model and its benchmarks. Functions of the recipe `r` (runner/train/recipe.py), which calls
them from its loop."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from jobspec import shared_dir
from jobspec.spec.units import human_bytes
from runner.checkpoint import remote
from runner.oom.detect import next_micro_batch
from runner.oom.shrink import RankOOM, TierOOM
from runner.output.metrics import memory_bytes
from runner.train.step import EvalOOM, Preempted, StepResult

log = logging.getLogger("jobspec.runner")


def export_model(r: Any) -> None:
    """The final checkpoint as a Hugging Face directory (runner/output/export.py); skipped when already there."""
    from runner.output import export

    final = r.root / f"step-{r.step}"
    out = export.default_out(r.spec)
    done = export.read_provenance(out)
    if done and done.get("step") == r.step and done.get("source") == str(final.resolve()):
        log.info("model already exported at %s (step %d)", out, r.step)
    else:
        r.status["reason"] = "exporting"
        r.exported = export.export(final, out, spec=r.spec)
        r.status["reason"] = "done"
    r.exported = out
    if r.bucket is not None and not r.spec.output.dir:  # the pod's disk goes with it: the bucket keeps it
        r.fence()
        remote.upload_tree(r.bucket, out, remote.MODEL_DIR)
        log.info("model uploaded to %s", r.bucket.uri(remote.MODEL_DIR))


def run_benchmarks(r: Any) -> None:
    """eval.benchmarks on the export (runner/output/benchmarks.py), once the training state has left the device.
    A failure is logged and recorded, not made the run's: the model is trained and exported, and a retried pod
    would find the run finished; `jobspec eval RUN_DIR` runs them again."""
    from runner.output import benchmarks

    assert r.exported is not None and r.metrics is not None  # called after export_model, on rank 0
    r.status["reason"] = "benchmarks"
    r._teardown()  # the model, optimizer and accelerator: the export loads again, for inference
    items = benchmarks.entries(r.spec.eval.benchmarks, r.task_dir)
    try:
        benchmarks.run(r.exported, items, r.spec.eval, device=r.device, step=r.step,
                       write=r.metrics.write)  # fmt: skip
    except Exception as err:
        reason = f"{type(err).__name__}: {err}"[:4096]
        log.exception("benchmarks failed (the model is trained and exported; `jobspec eval %s` runs them again)",
                      r.root)  # fmt: skip
        r.metrics.write({"kind": "event", "event": "benchmark_failed", "step": r.step, "reason": reason})
    r.status["reason"] = "done"


def summary(r: Any) -> None:
    """The run's end in the log (rank 0): steps, losses, throughput, where the checkpoints and the model are."""
    if not r.env.is_main:
        return
    wall = time.perf_counter() - r.started
    loss, ev = r.status.get("loss"), r.eval_loss
    lines = [
        f"run complete: {r.step}/{r.total_steps} steps in {wall:.1f} s "
        f"(this process; {r.step - r.first_step} trained now)",
        f"  final train loss {loss:.4f}" if loss is not None else "  final train loss: not logged",
        f"  final eval loss {ev:.4f}" if ev is not None else "  eval: none (no held-out data or not reached)",
        f"  throughput {r.trained_tokens / wall:,.0f} input tokens/s (padding excluded), whole run incl. setup",
        f"  checkpoints {r.root} (newest step-{r.saved_step})",
        f"  model {r.exported}" if r.exported else "  model: not exported (output.export false)",
    ]
    log.info("%s", "\n".join(lines))


def memory_check(r: Any) -> None:
    """The memory model's prediction against the device's peak over the first step trained here: every GPU run
    calibrates the model (a `memory_check` event in metrics.jsonl, and a log line)."""
    p = r.plan
    peak = int(torch.cuda.max_memory_allocated(r.device))
    reserved = int(torch.cuda.max_memory_reserved(r.device))
    ratio = peak / p.estimated_bytes if p.estimated_bytes else None
    r.metrics.write({"kind": "event", "event": "memory_check", "step": r.step + 1, "tier": p.tier,
                     "micro_batch": p.micro_batch, "predicted_bytes": p.estimated_bytes,
                     "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved,
                     "measured_over_predicted": None if ratio is None else round(ratio, 4)})  # fmt: skip
    log.info("memory: step %d at tier %s, micro-batch %d: peak %s allocated (%s reserved), the model predicted %s "
             "with its overhead (%s)", r.step + 1, p.tier, p.micro_batch, human_bytes(peak),
             human_bytes(reserved), human_bytes(p.estimated_bytes),
             f"x{ratio:.2f}" if ratio is not None else "no prediction")  # fmt: skip


def train_record(r: Any, res: StepResult, tokens_per_s: float) -> None:
    """The `train` record of the step `r` just finished (collective: the losses are summed over the ranks)."""
    # a mixture of experts (the same on every rank): its router's load-balancing loss, each rank's mean summed
    router = [0.0 if res.router_aux is None else float(res.router_aux)] if r.stepper.router_aux_coef else []
    preference = [] if res.preference is None else res.preference.tolist()
    sums = r.ctrl.all_reduce([res.loss_sum.item(), *router, *preference])
    routed = {"router_aux_loss": sums[1] / r.ctrl.world_size} if router else {}
    sums = [sums[0], *sums[1 + len(router) :]]
    extremes = None if res.extremes is None else r.ctrl.all_reduce(res.extremes.tolist(), "max")
    loss = sums[0] / max(res.denominator or res.targets, 1)  # global per-token mean (preference objectives: per-pair)
    obj = r.stepper.objective
    r.status.update(step=r.step, loss=loss)
    used, total = memory_bytes(r.device, r.host.total_bytes)
    p = r.plan
    rollout = {} if r.stepper.rollouts is None else r.stepper.rollouts.metrics  # GRPO's rewards and lengths (and
    # what its reward functions logged, which never replaces a field of the record)
    r.metrics.write(  # fenced right before the line is written (Metrics.fence)
        rollout | {
            "kind": "train",
            "step": r.step,
            "total_steps": r.total_steps,
            "loss": loss,
            "lr": r.lr(r.step - 1),
            "grad_norm": None if res.grad_norm is None else float(res.grad_norm),
            "tier": p.tier,
            "micro_batch": p.micro_batch,
            "grad_accum": p.grad_accum,
            "world_size": p.world_size,
            "global_batch": p.global_batch,
            "samples": r.step * p.global_batch,
            "epoch": r.order.epoch(r.step - 1),
            "targets": res.targets,
            "tokens_per_s": tokens_per_s,
            "mem_used_bytes": used,
            "mem_total_bytes": total,
            "gpu_util": r.gpu_util(),
            **mix(r),
            **routed,
            **({} if res.preference is None or obj is None else obj.metrics(sums[1:], res.targets, extremes)),
        }
    )


def mix(r: Any) -> dict[str, dict[str, int]]:
    """`samples_by_source`: each source's samples (all ranks) since the last train record, by source name;
    nothing with one source."""
    if r.mixed is None:
        return {}
    mix = dict(zip(r.data.sources, r.mixed, strict=True))
    r.mixed = [0] * len(r.mixed)
    return {"samples_by_source": mix}


def evaluate(r: Any, *, final: bool = False) -> None:
    """Eval loss on this rank's share of the held-out data. A stop during the `final` one (after the last step)
    skips it: the run saves its final checkpoint and ends done, not preempted."""
    if not r.data.eval:
        return
    try:
        with r.guard.region("eval", r.step):
            loss, n = r.stepper.evaluate(r.eval_ids, r.plan.micro_batch)
    except Preempted:  # raised on every rank at the same agreed check
        if not final:
            raise
        log.warning("stop requested during the final evaluation: skipped; writing the final checkpoint")
        return
    except RankOOM as err:  # this rank alone, with no FSDP gate: restart every rank at a smaller micro-batch
        cap = next_micro_batch(r.plan.micro_batch, r.plan.per_rank) or 1
        raise TierOOM(r.plan.tier, f"out of memory in evaluation on rank {err.rank}: {err.reason}",
                      weights_intact=False, cap=cap, local=True) from None  # fmt: skip
    except EvalOOM as err:  # agreed by every rank: the evaluation is skipped, training goes on
        log.warning("evaluation at step %d skipped: %s", r.step, err)
        r.metrics.write({"kind": "event", "event": "eval_skipped", "step": r.step, "reason": str(err)})
        return
    r.eval_loss = loss
    r.metrics.write({"kind": "eval", "step": r.step, "eval_loss": loss, "eval_tokens": n})


def record_samples(r: Any, ids: list[int]) -> None:
    """This rank's sample ids of the step just trained, one line in `samples-rank<N>.jsonl` (tests compare runs)."""
    r.fence()
    rec = {"step": r.step, "rank": r.env.rank, "micro_batch": r.plan.micro_batch, "grad_accum": r.plan.grad_accum,
           "ids": ids}  # fmt: skip
    r.root.mkdir(parents=True, exist_ok=True)
    with shared_dir.open_append(r.root / f"samples-rank{r.env.rank}.jsonl") as f:  # never through a link
        f.write(json.dumps(rec) + "\n")
