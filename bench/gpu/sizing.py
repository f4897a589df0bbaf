"""The memory part: formula vs trace vs `torch.cuda.max_memory_allocated`, per preset and tier, through the
runner's own setup path.

For each (preset, tier) a real `Recipe` is set up at sequence `cfg.seq` with `micro_batch: auto` and a
per-rank batch of `cfg.per_rank`: it probes the device, asks the memory model (the formula, jobspec/plan/memory.py;
`memory.trace: off`, the trace is run below on its own) for a micro-batch, and checks it with real probe steps
(`runner.sizing.plan.verify_micro_batch`, called by `Recipe._verify_micro_batch`). The suite wraps that call, so
it records the guess, every probe (micro-batch, outcome, seconds, peak allocated and reserved) and the seconds it
took; with `cfg.exhaustive` it then runs the exhaustive search with the very same probe step (`try_step`, the
runner's `oom_guard` with the plan's budget): every divisor of the per-rank batch from the largest down until the
first that fits. Nothing is assumed about memory being monotone: every larger divisor was tried and failed.

Then the memory: three real optimizer steps (`Stepper.train_step`, two micro-batches each, so the gradients of
the first micro-batch are alive while the second one's activations are) at the verified micro-batch, and the
peak allocated and reserved bytes against `jobspec.plan.memory.estimate` at that micro-batch. "Device" memory adds
what the process holds outside the caching allocator (CUDA context, library handles): (total - free) - reserved.
Last, per preset, the trace of the runner's step on FakeTensors (`python -m runner.train.trace`, a process of its
own: runner/train/trace.py) at each tier's verified micro-batch, the same spec and precision: its device peak
beside the formula's bytes and the measured peak allocated (the three columns of the report).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu.common import Budget, Config, environ, recipe_for, spec_for, sync


def _peaks() -> tuple[int | None, int | None]:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None, None
    return int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())


class _Observer:
    """Stands in for `runner.train.recipe.verify_micro_batch`: the real one, timed, then the exhaustive search, then
    (for the calibration's straight line) probes at 1 and about half the maximum.
    Every probe is recorded: micro-batch, outcome, seconds, peak allocated and reserved, and what it was for."""

    def __init__(self, per_rank: int, exhaustive: bool = True):
        self.per_rank, self.exhaustive = per_rank, exhaustive
        self.probes: list[dict[str, Any]] = []
        self.seen: dict[str, Any] = {}
        self.purpose = "verify"

    def _timed(self, try_step: Callable[[int], bool]) -> Callable[[int], bool]:
        def timed(mbs: int) -> bool:  # oom_guard resets the peak stats before every step
            t0 = time.perf_counter()
            ok = bool(try_step(mbs))
            alloc, reserved = _peaks()
            self.probes.append(
                {
                    "micro_batch": mbs,
                    "ok": ok,
                    "purpose": self.purpose,
                    "seconds": round(time.perf_counter() - t0, 4),
                    "peak_allocated": alloc if ok else None,
                    "peak_reserved": reserved if ok else None,
                }
            )
            return ok

        return timed

    def __call__(self, plan: Any, try_step: Callable[[int], bool], **kw: Any) -> Any:
        from jobspec.catalog.tiers import divisors
        from runner.sizing import plan as planning

        timed = self._timed(try_step)
        self.seen.update(guess=plan.micro_batch, model_max=plan.model_max_micro_batch, budget=plan.budget_bytes)
        t0 = time.perf_counter()
        try:
            verified = planning.verify_micro_batch(plan, timed, **kw)
        finally:
            self.seen.update(verify_s=time.perf_counter() - t0, verify_probes=len(self.probes))
        best = verified.micro_batch
        if self.exhaustive:
            self.purpose, t0 = "exhaustive", time.perf_counter()
            best, steps = descending_search(self.per_rank, timed)
            self.seen.update(exhaustive=best, exhaustive_probes=steps, exhaustive_s=time.perf_counter() - t0)
        self.purpose = "calibration"  # a line through >= 3 sizes, all probed with Adam's moments allocated
        for target in (1, best // 2):
            passed = {p["micro_batch"] for p in self.probes if p["ok"] and p["purpose"] != "verify"}
            mbs = max((d for d in divisors(self.per_rank) if d <= target), default=0)
            if mbs and mbs not in passed:
                timed(mbs)
        return verified


def descending_search(per_rank: int, try_step: Callable[[int], bool]) -> tuple[int, int]:
    """(largest divisor of `per_rank` whose probe step fits, probe steps run): from the largest down."""
    from jobspec.catalog.tiers import divisors

    steps = 0
    for d in reversed(divisors(per_rank)):
        steps += 1
        if try_step(d):
            return d, steps
    return 0, steps


def _measure(recipe: Any, steps: int = 3) -> dict[str, Any]:
    """Peak memory over `steps` real optimizer steps of two micro-batches at the plan's micro-batch."""
    import torch

    from runner.oom.shrink import StepOOM

    mbs, gpu = recipe.plan.micro_batch, recipe.device.type == "cuda"
    recipe.stepper.prefetch.close()  # ids of our choosing: collated in process
    sync()
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        ooms0 = torch.cuda.memory_stats().get("num_ooms", 0)  # the probe search's OOMs are not this run's
    t0, oom, done = time.perf_counter(), None, 0
    for s in range(steps):
        ids = recipe.step_ids(s)[: min(2 * mbs, recipe.plan.per_rank)]
        try:
            recipe.stepper.train_step(ids, mbs, recipe.lr(s))
            done += 1
        except StepOOM as err:  # the verified micro-batch ran out in a real step: a finding, not a crash
            oom = str(err)
            break
    sync()
    out: dict[str, Any] = {
        "steps": done,
        "seconds": round(time.perf_counter() - t0, 3),
        "oom": oom,
        "peak_allocated": None,
        "peak_reserved": None,
        "context": None,
        "device_peak": None,
        "device_total": None,
        "num_ooms": None,
    }
    if gpu:
        alloc, reserved = _peaks()
        free, total = torch.cuda.mem_get_info()
        context = max(0, (total - free) - torch.cuda.memory_reserved())  # outside the caching allocator
        out.update(
            peak_allocated=alloc,
            peak_reserved=reserved,
            context=int(context),
            device_peak=int(reserved or 0) + int(context),
            device_total=int(total),
            num_ooms=int(torch.cuda.memory_stats().get("num_ooms", 0) - ooms0),
        )
    return out


def _predicted(spec: Any, tier: str, mbs: int, precision: str, grad_accum: int = 2) -> dict[str, Any]:
    from jobspec.plan import memory
    from jobspec.plan.planner import estimate_kwargs, model_shape

    shape, kw = model_shape(spec), estimate_kwargs(spec, 1, precision)
    e = memory.estimate(shape, tier=tier, micro_batch=mbs, grad_accum=grad_accum, **kw)
    e0, e1 = (memory.estimate(shape, tier=tier, micro_batch=m, **kw) for m in (0, 1))
    return {
        "states": e.states,
        "activations": e.activations,
        "logits": e.logits,
        "overhead": e.overhead,
        "total": e.gpu_bytes,
        "checkpointing": e.checkpointing,
        "params": shape.params,
        "per_sample_activations": e1.activations - e0.activations,
        "per_sample_logits": e1.logits - e0.logits,
        "breakdown": e.breakdown(),
    }


def sizing_spec(cfg: Config, work: Path, data: Path, preset: str, tier: str):  # -> JobSpec
    return spec_for(cfg, work / f"sizing-{preset}-{tier}", data, preset=preset, tier=tier, global_batch=cfg.per_rank)


def size_one(cfg: Config, work: Path, data: Path, preset: str, tier: str) -> tuple[dict[str, Any], dict | None]:
    """(sizing entry, memory-model entry or None) for one preset at one tier."""
    import runner.train.recipe
    from runner.sizing.plan import NoFit

    spec = sizing_spec(cfg, work, data, preset, tier)
    obs, real = _Observer(cfg.per_rank, cfg.exhaustive), runner.train.recipe.verify_micro_batch
    entry: dict[str, Any] = {
        "preset": preset,
        "tier": tier,
        "seq_len": cfg.seq,
        "per_rank": cfg.per_rank,
        "probe_bound": round(math.log2(cfg.per_rank) + 3, 2),
        "status": "ok",
    }
    mem = None
    entry["held_before_bytes"] = _held()  # what earlier runs left allocated (a leak would skew every peak)
    t0 = time.perf_counter()
    runner.train.recipe.verify_micro_batch = obs  # the runner's own call site, observed
    try:
        with environ(JOBSPEC_FAULT_OOM=cfg.sizing_fault), recipe_for(spec) as recipe:
            entry["setup_s"] = round(time.perf_counter() - t0, 2)
            plan = recipe.plan
            entry.update(
                verified_micro_batch=plan.micro_batch,
                grad_accum=plan.grad_accum,
                precision=plan.precision,
                checkpointing=plan.checkpointing,
                budget_bytes=plan.budget_bytes,
            )
            measured = _measure(recipe)
            mem = {
                "preset": preset,
                "tier": tier,
                "micro_batch": plan.micro_batch,
                "predicted": _predicted(spec, tier, plan.micro_batch, plan.precision, min(2, plan.grad_accum)),
                "measured": measured,
            }
    except NoFit as err:
        entry.update(status="no fit", reason=str(err))
    finally:
        runner.train.recipe.verify_micro_batch = real
    s = obs.seen
    entry.update(
        model_micro_batch=s.get("guess"),
        model_max_micro_batch=s.get("model_max"),
        verify_probes=s.get("verify_probes"),
        verify_s=_r(s.get("verify_s")),
        exhaustive_micro_batch=s.get("exhaustive"),
        exhaustive_probes=s.get("exhaustive_probes"),
        exhaustive_s=_r(s.get("exhaustive_s")),
        probes=obs.probes,
    )
    v, x = entry.get("verified_micro_batch"), entry.get("exhaustive_micro_batch")
    entry["verified_over_exhaustive"] = round(v / x, 3) if v and x else None
    if "guess" not in s and entry["status"] == "ok":
        entry["status"] = "no probe steps (the runner only probes on a GPU, or with JOBSPEC_FAULT_OOM's `probes`)"
    if mem is not None:
        mem.update(_errors(mem))
    return entry, mem


def _held() -> int | None:
    """Bytes the caching allocator holds for live tensors now, after a collection (None without a GPU)."""
    import gc

    import torch

    if not torch.cuda.is_available():
        return None
    gc.collect()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated())


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _errors(mem: dict[str, Any]) -> dict[str, Any]:
    """Measured / predicted - 1: whole device, and the allocator's part against the model without overhead."""
    p, m = mem["predicted"], mem["measured"]
    if m.get("device_peak") is None:
        return {"error_device": None, "error_allocated": None}
    model_alloc = p["states"] + p["activations"] + p["logits"]
    return {
        "error_device": round(m["device_peak"] / p["total"] - 1, 4),
        "error_allocated": round(m["peak_allocated"] / model_alloc - 1, 4),
    }


