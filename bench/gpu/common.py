"""What every part of the suite shares: its settings, the time budget, the data, specs and recipes, timers.

Nothing here measures anything by itself; the parts (gputests, oom, sizing, throughput) do.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


PART_ORDER = ("tests", "recovery", "userpath", "memory", "throughput")  # the order one call runs them in: the most
# valuable first (recovery on the GPU, the user path under a real OOM), calibration and speed after


@dataclass(frozen=True)
class Config:
    """The suite's sizes: `gpu()` for one GPU within one 9-minute call, `cpu_smoke()` for the CPU (CI)."""

    device: str  # "cuda" | "cpu"
    precision: str  # autocast precision of every run (bf16 on the GPU, fp32 on the CPU)
    seq: int  # tokens per row; every row is exactly this long
    memory_presets: tuple[str, ...]  # formula vs trace vs measured: these presets ...
    memory_tiers: tuple[str, ...]  # ... at these tiers
    tiers: tuple[str, ...]  # tier speed: the tiers that fit one GPU (zero2 / zero3 save nothing on one rank)
    per_rank: int  # per-rank batch the memory part sizes (the divisors of)
    exhaustive: bool  # the memory part also searches every divisor from the largest down (verified == maximum)
    sizing_fault: str | None  # JOBSPEC_FAULT_OOM for the memory part's runs (smoke: "mbs>5,probes")
    recovery_preset: str
    recovery_batch: int  # global batch = the spec's fixed micro-batch of the recovery runs
    recovery_rounds: int  # rounds of shrink, step-down, relaunch (the sweep runs after the first)
    sweep_points: int  # OOM-anywhere: points sampled (bench/oom_anywhere.py), within sweep_budget_s
    sweep_seed: int
    sides_rows: tuple[str, ...]  # bench/throughput.py's rows (GPU_ROWS / CPU_ROWS): runner, plain loop, HF Trainer
    sides_steps: int  # optimizer steps per side per round of those rows (`rounds` rounds at most, within the budget)
    throughput_preset: str
    throughput_batch: int  # global batch of runner vs plain (micro-batch auto, both models on the GPU)
    rounds: int  # paired, interleaved rounds of runner vs plain (after one warm-up round)
    round_steps: int  # optimizer steps per side per round
    tier_batch: int  # global batch of the tier-speed runs
    tier_steps: int  # measured steps per tier per round (after 2 warm-up steps)
    tier_rounds: int  # rounds of tier speed (the tier order reversed in every other one)
    soak_batch: int
    soak_steps: int
    budgets: dict[str, float]  # wall seconds per part (PART_ORDER): the part ends at its budget
    sweep_budget_s: float  # of the recovery part's budget, what the OOM-anywhere sweep may take
    smoke: bool = False
    threads: int | None = None  # torch CPU threads (smoke: 1, so a busy shared machine does not oversubscribe)
    peak_tflops: float | None = None  # override of the device's dense bf16 peak
    userpath_seed: int = 0  # the user-path scenario's random steps and moments (bench/gpu/userpath.py)

    @classmethod
    def gpu(cls) -> Config:
        return cls(
            device="cuda",
            precision="bf16",
            seq=1024,
            memory_presets=("gpt2-small",),  # llama-1b's trace and build overran the part on the H200 (2026-11-28)
            memory_tiers=("fast", "zero2_offload"),
            tiers=("fast", "zero2_offload", "minimal"),
            per_rank=360,
            exhaustive=False,  # verified == exhaustive in 13 of 13 H100 runs (records 2026-11-25): time for the trace
            sizing_fault=None,
            recovery_preset="gpt2-small",
            recovery_batch=32,
            recovery_rounds=3,
            sweep_points=48,
            sweep_seed=0,
            sides_rows=("llama-1b", "llama-8b-lora"),  # issue 42's rows, seq 2048: the 8B's only where it fits
            sides_steps=2,
            throughput_preset="gpt2-small",
            throughput_batch=32,
            rounds=4,
            round_steps=4,
            tier_batch=64,
            tier_steps=6,
            tier_rounds=1,
            soak_batch=120,
            soak_steps=15,
            # 470 s in all (7 min 50 s): one call of at most 9 minutes (the wheels' install before it, the start of the
            # device machine outside it). The H200 (2026-11-28) overran memory and throughput at 76 s each and cut
            # the gpu tests at 136 s; the parts now skip what does not fit (Budget) and the most valuable come first.
            # Throughput has issue 42's llama-1b row first (three 1B models, ~20 s of steps a round at 20 % MFU):
            # 35 s more for it, from tests, recovery, userpath and memory
            budgets={"tests": 130.0, "recovery": 85.0, "userpath": 130.0, "memory": 40.0, "throughput": 85.0},
            sweep_budget_s=35.0,
        )

    @classmethod
    def cpu_smoke(cls) -> Config:
        return cls(
            device="cpu",
            precision="fp32",
            seq=64,
            memory_presets=("tiny",),
            memory_tiers=("fast", "zero2_offload"),
            tiers=("fast", "zero2_offload", "minimal"),
            per_rank=24,
            exhaustive=True,
            sizing_fault="mbs>5,probes",
            recovery_preset="tiny",
            recovery_batch=8,
            recovery_rounds=1,
            sweep_points=2,
            sweep_seed=0,
            sides_rows=("tiny", "llama-tiny-lora"),
            sides_steps=3,
            throughput_preset="tiny",
            throughput_batch=16,
            rounds=3,
            round_steps=3,
            tier_batch=16,
            tier_steps=3,
            tier_rounds=1,
            soak_batch=16,
            soak_steps=20,
            budgets={"tests": 60.0, "recovery": 60.0, "userpath": 30.0, "memory": 60.0, "throughput": 60.0},
            sweep_budget_s=6.0,  # the call into the sweep, not the sweep itself (bench/oom_anywhere.py), in CI
            smoke=True,
            threads=1,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """The inverse of `to_dict` (JSON turns the tuples into lists)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def scaled(self, total_s: float) -> Config:
        """Every part's budget (and the sweep's) scaled so that they sum to `total_s`."""
        import dataclasses

        factor = total_s / sum(self.budgets.values())
        return dataclasses.replace(
            self,
            budgets={k: round(v * factor, 1) for k, v in self.budgets.items()},
            sweep_budget_s=round(self.sweep_budget_s * factor, 1),
        )


class Budget:
    """Seconds left for one part; an item that would start after the budget is recorded as skipped. (The part's
    process also ends at its budget, whatever it is doing: bench/gpu/suite.py.)"""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def spent(self) -> bool:
        return self.elapsed() >= self.seconds

    def skip_note(self) -> str:
        return f"skipped: time budget ({self.elapsed():.0f} s of {self.seconds:.0f} s spent)"

    def fits(self, expected_s: float) -> bool:
        """Whether an item expected to take `expected_s` (what the last like it took) ends inside the budget: a part
        that starts only such items ends inside its budget instead of being cut off in one (the H200's memory and
        throughput parts were, 2026-11-28)."""
        return not self.spent() and self.left() >= expected_s

    def wont_fit_note(self, expected_s: float) -> str:
        return (f"skipped: would not end inside the time budget ({self.left():.0f} s left of {self.seconds:.0f} s, "
                f"the last such item took {expected_s:.0f} s)")  # fmt: skip


@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set (str) or unset (None) environment variables for the block; restore them after."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_data(path: Path, rows: int, seq: int, seed: int = 0) -> Path:
    """`rows` prompt/response records of random words, each longer than `seq` byte tokens: every training
    row is truncated to exactly `seq` positions (the longest sequence the plan sizes for), with targets."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def words(n_chars: int) -> str:
        out: list[str] = []
        while sum(len(w) + 1 for w in out) < n_chars:
            out.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))))
        return " ".join(out)

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": words(min(48, seq // 4)), "response": words(seq + 16)}) + "\n")
    return path


