"""GPU proof in one call: `python -m bench.gpu` on one GPU (at most 9 minutes), `--smoke` on a CPU.

The parts run in this order, each in a process of its own within its own budget (bench/gpu/suite.py); a part
that overruns ends with what it has, is marked so, and the next one starts. The record, `gpu-suite.json` (every
figure, raw rounds included) and `gpu-suite.md` (the report), is written into `--out` (default `$OUT` when set,
else bench/gpu/out/) after every item, so a call cut off at any moment still leaves what it measured.

  tests       `pytest -m gpu` (summary from JUnit XML; SIGINT at its budget keeps the finished tests)
  recovery    real OOM recovery: shrink, tier step-down (bench/gpu/oom.py), the OOM-anywhere sweep sampled within
              its own budget (bench/oom_anywhere.py, where this checkout has it), then the relaunch if it fits
  userpath    `jobspec run` on llama-1b while a separate process takes the GPU's memory at random moments: a shrink
              and a tier step-down in process, every step once, phases logged (bench/gpu/userpath.py; runnable
              alone: python -m bench.gpu.userpath)
  memory      formula vs trace vs `torch.cuda.max_memory_allocated`, gpt2-small x two tiers, at the micro-batch
              the runner verifies with probe steps (bench/gpu/sizing.py); calibration (calibrate.py)
  throughput  issue 42's llama-1b row (runner, plain loop, HF Trainer: bench/throughput.py), runner vs plain bf16
              loop on gpt2-small with MFU, tier speed ratios, VRAM soak (bench/gpu/throughput.py)

Budgets (seconds of wall time; GPU defaults sum to 470, one device call of at most 9 minutes with the install):
--budget-tests 130, --budget-recovery 85 (of which --sweep-budget 35), --budget-userpath 130, --budget-memory 40,
--budget-throughput 85; --total-budget S scales them all to sum to S. A part starts no item that would not end inside
its budget.

  --smoke     every part on the CPU with the tiny preset: the same JSON keys and Markdown sections, GPU-only
              figures null / "n/a (CPU)"; the planner's probe steps run through JOBSPEC_FAULT_OOM="mbs>5,probes",
              the OOM squeeze is a fault injector, userpath is recorded as skipped (its CPU analog,
              tests/runner/oom/test_user_path.py, is in the normal suite) (CI runs this).
  --merge A.json B.json ...   one record and report (gpu-suite.json/.md) from several records
  --calibrate R.json          print the memory-model constants the record's measured peaks suggest
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu import common, suite
from bench.gpu.calibrate import calibrate, text
from bench.gpu.report import markdown, merge

log = logging.getLogger("bench.gpu")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--parts", default=",".join(common.PART_ORDER), help="parts to run, comma-separated (default all)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset (CI)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default $OUT, else bench/gpu/out)")
    for part in common.PART_ORDER:
        p.add_argument(f"--budget-{part}", type=float, default=None, metavar="S", help=f"seconds for part {part}")
    p.add_argument("--sweep-budget", type=float, default=None, metavar="S", help="seconds of the OOM-anywhere sweep")
    p.add_argument("--sweep-points", type=int, default=None, help="points the OOM-anywhere sweep samples")
    p.add_argument("--total-budget", type=float, default=None, metavar="S", help="scale every budget to sum to S")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default by device)")
    p.add_argument("--presets", default=None, help="memory part presets, comma-separated")
    p.add_argument("--per-rank", type=int, default=None, help="per-rank batch the memory part sizes (default 360)")
    p.add_argument("--soak-steps", type=int, default=None, help="steps of the VRAM soak")
    p.add_argument("--keep", action="store_true", help="keep the work directory (runs, metrics, checkpoints)")
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="RECORD")
    p.add_argument("--calibrate", type=Path, default=None, metavar="RECORD")
    p.add_argument("-v", "--verbose", action="store_true", help="the runner's INFO log too")
    # a part's own process (bench/gpu/suite.py starts it)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--stem", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def configure(args: argparse.Namespace) -> common.Config:
    cfg = common.Config.cpu_smoke() if args.smoke else common.Config.gpu()
    budgets = dict(cfg.budgets)
    for part in common.PART_ORDER:
        if (value := getattr(args, f"budget_{part}")) is not None:
            budgets[part] = value
    changes: dict[str, Any] = {"budgets": budgets}
    if args.sweep_budget is not None:
        changes["sweep_budget_s"] = args.sweep_budget
    if args.sweep_points is not None:
        changes["sweep_points"] = args.sweep_points
    if args.peak_tflops is not None:
        changes["peak_tflops"] = args.peak_tflops
    if args.presets:
        changes["memory_presets"] = tuple(x.strip() for x in args.presets.split(",") if x.strip())
    if args.per_rank is not None:
        changes["per_rank"] = args.per_rank
    if args.soak_steps is not None:
        changes["soak_steps"] = args.soak_steps
    cfg = dataclasses.replace(cfg, **changes)
    return cfg.scaled(args.total_budget) if args.total_budget else cfg


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    log.setLevel(logging.INFO)
    out = args.out or Path(os.environ.get("OUT") or common.ROOT / "bench" / "gpu" / "out")
    if args.child:
        return suite.child(args.child, args.work, out, args.stem, args.deadline)
    if args.calibrate:
        print(text(calibrate(json.loads(args.calibrate.read_text()))))
        return 0
    if args.merge:
        path = suite.write(out, "gpu-suite", merge([json.loads(p.read_text()) for p in args.merge]))
        print(f"merged {len(args.merge)} records: {path}")
        return 0
    cfg = configure(args)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(common.PART_ORDER))
    if unknown:
        print(f"--parts: unknown {', '.join(unknown)}; the parts are {', '.join(common.PART_ORDER)}", file=sys.stderr)
        return 2
    stem = "gpu-suite" + ("-smoke" if args.smoke else "")
    t0 = time.perf_counter()
    record, code = suite.run(cfg, parts, out, stem, args.keep)
    print(markdown(record))
    print(f"wrote {out / stem}.json and .md in {time.perf_counter() - t0:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