def _trace_errors(mem: dict[str, Any]) -> dict[str, Any]:
    """The trace against the formula (both bare: no overhead) and the measured peak allocated against the trace."""
    p, m, t = mem["predicted"], mem["measured"], (mem.get("trace") or {}).get("peak")
    formula = p["states"] + p["activations"] + p["logits"]
    return {
        "formula_over_trace": round(formula / t, 4) if t else None,
        "error_trace_allocated": round(m["peak_allocated"] / t - 1, 4) if t and m.get("peak_allocated") else None,
    }


def start_trace(cfg: Config, work: Path, data: Path, mems: list[dict[str, Any]], timeout_s: float, pool: Any) -> Any:
    """The trace of each memory run's tier at its micro-batch, one process for a preset's tiers, in a thread of
    `pool` (the trace runs on the CPU: the next preset's GPU runs go on meanwhile); `finish_trace` takes it in."""
    import yaml

    from jobspec.plan.traced import run_trace

    preset, precision = mems[0]["preset"], mems[0]["precision"]
    spec = sizing_spec(cfg, work, data, preset, mems[0]["tier"])  # the tier and micro-batch come from the pairs
    path = work / f"trace-{preset}.yaml"
    path.write_text(yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False))
    pairs = [(m["tier"], m["micro_batch"]) for m in mems]

    def timed() -> tuple[list[dict[str, Any]], float]:
        t0 = time.perf_counter()
        return run_trace(str(path), (), pairs, 1, precision, timeout_s), time.perf_counter() - t0

    return pool.submit(timed)