def spec_for(
    cfg: Config,
    run_dir: Path,
    data: Path,
    *,
    preset: str,
    tier: str,
    global_batch: int,
    micro_batch: int | str = "auto",
    steps: int = 10**6,
    utilization: float = 0.9,
    log_every: int = 10**6,
    lora: dict[str, Any] | None = None,
):  # -> JobSpec
    """A spec for one in-process Recipe: no export, no periodic checkpoints, no eval until the end, and its
    micro-batch from the formula and probe steps (`memory.trace: off`: the memory part traces on its own, and
    the others would pay a trace in every setup). Validated here: a bad value fails before any training."""
    import yaml

    from jobspec.spec.loader import parse_spec

    return parse_spec(
        yaml.safe_dump(
            {
                "name": "gpu-suite",
                "model": {"preset": preset, **({"lora": lora} if lora else {})},
                "data": {"path": str(data), "max_seq_len": cfg.seq, "eval_fraction": 0.01},
                "training": {
                    "global_batch": global_batch,
                    "micro_batch": micro_batch,
                    "steps": steps,
                    "warmup_steps": 0,
                    "learning_rate": 1e-4,
                    "precision": cfg.precision,
                    "log_every": log_every,
                    "eval_batches": 1,
                },
                "hardware": {"vendor": cfg.device, "gpus": 1},
                "memory": {"tier": tier, "target_utilization": utilization, "trace": "off"},
                "checkpoints": {"dir": str(run_dir), "every_steps": 10**6, "keep": 1},
                "output": {"export": False},
            }
        )
    )


def release(recipe: Any) -> None:
    """Everything a finished Recipe held: loader workers, the process group, accelerate's state, GPU cache."""
    import torch

    try:
        stepper = getattr(recipe, "stepper", None)
        if stepper is not None and stepper.prefetch is not None:
            stepper.prefetch.close()
    finally:
        recipe.cleanup()
    for name in ("stepper", "model", "optimizer", "accelerator", "guard"):
        if hasattr(recipe, name):
            setattr(recipe, name, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@contextlib.contextmanager
def recipe_for(spec: Any) -> Iterator[Any]:
    """`Recipe(spec)`, set up (probe, plan, probe steps, build) and released after the block."""
    import torch

    from runner.train.recipe import Recipe

    gc.collect()  # the previous run's leftovers must not shrink the free memory this one plans with
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    recipe = Recipe(spec)
    try:
        recipe.setup()
        yield recipe
    finally:
        release(recipe)


def sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and its live children (DataLoader workers), user + system."""
    total = time.process_time()
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                t = child.cpu_times()
                total += t.user + t.system
    except ImportError:  # children not counted; the report says CPU time is this process's
        pass
    return total


def median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None
