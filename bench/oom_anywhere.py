"""OOM at any op: the recovery matrix. Every allocating op of a region can be where memory runs out; each must end with
training going on, as an OOM-free run would have trained.

    python bench/oom_anywhere.py [--points N | --all] [--seed 0] [--ranks 1 2] [--tiers ...] [--regions ...]
                                 [--budget-s S] [--json OUT] [--keep DIR]

For every configuration (tier x ranks {1, 2 on gloo, the OOM on rank 1 or on all} x {full, LoRA} x activation
checkpointing {on, off} x region; the objective is SFT, or a preference objective on pairs where a Config says so)
a first run counts the region's allocating ops (`JOBSPEC_FAULT_OOM=...,op=<huge>` records how many it had:
runner/oom/faults.py), then each chosen op k gets its own run with
`JOBSPEC_FAULT_OOM="step=S,op=k[,during=R][,rank=1]"`: a real `torch.OutOfMemoryError` raised by a dispatch mode
before the k-th allocating op (runner/oom/anywhere.py), wherever it is (forward, FSDP2's hooks and collective
buffers, the loss, backward, DDP's exchange, clipping, the optimizer step, evaluation, checkpoint staging, a probe
step). Regions: `train-1` (the first optimizer step), `train` (step 3, after a checkpoint), `train-mb1` (step 3 of
a run at micro-batch 1, where nothing is left to shrink: the tier steps down in process; at `minimal`, the last tier,
the step is tried once more with the cache emptied), `eval` (after step 2), `save` (the checkpoint after step 2),
`probe` (the planner's first probe step, which runs on the CPU under the rule).

A point passes when, against a clean run of the same configuration: the run exits 0 and trains every step once; each
step trains on the clean run's sample ids on every rank; every train record keeps micro-batch x accumulation x ranks
= the global batch; the final weights match the clean run's, every tensor within WEIGHT_RTOL of its norm (a shrink
or a tier step-down changes the summation order of the gradients, nothing else; Adam divides each gradient by its
running RMS, so a last-bit difference in a near-zero gradient element moves that weight by a fraction of the
learning rate, and an element-wise bound is meaningless: measured after 4 steps on this CPU, the largest element
difference was 1.2e-5 at lr 3e-3 and the largest norm-wise one is printed with the matrix); no
temp checkpoint directory is left and every checkpoint verifies; every metrics line is whole JSON; and the fault
fired. Outcomes are read from metrics.jsonl: `shrink`, `step-down`, `eval-shrink` / `eval-skipped`,
`save-again` / `save-skipped`, `probe-smaller` (the planner took a smaller micro-batch), or `absorbed` (retried in
place: the optimizer step's preparation, an evaluation micro-batch). A run that exits non-zero, raises or hangs
(2 ranks: bounded by a timeout) fails its point. A region with no allocating op on the device (the `fast` tier's
checkpoint on the CPU: DCP writes the tensors as they are) has no point.

Points are all ops (`--all`, hours on 2 CPU cores) or a sample of `--points` per configuration drawn with `--seed`
(the tests sample this matrix: tests/runner/oom/test_oom_anywhere.py). `sweep()` is the entry point the GPU suite
calls (bench/gpu): one rank, on the device it is given.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.common import environ  # noqa: E402
from jobspec.catalog.tiers import TIERS  # noqa: E402
from runner.oom.faults import ENV_VAR, OPS_FILE_TEMPLATE  # noqa: E402

STEPS, GLOBAL_BATCH, MICRO_BATCH = 4, 8, 4
REGIONS = {  # name -> (step, during)
    "train-1": (1, "train"),
    "train": (3, "train"),
    "train-mb1": (3, "train"),  # at micro-batch 1: nothing left to shrink, the tier steps down (the last: tried again)
    "eval": (2, "eval"),
    "save": (2, "save"),
    "probe": (1, "probe"),
}
PAIRS = [{"prompt": f"name a colour {i}", "chosen": f"blue {i}.", "rejected": f"no {i}, I won't."} for i in range(40)]
COUNT_OP = 10**9  # an op no region reaches: the run records the region's length
WEIGHT_RTOL = 1e-3  # per tensor: ||faulted - clean|| <= WEIGHT_RTOL * ||clean|| (see the module docstring)
TWO_RANK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Config:
    tier: str
    ranks: int = 1
    oom_on: str = "all"  # 2 ranks: "one" (rank 1 alone) or "all"
    lora: bool = False
    checkpointing: bool = False
    region: str = "train"
    objective: str = "sft"  # or a preference objective (dpo, simpo, orpo) on PAIRS: a micro-batch of pairs

    @property
    def name(self) -> str:
        who = "" if self.ranks == 1 else f" oom:{self.oom_on}"
        what = "" if self.objective == "sft" else f" {self.objective}"
        return (f"{self.tier} x{self.ranks}{who} {'lora' if self.lora else 'full'}{what} "
                f"ckpt:{'on' if self.checkpointing else 'off'} {self.region}")  # fmt: skip

    def spec(self, run_dir: Path, device: str = "cpu") -> dict[str, Any]:
        model: dict[str, Any] = {"preset": "tiny"}
        if self.lora:
            model["lora"] = {"rank": 4, "targets": ["c_attn", "mlp.c_proj"]}
        data: dict[str, Any] = {"max_seq_len": 64}
        objective: dict[str, Any] = {}
        if self.objective != "sft":
            pairs = run_dir.parent / "pairs.jsonl"
            if not pairs.exists():
                pairs.parent.mkdir(parents=True, exist_ok=True)
                pairs.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
            data["path"], objective = str(pairs), {"objective": self.objective, "beta": 0.1}
        return {
            "name": "oom-anywhere",
            "model": model,
            "data": data,
            "training": {**objective, "global_batch": GLOBAL_BATCH,
                         "micro_batch": 1 if self.region == "train-mb1" else MICRO_BATCH,
                         "learning_rate": 3e-3,
                         "warmup_steps": 2, "steps": STEPS, "precision": "fp32", "log_every": 1, "eval_every": 2,
                         "gradient_checkpointing": "on" if self.checkpointing else "off"},
            "hardware": {"vendor": "cuda" if device == "cuda" else "cpu", "gpus": 1},
            "memory": {"tier": self.tier},
            "checkpoints": {"dir": str(run_dir), "every_steps": 2, "keep": 5},
        }  # fmt: skip

    def fault(self, op: int) -> str:
        step, during = REGIONS[self.region]
        rules = [f"step={step}", f"op={op}"]
        if during != "train":
            rules.append(f"during={during}")
        if self.ranks > 1 and self.oom_on == "one":
            rules.append("rank=1")
        return ",".join(rules)


@dataclass
class Run:
    code: int | str  # exit code, or "crash: ..." / "hang"
    run_dir: Path
    weights: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Point:
    config: str
    op: int
    ok: bool
    outcome: str
    problems: list[str]
    seconds: float
    drift: float = 0.0  # largest ||faulted - clean|| / ||clean|| over the weight tensors


def _one_rank(cfg: Config, run_dir: Path, fault: str | None, device: str) -> Run:
    import torch

    from jobspec.spec.loader import parse_spec
    from runner.train.recipe import Recipe

    t0 = time.perf_counter()
    spec = parse_spec(yaml.safe_dump(cfg.spec(run_dir, device)))
    with environ(**{ENV_VAR: fault, "JOBSPEC_RECORD_SAMPLES": "1"}):
        recipe = Recipe(spec)
        try:
            recipe.setup()
            code: int | str = recipe.train()
            model = recipe.accelerator.unwrap_model(recipe.model)
            weights = {k: getattr(v, "full_tensor", lambda v=v: v)().detach().to("cpu", copy=True)
                       for k, v in model.state_dict().items()}  # fmt: skip
        except BaseException as exc:
            code, weights = f"crash: {type(exc).__name__}: {str(exc)[:300]}", {}
        finally:
            recipe.cleanup()
    if device == "cuda":
        torch.cuda.empty_cache()
    return Run(code, run_dir, weights, time.perf_counter() - t0)


RANK_SCRIPT = """
import sys, torch
from jobspec.spec.loader import load_spec
from runner.train.recipe import Recipe
r = Recipe(load_spec(sys.argv[1]))
r.setup()
code = r.train()
m = r.accelerator.unwrap_model(r.model)
w = {k: getattr(v, 'full_tensor', lambda v=v: v)().detach() for k, v in m.state_dict().items()}
if r.env.rank == 0:
    torch.save(w, sys.argv[2])