def finish_trace(mems: list[dict[str, Any]], future: Any, timeout_s: float) -> None:
    """The trace's rows into `mems` (or why there are none)."""
    import concurrent.futures

    try:
        rows, wall = future.result(timeout=max(0.1, timeout_s))
    except concurrent.futures.TimeoutError:
        rows, why = [], "not finished when the part's budget ran out"
    except Exception as err:  # TraceFailed above all: the trace's own failure is a finding, the record says it
        rows, why = [], f"{type(err).__name__}: {err}"[:500]
    if not rows:
        for m in mems:
            m["trace"] = {"error": why}
        return
    for m, row in zip(mems, rows, strict=True):
        m["trace"] = {k: row[k] for k in ("peak", "parts", "host", "seconds", "notes")}
        m["trace"]["process_wall_s"] = round(wall, 2)
        m.update(_trace_errors(m))


FINISH_MARGIN_S = 4.0  # after the traces: calibration and the record (--smoke under load ran out of its budget here)


def run(cfg: Config, work: Path, data: Path, budget: Budget, save: Callable[[], None], record: dict[str, Any]) -> None:
    """Fill record["sizing"] and record["memory_model"] preset by preset (its tiers on the device; then their
    trace, on the CPU while the next preset runs), and record["calibration"] from them."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.gpu.calibrate import calibrate

    record["sizing"], record["memory_model"] = [], []
    traces: list[tuple[list[dict[str, Any]], Any]] = []
    pool = ThreadPoolExecutor(max_workers=len(cfg.memory_presets) or 1, thread_name_prefix="trace")
    took = 0.0  # seconds the last configuration took: one that would not end inside the budget is not started
    try:
        for preset in cfg.memory_presets:
            mems = []
            for tier in cfg.memory_tiers:
                if not budget.fits(took):
                    note = budget.skip_note() if budget.spent() else budget.wont_fit_note(took)
                    record["sizing"].append({"preset": preset, "tier": tier, "status": note})
                    continue
                t0 = time.perf_counter()
                try:
                    entry, mem = size_one(cfg, work, data, preset, tier)
                except Exception as err:  # one failing configuration must not lose the others' figures
                    entry, mem = (
                        {"preset": preset, "tier": tier, "status": f"error: {type(err).__name__}: {err}"[:500]},
                        None,
                    )
                took = time.perf_counter() - t0
                record["sizing"].append(entry)
                if mem is not None:
                    mem["precision"] = entry["precision"]
                    record["memory_model"].append(mem)
                    mems.append(mem)
                save()
            if mems:
                traces.append((mems, start_trace(cfg, work, data, mems, max(1.0, budget.left()), pool)))
        for mems, future in traces:  # what is left of the budget but the calibration's and the record's time
            finish_trace(mems, future, budget.left() - FINISH_MARGIN_S)
            save()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    record["calibration"] = calibrate(record)
    save()
