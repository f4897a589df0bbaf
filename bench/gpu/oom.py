"""Real OOM recovery: memory squeezed in the middle of a run, the runner shrinks or steps down a tier in process.

Each scenario sets up a real `Recipe` (fast tier, the spec's micro-batch fixed at `cfg.recovery_batch`,
rows of `cfg.seq` tokens, JOBSPEC_RECORD_SAMPLES=1) and runs `Recipe.train()`. When the metrics record of
step K-1 is written, the squeeze is applied; from then on the runner is on its own:

  shrink     GPU: the caching allocator is emptied and capped (`torch.cuda.set_per_process_memory_fraction`)
             at the peak of a micro-batch-2 step plus 10 samples' worth (measured by probe steps before
             training), so the spec's micro-batch no longer fits and 8 does: a real allocator OOM at step K.
  step-down  GPU: capped halfway between what the weights and Adam's moments hold and what a micro-batch-1
             step needs: every micro-batch fails at fast, the runner checkpoints step K-1 and rebuilds at
             the next tier (zero2_offload, which keeps parameters and optimizer on the host) in process.
  CPU (--smoke): an OOM is the kernel's kill there, so the squeeze is a `runner.oom.faults.FaultInjector`
             put on the live model at the same moment (`mbs>N` for shrink, `tier=fast` for step-down):
             the same recovery code runs, with an injected `torch.OutOfMemoryError`.
  relaunch   bench/recovery.py's fault-injected step-down with JOBSPEC_STEP_DOWN=restart (a new process at
             the next tier; tiny preset): the cost of the fallback path, for scale.

  oom-anywhere  bench/oom_anywhere.py's sweep (an OOM raised at sampled allocating ops of a step, every point
             expected to train on), `cfg.sweep_points` points within `cfg.sweep_budget_s`, after the first round's
             shrink and step-down (before its relaunch); recorded as not available where this checkout has no such
             module.

Recovery = time of step K's metrics record - time of the first OOM (the first `oom_shrink` event's
`oom_at`, else the tier failure's time). Steps lost = optimizer steps recorded twice in samples-rank0.jsonl
(a finished step trained again); `same_samples`: step K after recovery trained on the ids the data order
gives step K. Rounds are interleaved (each round runs every scenario once); medians are reported.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu.common import Budget, Config, cpu_seconds, environ, median, recipe_for, spec_for, sync

FAULT_STEP = 4  # K: the step that meets the squeeze
FIRST_GUESS_S = {"relaunch": 40.0}  # two runner processes: 38.7 s on the H200 (2026-11-28); not started with less left
STEPS = 7


class Squeeze:
    """Takes memory away from a live recipe (GPU: allocator cap; CPU: fault injector) and gives it back."""

    def __init__(self, gpu: bool):
        self.gpu, self.note, self.injector = gpu, "", None
        self.p1 = self.p2 = self.p8 = 0

    def measure(self, recipe: Any, seq: int) -> None:
        """Peak allocated bytes of probe steps at micro-batch 1, 2 and 8 (Adam's moments present: one warm-up)."""
        if not self.gpu:
            return
        import torch

        def peak(mbs: int) -> int:
            sync()
            torch.cuda.reset_peak_memory_stats()
            recipe.stepper.probe_step(mbs, seq)  # lr 0: the weights do not change
            sync()
            return int(torch.cuda.max_memory_allocated())

        peak(1)
        self.p1, self.p2, self.p8 = peak(1), peak(2), peak(8)
        recipe.stepper.reset_optimizer()  # the first real step starts Adam afresh, as after the runner's probes
        torch.cuda.empty_cache()

    def apply(self, recipe: Any, kind: str) -> None:
        if not self.gpu:
            from runner.oom.faults import FaultInjector, FaultRules

            above = max(1, recipe.plan.micro_batch // 4)
            rules = FaultRules(mbs_above=above) if kind == "shrink" else FaultRules(tiers=frozenset({"fast"}))
            self.injector = FaultInjector(rules, rank=0, tier=recipe.plan.tier, step=recipe.step + 1)
            self.injector.install(recipe.accelerator.unwrap_model(recipe.model))
            what = f"mbs>{above}" if kind == "shrink" else "tier=fast"
            self.note = f"CPU: a FaultInjector ({what}) put on the live model: an injected torch.OutOfMemoryError"
            return
        import torch

        torch.cuda.empty_cache()  # cached blocks would otherwise serve the next step past any cap
        held = torch.cuda.memory_allocated()
        # shrink: a micro-batch-2 step plus 10 samples; step-down: halfway to what micro-batch 1 needs
        cap = self.p2 + 10 * (self.p8 - self.p2) / 6 if kind == "shrink" else held + (self.p1 - held) / 2
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        self.note = (
            f"allocator capped at {cap / 2**30:.2f} GiB (held {held / 2**30:.2f} GiB; probe peaks "
            f"mbs 1/2/8: {self.p1 / 2**30:.2f}/{self.p2 / 2**30:.2f}/{self.p8 / 2**30:.2f} GiB)"
        )

    def release(self) -> None:
        if self.injector is not None:
            self.injector.remove()
        if self.gpu:
            import torch

            torch.cuda.set_per_process_memory_fraction(1.0)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _gaps(train: list[dict[str, Any]], keep: Callable[[int], bool]) -> float | None:
    gaps = [
        b["time"] - a["time"] for a, b in itertools.pairwise(train) if b["step"] == a["step"] + 1 and keep(b["step"])
    ]
    return median(gaps)


def recovery_spec(cfg: Config, run_dir: Path, data: Path):  # -> JobSpec
    b = cfg.recovery_batch
    return spec_for(cfg, run_dir, data, preset=cfg.recovery_preset, tier="fast", global_batch=b, micro_batch=b,
                    steps=STEPS, log_every=1)  # fmt: skip


def relaunch_spec(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """The spec bench/recovery.py's relaunch runs (as a dict: it writes the file itself)."""
    from bench import recovery

    return recovery.spec_dict(run_dir, micro_batch=1, steps=STEPS, vendor=cfg.device)


def scenario(cfg: Config, work: Path, data: Path, kind: str, rnd: int) -> dict[str, Any]:
    """One squeezed run; every figure read back from metrics.jsonl, tier_state.json and the samples file."""
    run_dir = work / f"oom-{kind}-{rnd}"
    spec = recovery_spec(cfg, run_dir, data)
    squeeze, state = Squeeze(cfg.device == "cuda"), {"at": None}
    w0, c0 = time.perf_counter(), cpu_seconds()
    with environ(JOBSPEC_RECORD_SAMPLES="1", JOBSPEC_FAULT_OOM=None, JOBSPEC_STEP_DOWN=None):
        try:
            with recipe_for(spec) as recipe:
                squeeze.measure(recipe, cfg.seq)
                write = recipe.metrics.write

                def hooked(rec: dict[str, Any], recipe: Any = recipe) -> None:
                    write(rec)
                    if rec.get("kind") == "train" and rec["step"] == FAULT_STEP - 1 and state["at"] is None:
                        state["at"] = time.time()
                        squeeze.apply(recipe, kind)

                recipe.metrics.write = hooked
                code = recipe.train()
                expected = recipe.step_ids(FAULT_STEP - 1)
        finally:
            squeeze.release()
    wall, cpu = time.perf_counter() - w0, cpu_seconds() - c0
    rows = _rows(run_dir / "metrics.jsonl")
    train = [r for r in rows if r.get("kind") == "train"]
    shrinks = [r for r in rows if r.get("event") == "oom_shrink"]
    changes = [r for r in rows if r.get("event") == "tier_change"]
    tier_state = json.loads(p.read_text()) if (p := run_dir / "tier_state.json").exists() else {}
    oom_at = shrinks[0]["oom_at"] if shrinks else (tier_state.get("failed") or [{}])[0].get("at")
    done = next((r for r in train if r["step"] == FAULT_STEP and oom_at and r["time"] >= oom_at), None)
    samples = _rows(run_dir / "samples-rank0.jsonl")
    redone = [s for s in samples if s["step"] == FAULT_STEP]
    first = train[0]["step"] if train else 0
    return {
        "scenario": kind,
        "round": rnd,
        "exit_code": code,
        "squeeze": squeeze.note,
        "recovery_s": round(done["time"] - oom_at, 3) if done and oom_at else None,
        "step_s_before": _r(_gaps(train, lambda s: first < s < FAULT_STEP)),
        "step_s_after": _r(_gaps(train, lambda s: s > FAULT_STEP + 1)),
        "steps_lost": len(samples) - len({s["step"] for s in samples}) if samples else None,
        "same_samples": bool(redone) and redone[-1]["ids"] == expected,
        "shrinks": [f"{e['from_micro_batch']}->{e['to_micro_batch']}" for e in shrinks],
        "oom_reasons": sorted({e["reason"][:120] for e in shrinks}),
        "tier_changes": [{"from": e["from_tier"], "to": e["to_tier"], "seconds": e["seconds"],
                          **{k: v for k, v in e.items() if k.endswith("_s")}} for e in changes],  # where the time went
        # each shrink's recovery, by part (runner/oom/shrink.py run_step): failed attempts, release, loader, redo
        "recovered": [{k: v for k, v in e.items() if k.endswith("_s")} for e in rows
                      if e.get("event") == "oom_recovered"],
        "final_tier": train[-1]["tier"] if train else None,
        "final_micro_batch": train[-1]["micro_batch"] if train else None,
        "steps_done": train[-1]["step"] if train else 0,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def relaunch(cfg: Config, work: Path, rnd: int) -> dict[str, Any]:
    """bench/recovery.py's step-down by a new process (JOBSPEC_STEP_DOWN=restart), fault-injected."""
    from bench import recovery

    out = recovery.tier_step_down(work / f"relaunch-{rnd}", STEPS, FAULT_STEP, cfg.device, "restart")
    keep = ("recovery_s", "step_s", "steps_lost", "detail", "wall_s", "cpu_s")
    return {
        "scenario": "relaunch",
        "round": rnd,
        "squeeze": "JOBSPEC_FAULT_OOM=step=K at micro-batch 1 (injected)",
        "preset": "tiny",
        **{k: out[k] for k in keep},
        "tier_path": out["scenario"],
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per scenario over the rounds, with every round's raw figures kept beside them."""
    out = []
    for kind in dict.fromkeys(r["scenario"] for r in runs):
        rs = [r for r in runs if r["scenario"] == kind]
        done = [r for r in rs if "skipped" not in r]
        med = {
            k: _r(median([r[k] for r in rs if isinstance(r.get(k), int | float) and not isinstance(r[k], bool)]))
            for k in ("recovery_s", "step_s_before", "step_s_after", "step_s", "wall_s", "cpu_s")
        }
        lost = sorted({r.get("steps_lost") for r in done}, key=str)
        ok = all(r.get("exit_code", 0) == 0 and "error" not in r for r in done) if done else None
        out.append(
            {
                "scenario": kind,
                "rounds": len(rs),
                "ok": ok,
                "steps_lost": lost,
                "same_samples": all(r.get("same_samples", True) for r in done) if done else None,
                **{f"median_{k}": v for k, v in med.items() if v is not None},
                "runs": rs,
            }
        )
    return out


SWEEP_MARGIN_S = 10.0  # of the part's budget, kept for the sweep's own record to be written


def oom_anywhere(cfg: Config, work: Path, budget: Budget) -> dict[str, Any]:
    """bench/oom_anywhere.py's `sweep`, within `cfg.sweep_budget_s` (and what the part has left); its figures,
    or a status that says why there are none."""
    try:
        from bench import oom_anywhere as sweeper
    except ImportError as err:
        if err.name == "bench.oom_anywhere":
            return {"status": "not available in this checkout (no bench/oom_anywhere.py)"}
        return {"status": f"error: bench/oom_anywhere.py does not import: {type(err).__name__}: {err}"[:500]}
    seconds = min(cfg.sweep_budget_s, budget.left() - SWEEP_MARGIN_S)
    if seconds < 1:
        return {"status": budget.skip_note()}
    t0 = time.perf_counter()
    try:
        out = sweeper.sweep(work / "oom-anywhere", device=cfg.device, budget_s=seconds, points=cfg.sweep_points,
                            seed=cfg.sweep_seed)  # fmt: skip
    except Exception as err:
        return {"status": f"error: {type(err).__name__}: {err}"[:500]}
    return {
        "status": "ok",
        "points_asked": cfg.sweep_points,
        "seed": cfg.sweep_seed,
        "budget_s": round(seconds, 1),
        "wall_s": round(time.perf_counter() - t0, 2),
        "points": out.get("points"),
        "recovered": out.get("recovered"),
        "matrix_md": out.get("matrix_md"),
        "rows": out.get("rows"),
    }


def run(cfg: Config, work: Path, data: Path, budget: Budget, save: Callable[[], None], record: dict[str, Any]) -> None:
    """Round 0 of shrink and step-down, the OOM-anywhere sweep, round 0's relaunch (for scale: the least valuable),
    then the other rounds."""
    runs: list[dict[str, Any]] = []
    took: dict[str, float] = {}  # seconds each scenario's last round took: a round that cannot finish is not started
    record["recovery"] = []
    for rnd in range(cfg.recovery_rounds):  # interleaved: each round runs every scenario once
        for kind in ("shrink", "step-down", "relaunch"):
            if kind == "relaunch" and cfg.smoke:  # two runner processes: most of a minute on 2 cores
                runs.append({"scenario": kind, "round": rnd, "skipped": "--smoke (tests/runner cover it on CPU)"})
                continue
            expected = took.get(kind, FIRST_GUESS_S.get(kind, 0.0))
            if not budget.fits(expected):
                note = budget.skip_note() if budget.spent() else budget.wont_fit_note(expected)
                runs.append({"scenario": kind, "round": rnd, "error": note})
                continue
            t0 = time.perf_counter()
            try:
                runs.append(relaunch(cfg, work, rnd) if kind == "relaunch" else scenario(cfg, work, data, kind, rnd))
            except (Exception, SystemExit) as err:  # bench/recovery.py exits on a failed run
                runs.append({"scenario": kind, "round": rnd, "error": f"{type(err).__name__}: {err}"[:500]})
            took[kind] = time.perf_counter() - t0
            record["recovery"] = summarise(runs)
            save()
            if rnd == 0 and kind == "step-down":  # the sweep before the relaunch, which is only for scale
                record["oom_anywhere"] = oom_anywhere(cfg, work, budget)
                save()
    record["recovery"] = summarise(runs)
    if record.get("oom_anywhere") is None:  # no round ran
        record["oom_anywhere"] = {"status": budget.skip_note()}
    save()