r.cleanup()
from runner.process.worker import _exit
_exit(code)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_ranks(cfg: Config, run_dir: Path, fault: str | None) -> Run:
    import torch

    t0 = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir.parent / f"{run_dir.name}.yaml"
    spec_path.write_text(yaml.safe_dump(cfg.spec(run_dir)))
    out = run_dir.parent / f"{run_dir.name}.weights.pt"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "JOBSPEC_RECORD_SAMPLES": "1",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    env.pop(ENV_VAR, None)
    if fault:
        env[ENV_VAR] = fault
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(spec_path), str(out)], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in (0, 1)]  # fmt: skip
    errs, codes = [], []
    deadline = time.monotonic() + TWO_RANK_TIMEOUT_S
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            errs.append(err)
            codes.append(p.returncode)
    except subprocess.TimeoutExpired:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
        for r, p in enumerate(procs):  # what each rank said before it was stopped
            (run_dir / f"stderr-rank{r}.txt").write_text(p.communicate()[1] or "")
        return Run("hang", run_dir, {}, time.perf_counter() - t0)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
    for r, err in enumerate(errs):
        (run_dir / f"stderr-rank{r}.txt").write_text(err)
    if codes != [0, 0]:
        lasts = [e.strip().splitlines()[-1][:300] if e.strip() else "" for e in errs]
        return Run(f"exit {codes}: " + " | ".join(f"rank {r}: {x}" for r, x in enumerate(lasts)), run_dir, {},
                   time.perf_counter() - t0)  # fmt: skip
    weights = torch.load(out, weights_only=True) if out.exists() else {}
    return Run(0, run_dir, weights, time.perf_counter() - t0)


