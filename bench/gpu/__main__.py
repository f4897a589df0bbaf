"""GPU proof in one command: `python -m bench.gpu --part tests|sizing|throughput` on one GPU, `--smoke` on a CPU.

Each call writes `gpu-suite[-PART].json` (the record: every figure, raw rounds included) and `.md` (the
report) into `--out` (default `$OUT` when set, else bench/gpu/out/), rewritten after every item so that a
call cut off at its time limit still leaves what it measured. Parts (each under ~9 minutes on an H100):

  tests       `pytest -m gpu` (summary from JUnit XML), then real OOM recovery (bench/gpu/oom.py)
  sizing      per preset and tier: model guess, verified micro-batch, exhaustive maximum, memory-model error,
              and the constants a calibration would suggest (bench/gpu/sizing.py, calibrate.py)
  throughput  runner vs plain bf16 loop with MFU, tier speed ratios, VRAM soak (bench/gpu/throughput.py)

  --smoke     every part on the CPU with the tiny preset in under a minute: the same JSON keys and Markdown
              sections, GPU-only figures null / "n/a (CPU)"; the planner's probe steps run through
              JOBSPEC_FAULT_OOM="mbs>5,probes", the OOM squeeze is a fault injector (CI runs this).
  --merge A.json B.json ...   one record and report (gpu-suite.json/.md) from the part records
  --calibrate R.json          print the memory-model constants the record's measured peaks suggest
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu import common, device
from bench.gpu.calibrate import calibrate, text
from bench.gpu.report import KEYS, PARTS, markdown, merge

log = logging.getLogger("bench.gpu")
SCHEMA = 1


def write(out: Path, stem: str, record: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, out / f"{stem}.json")
    (out / f"{stem}.md").write_text(markdown(record))
    return out / f"{stem}.md"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=[*PARTS, "all"], default="all", help="which part to run (default all)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, under a minute (CI)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default $OUT, else bench/gpu/out)")
    p.add_argument("--budget-s", type=float, default=None, help="no new item starts after this many s of a part")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default by device)")
    p.add_argument("--presets", default=None, help="sizing presets, comma-separated")
    p.add_argument("--per-rank", type=int, default=None, help="per-rank batch the sizing searches (default 360)")
    p.add_argument("--soak-steps", type=int, default=None, help="steps of the VRAM soak (default 200)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (runs, metrics, checkpoints)")
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="RECORD")
    p.add_argument("--calibrate", type=Path, default=None, metavar="RECORD")
    p.add_argument("-v", "--verbose", action="store_true", help="the runner's INFO log too")
    return p.parse_args(argv)


def configure(args: argparse.Namespace) -> common.Config:
    import dataclasses

    cfg = common.Config.cpu_smoke() if args.smoke else common.Config.gpu()
    changes: dict[str, Any] = {}
    if args.budget_s is not None:
        changes["budget_s"] = args.budget_s
    if args.peak_tflops is not None:
        changes["peak_tflops"] = args.peak_tflops
    if args.presets:
        changes["sizing_presets"] = tuple(x.strip() for x in args.presets.split(",") if x.strip())
    if args.per_rank is not None:
        changes["per_rank"] = args.per_rank
    if args.soak_steps is not None:
        changes["soak_steps"] = args.soak_steps
    return dataclasses.replace(cfg, **changes)


def run_parts(cfg: common.Config, parts: list[str], out: Path, stem: str, keep: bool) -> dict[str, Any]:
    from bench.gpu import gputests, oom, sizing, throughput

    record: dict[str, Any] = dict.fromkeys(KEYS)
    env = device.environment(cfg)
    record.update(schema=SCHEMA, environment=env, config=cfg.to_dict(), parts=parts, seconds={})
    work = Path(tempfile.mkdtemp(prefix="jobspec-gpu-suite-"))
    batches = (cfg.per_rank, cfg.throughput_batch, cfg.tier_batch, cfg.soak_batch, cfg.recovery_batch)
    data = common.write_data(work / "data.jsonl", rows=2 * max(batches) + 16, seq=cfg.seq)

    def save() -> None:
        write(out, stem, record)

    try:
        for part in parts:
            budget, t0 = common.Budget(cfg.budget_s), time.perf_counter()
            log.info("part %s: starting (budget %.0f s)", part, cfg.budget_s)
            if part == "tests":
                record["gpu_tests"] = gputests.run(out, timeout_s=0.6 * cfg.budget_s)
                save()
                oom.run(cfg, work, data, budget, save, record)
            elif part == "sizing":
                sizing.run(cfg, work, data, budget, save, record)
                record["calibration"] = calibrate(record)
            else:
                name = None if cfg.device == "cpu" else env["device"]
                throughput.run(cfg, work, data, budget, save, record, name)
            record["seconds"][part] = round(time.perf_counter() - t0, 1)
            save()
            log.info("part %s: done in %.0f s", part, record["seconds"][part])
    finally:
        if keep:
            log.info("work directory kept: %s", work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return record


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
    if args.calibrate:
        print(text(calibrate(json.loads(args.calibrate.read_text()))))
        return 0
    if args.merge:
        path = write(out, "gpu-suite", merge([json.loads(p.read_text()) for p in args.merge]))
        print(f"merged {len(args.merge)} records: {path}")
        return 0
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "python -m bench.gpu needs a CUDA or ROCm GPU (torch.cuda.is_available() is False); "
            "--smoke runs the suite on the CPU",
            file=sys.stderr,
        )
        return 2
    cfg = configure(args)
    if cfg.threads:  # also for the pytest subprocess
        torch.set_num_threads(cfg.threads)
        os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    parts = list(PARTS) if args.part == "all" else [args.part]
    stem = "gpu-suite" + ("-smoke" if args.smoke else "") + ("" if args.part == "all" else f"-{args.part}")
    t0 = time.perf_counter()
    record = run_parts(cfg, parts, out, stem, args.keep)
    print(markdown(record))
    print(f"wrote {out / stem}.json and .md in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
