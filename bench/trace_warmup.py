"""The trace's first optimizer step: one micro-batch against the whole step of `grad_accum` micro-batches, measured.

`python -m bench.trace_warmup [--micro-batch 2] [--seq 256] [--repeats 1]` traces (runner/train/trace.py
`trace_step`) a 3-layer Llama with grouped-query attention and an untied 48k vocabulary and a 3-layer GPT-2 with a
tied 40k one, at every tier, full and LoRA (rank 8), on one and four ranks, once with `warmup="one"` (the default:
a first step of one micro-batch creates Adam's moments and FSDP2's recorded order) and once with `warmup="step"` (a
whole first step of two micro-batches, as before), paired and interleaved. It prints each row's peak both ways, the
difference, and the time of each (wall and CPU), then the totals. The peak differs by what each forward and
backward leaves behind (2 KiB; with LoRA and activation checkpointing a 16-bit (micro-batch, seq, hidden) tensor).
A first step on zero gradients with no forward at all (half the time) was tried and left: FSDP2 then had not
recorded its forward order, and the measured step peaked elsewhere (zero3 models up to 10 % lower).

2026-11-29, this project's 2-core CPU machine (torch 2.13), 40 rows, alongside a test run: CPU 125.8 s -> 92.1 s
(0.73x), wall 201.8 s -> 146.8 s (median ratio 0.78); the peak the same but 2,048 B lower on 30 rows and 788,480 B
(0.2-0.5 %) lower on the 10 LoRA rows under activation checkpointing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jobspec.catalog.presets import ModelShape
from jobspec.catalog.tiers import TIERS
from jobspec.spec.models import LoraSpec
from runner.train.trace import runner_loss, trace_step

SHAPES = {
    "llama-gqa": (ModelShape("llama", layers=3, hidden=384, heads=6, kv_heads=2, vocab=48_000, max_positions=1024,
                             intermediate=1024, tie_embeddings=False), ["q_proj", "v_proj"]),
    "gpt2-tied": (ModelShape("gpt2", layers=3, hidden=384, heads=6, kv_heads=None, vocab=40_000, max_positions=1024,
                             intermediate=1536, tie_embeddings=True), ["c_attn"]),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each way per row (medians)")
    args = parser.parse_args(argv)
    print(f"{'model':10} {'tier':14} {'kind':5} {'ranks':>5} {'peak step':>13} {'peak one':>13} {'diff B':>10} "
          f"{'diff %':>7} {'s step':>7} {'s one':>8} {'cpu step':>8} {'cpu one':>9}")  # fmt: skip
    walls: dict[str, list[float]] = {"step": [], "one": []}
    cpus: dict[str, list[float]] = {"step": [], "one": []}
    ratios = []
    for name, (shape, targets) in SHAPES.items():
        for tier in TIERS:
            for lora in (None, LoraSpec(rank=8, targets=targets)):
                for ranks in (1, 4):
                    peak, wall, cpu = {}, {"step": [], "one": []}, {"step": [], "one": []}
                    for _ in range(args.repeats):
                        for way in ("step", "one"):  # interleaved
                            t, c = time.perf_counter(), time.process_time()
                            peak[way] = trace_step(shape, tier=tier, world_size=ranks, micro_batch=args.micro_batch,
                                                   seq_len=args.seq, loss=runner_loss, lora=lora, warmup=way).peak
                            wall[way].append(time.perf_counter() - t)
                            cpu[way].append(time.process_time() - c)
                    w = {k: statistics.median(v) for k, v in wall.items()}
                    c = {k: statistics.median(v) for k, v in cpu.items()}
                    for way in w:
                        walls[way].append(w[way])
                        cpus[way].append(c[way])
                    diff = peak["one"] - peak["step"]
                    ratios.append(w["one"] / w["step"])
                    print(f"{name:10} {tier:14} {'lora' if lora else 'full':5} {ranks:5d} {peak['step']:13,d} "
                          f"{peak['one']:13,d} {diff:10,d} {100 * diff / peak['step']:7.2f} {w['step']:7.2f} "
                          f"{w['one']:8.2f} {c['step']:8.2f} {c['one']:9.2f}", flush=True)  # fmt: skip
    print(f"total wall: step {sum(walls['step']):.1f} s, one {sum(walls['one']):.1f} s; CPU: step "
          f"{sum(cpus['step']):.1f} s, one {sum(cpus['one']):.1f} s; median time ratio one/step "
          f"{statistics.median(ratios):.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