def run(cfg: Config, run_dir: Path, fault: str | None, device: str = "cpu") -> Run:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return _two_ranks(cfg, run_dir, fault) if cfg.ranks > 1 else _one_rank(cfg, run_dir, fault, device)


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def region_ops(cfg: Config, work: Path, device: str = "cpu") -> tuple[int, Run]:
    """(allocating ops of the region on the rank that injects, the counting run) from a run whose op is never
    reached."""
    counted = run(cfg, work / "count", cfg.fault(COUNT_OP), device)
    rank = 1 if cfg.ranks > 1 and cfg.oom_on == "one" else 0
    recs = _lines(counted.run_dir / OPS_FILE_TEMPLATE.format(rank=rank))
    step, during = REGIONS[cfg.region]
    ops = [r["ops"] for r in recs if r["during"] == during and r["step"] == step and "ops" in r]
    return (ops[0] if ops else 0), counted


def check(cfg: Config, got: Run, clean: Run) -> tuple[str, list[str], float]:
    """(outcome, problems, largest norm-wise weight difference) of a faulted run against the clean one (see the
    module docstring)."""

    from runner.checkpoint import store

    if got.code != 0:
        return "failed", [f"exit: {got.code}"], 0.0
    problems: list[str] = []
    metrics = got.run_dir / "metrics.jsonl"
    try:
        rows = _lines(metrics)
    except ValueError as err:
        return "failed", [f"metrics.jsonl has a line that is not JSON: {err}"], 0.0
    events = [r.get("event") for r in rows if r.get("kind") == "event"]
    train = [r for r in rows if r.get("kind") == "train"]
    if [r["step"] for r in train] and train[-1]["step"] != STEPS:
        problems.append(f"trained to step {train[-1]['step']} of {STEPS}")
    for r in train:
        if r["micro_batch"] * r["grad_accum"] * r["world_size"] != r["global_batch"]:
            problems.append(f"step {r['step']}: {r['micro_batch']} x {r['grad_accum']} x {r['world_size']} "
                            f"!= {r['global_batch']}")  # fmt: skip
    for rank in range(cfg.ranks):
        mine = _lines(got.run_dir / f"samples-rank{rank}.jsonl")
        ref = _lines(clean.run_dir / f"samples-rank{rank}.jsonl")
        steps = [s["step"] for s in mine]
        if sorted(steps) != list(range(1, STEPS + 1)) or len(steps) != len(set(steps)):
            problems.append(f"rank {rank}: steps recorded {steps}, expected each of 1..{STEPS} once")
        if {s["step"]: s["ids"] for s in mine} != {s["step"]: s["ids"] for s in ref}:
            problems.append(f"rank {rank}: sample ids differ from the clean run's")
    fired_ranks = [1] if cfg.ranks > 1 and cfg.oom_on == "one" else list(range(cfg.ranks))
    for rank in fired_ranks:
        if not any("fired_at" in r for r in _lines(got.run_dir / OPS_FILE_TEMPLATE.format(rank=rank))):
            problems.append(f"rank {rank}: the fault never fired")
    leftovers = sorted(p.name for p in got.run_dir.glob(".tmp-step-*"))
    if leftovers:
        problems.append(f"temp checkpoint directories left: {leftovers}")
    for ckpt in sorted(got.run_dir.glob("step-*")):
        why = store.verify(ckpt)
        if why is not None:
            problems.append(f"{ckpt.name}: {why}")
    drift = 0.0
    if got.weights.keys() != clean.weights.keys():
        problems.append("weights: other keys than the clean run's")
    else:
        for k, v in got.weights.items():
            ref = clean.weights[k].float()
            rel = ((v.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            drift = max(drift, rel)
            if not rel <= WEIGHT_RTOL:
                problems.append(f"weights: {k} differs from the clean run by {rel:.3g} of its norm")
                break
    plans = [r for r in rows if r.get("kind") == "plan"]
    clean_plans = [r for r in _lines(clean.run_dir / "metrics.jsonl") if r.get("kind") == "plan"]
    if "tier_change" in events:
        outcome = "step-down"
    elif "oom_shrink" in events:
        outcome = "shrink"
    elif "oom_retry" in events:
        outcome = "retry"
    elif "eval_skipped" in events:
        outcome = "eval-skipped"
    elif "checkpoint_skipped" in events:
        outcome = "save-skipped"
    elif plans and clean_plans and plans[0]["micro_batch"] < clean_plans[0]["micro_batch"]:
        outcome = "probe-smaller"
    elif cfg.region == "save":
        outcome = "save-again"
    elif cfg.region == "eval":
        outcome = "eval-shrink"
    else:
        outcome = "absorbed"
    return outcome, problems, drift


def configs(tiers: list[str], ranks: list[int], regions: list[str], *, loras: tuple[bool, ...] = (False, True),
            ckpts: tuple[bool, ...] = (False, True)) -> list[Config]:  # fmt: skip
    out = []
    for tier, n, lora, ckpt, region in itertools.product(tiers, ranks, loras, ckpts, regions):
        for who in (("all",) if n == 1 else ("one", "all")):
            out.append(Config(tier, n, who, lora, ckpt, region))
    return out


def sweep_configs(cfgs: list[Config], work: Path, *, points: int | None, seed: int, budget_s: float,
                  device: str = "cpu", log: Any = print) -> dict[str, Any]:  # fmt: skip
    """Run the matrix; stops starting new points once `budget_s` has passed (what ran is reported)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    rows: list[Point] = []
    lengths: dict[str, int] = {}
    clean_runs: dict[tuple[Any, ...], Run] = {}
    skipped = 0
    for cfg in cfgs:
        if time.monotonic() - t0 > budget_s:
            skipped += 1
            continue
        base = work / cfg.name.replace(" ", "_").replace(":", "-")
        mbs = cfg.spec(base)["training"]["micro_batch"]
        key = (cfg.tier, cfg.ranks, cfg.lora, cfg.checkpointing, mbs)
        if key not in clean_runs:
            clean_runs[key] = run(cfg, base.parent / ("clean-" + "-".join(map(str, key))), None, device)
        clean = clean_runs[key]
        n, counted = region_ops(cfg, base, device)
        lengths[cfg.name] = n
        if clean.code != 0 or counted.code != 0:
            why = f"clean run: {clean.code}; counting run: {counted.code}"
            rows.append(Point(cfg.name, 0, False, "failed", [why], counted.seconds))
            continue
        ks = list(range(1, n + 1)) if points is None else sorted(rng.sample(range(1, n + 1), min(points, n)))
        for k in ks:
            if time.monotonic() - t0 > budget_s:
                break
            got = run(cfg, base / f"op{k}", cfg.fault(k), device)
            outcome, problems, drift = check(cfg, got, clean)
            rows.append(Point(cfg.name, k, not problems, outcome, problems, round(got.seconds, 2), drift))
            if problems:
                log(f"FAIL {cfg.name} op {k}: {outcome}: {'; '.join(problems)}")
            shutil.rmtree(got.run_dir, ignore_errors=True)
    return {"rows": [asdict(r) for r in rows], "region_ops": lengths, "configs_skipped_by_budget": skipped,
            "max_drift": max((r.drift for r in rows), default=0.0),
            "points": len(rows), "recovered": sum(r.ok for r in rows), "seconds": round(time.monotonic() - t0, 1),
            "matrix_md": matrix(rows, lengths)}  # fmt: skip


def matrix(rows: list[Point], lengths: dict[str, int]) -> str:
    """Markdown: one row per configuration, the points run, their outcomes and failures."""
    kinds = ["shrink", "retry", "step-down", "absorbed", "eval-shrink", "eval-skipped", "save-again", "save-skipped",
             "probe-smaller", "failed"]  # fmt: skip
    by: dict[str, Counter[str]] = {name: Counter() for name in lengths}  # a region with no op has no point
    bad: Counter[str] = Counter()
    for r in rows:
        by.setdefault(r.config, Counter())[r.outcome] += 1
        bad[r.config] += not r.ok
    used = [k for k in kinds if any(c[k] for c in by.values())]
    head = "| configuration | allocating ops | points | " + " | ".join(used) + " | not recovered |"
    lines = [head, "| " + " | ".join(["---"] * (len(used) + 4)) + " |"]
    for name, c in by.items():
        lines.append(f"| {name} | {lengths.get(name, 0)} | {sum(c.values())} | "
                     + " | ".join(str(c[k]) for k in used) + f" | {bad[name]} |")  # fmt: skip
    total = Counter[str]()
    for c in by.values():
        total.update(c)
    lines.append(f"| all | {sum(lengths.values())} | {sum(total.values())} | "
                 + " | ".join(str(total[k]) for k in used) + f" | {sum(bad.values())} |")  # fmt: skip
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """Markdown: regions x (tier, ranks), each cell `recovered/points` and the outcomes seen
    (docs/concepts/tiers.md's table)."""
    short = {"shrink": "S", "retry": "R", "step-down": "D", "absorbed": "A", "eval-shrink": "E", "eval-skipped": "E0",
             "save-again": "W", "save-skipped": "W0", "probe-smaller": "P", "failed": "F"}  # fmt: skip
    cols: dict[str, None] = {}
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        tier, ranks, *_rest = r["config"].split()
        region = r["config"].split()[-1]
        col = f"{tier} {ranks}"
        cols.setdefault(col)
        cells.setdefault((region, col), []).append(r)
    lines = ["| region | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for region in REGIONS:
        out = []
        for col in cols:
            got = cells.get((region, col), [])
            kinds = "".join(sorted({short[r["outcome"]] for r in got if r["outcome"] in short}))
            out.append(f"{sum(r['ok'] for r in got)}/{len(got)} {kinds}" if got else "-")
        lines.append(f"| {region} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def sweep(work: Path, *, device: str, budget_s: float, points: int, seed: int) -> dict[str, Any]:
    """The GPU suite's part (bench/gpu): one rank on `device`, every tier, full and LoRA, the five regions, a sample
    of `points` ops each, within `budget_s`."""
    logging.disable(logging.WARNING)
    try:
        cfgs = configs(list(TIERS), [1], list(REGIONS), ckpts=(False,))
        random.Random(seed).shuffle(cfgs)  # a budget that ends the sweep early still leaves a spread of tiers, regions
        return sweep_configs(cfgs, work, points=points, seed=seed, budget_s=budget_s, device=device)
    finally:
        logging.disable(logging.NOTSET)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=6, help="ops sampled per configuration (default 6)")
    ap.add_argument("--all", action="store_true", help="every op of every region (hours)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    ap.add_argument("--tiers", nargs="+", default=list(TIERS), choices=list(TIERS))
    ap.add_argument("--regions", nargs="+", default=list(REGIONS), choices=list(REGIONS))
    ap.add_argument("--lora", choices=["both", "off", "on"], default="both")
    ap.add_argument("--checkpointing", choices=["both", "off", "on"], default="both")
    ap.add_argument("--budget-s", type=float, default=3600.0)
    ap.add_argument("--json", type=Path, help="write every point here")
    ap.add_argument("--keep", type=Path, help="work directory to keep (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    pick = {"both": (False, True), "off": (False,), "on": (True,)}
    logging.disable(logging.WARNING)
    cfgs = configs(args.tiers, args.ranks, args.regions, loras=pick[args.lora], ckpts=pick[args.checkpointing])
    work = args.keep or Path(tempfile.mkdtemp(prefix="oom-anywhere-"))
    try:
        out = sweep_configs(cfgs, work, points=None if args.all else args.points, seed=args.seed,
                            budget_s=args.budget_s)  # fmt: skip
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    stamp = time.strftime("%Y-%m-%d")
    print(f"OOM anywhere, {stamp}, {os.cpu_count()} CPUs, torch {__import__('torch').__version__}: "
          f"{out['recovered']} of {out['points']} points recovered in {out['seconds']} s "
          f"({out['configs_skipped_by_budget']} configurations left out by the budget); largest weight difference from "
          f"the clean run {out['max_drift']:.2e} of a tensor's norm\n")  # fmt: skip
    print(out["matrix_md"])
    print("\nBy region (recovered/points, outcomes: S shrink, R retry, D step-down, A absorbed, E eval shrink, "
          "E0 eval skipped, W written again, W0 skipped, P probe chose smaller, F failed)\n")
    print(summary(out["rows"]))
    if args.json:
        args.json.write_text(json.dumps({**out, "date": stamp}, indent=1))
    return 0 if out["recovered"] == out["points"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
