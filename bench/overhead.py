"""Runner steady-state tokens/s vs a plain PyTorch loop on the same model, micro-batch, precision and tokens.

    python bench/overhead.py                       # CPU: tiny preset, quickstart shapes (mbs 16, seq 128)
    python bench/overhead.py --accum 4 --micro-batch 4    # 4 micro-batches per step (the no_sync path)
    python bench/overhead.py --device cuda --preset gpt2-small --precision bf16 --packing   # on a GPU

Both sides train the identical micro-batches (the runner's own step_samples and collate; padding is
not counted as tokens). The plain side is forward, token-summed cross-entropy, backward, clip, AdamW
step, zero_grad on a twin model, with its batches collated outside the timer (a strict baseline).
Two measurements, because a shared machine is noisy:
  loop   rounds of `--steps` steps of `Recipe.train()` itself (stop-flag checks, token all-reduce,
         metrics, progress, LR schedule), timed by its own metrics record, alternating with plain rounds;
         the best round of each side is compared (noise only ever slows a round down).
  step   `Recipe.train_step` and one plain step, step by step, taking turns at going first (adjacent
         steps share the machine's state); the medians of the per-step times are compared.
Goal: runner >= 97 % of plain.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobspec.spec.loader import parse_spec  # noqa: E402
from runner.data.dataset import IGNORE, Batch, micro_batches  # noqa: E402
from runner.model.build import build_model  # noqa: E402
from runner.train.recipe import Recipe  # noqa: E402


def make_spec(args: argparse.Namespace, run_dir: str):  # -> JobSpec
    training = {"global_batch": args.micro_batch * args.accum, "micro_batch": args.micro_batch, "steps": 10**6,
                "warmup_steps": 0, "learning_rate": 1e-4, "precision": args.precision, "log_every": 10**6,
                "eval_batches": 1}  # fmt: skip
    return parse_spec(yaml.safe_dump({
        "name": "overhead",
        "model": {"preset": args.preset},
        "data": {"max_seq_len": args.seq, "packing": args.packing, "eval_fraction": 0.01},
        "training": training,
        "hardware": {"vendor": "cuda" if args.device == "cuda" else "cpu", "gpus": 1},
        "memory": {"tier": "fast"},
        "checkpoints": {"dir": run_dir, "every_steps": 10**6, "keep": 1},
    }))  # fmt: skip


class Plain:
    """The textbook loop on a twin of the runner's model (same seed, config, optimizer settings)."""

    def __init__(self, recipe: Recipe):
        self.recipe, self.device = recipe, recipe.device
        # built where it trains (as the runner's on tier fast): llama-1b on the host took ~30 s (issue 41)
        on = self.device if self.device.type == "cuda" else None
        self.model = build_model(recipe.spec, bos=257, eos=258, vocab=262, device=on,
                                 precision=recipe.plan.precision).to(self.device).train()  # a LoRA base at 16 bits
        # fused on every device, as the runner's (runner/train/engine.py make_optimizer): the same work on both sides
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.plan.precision)
        self.max_norm = recipe.spec.training.max_grad_norm

    def batches(self, step: int) -> list[Batch]:
        return [self.recipe.data.collate(ids) for ids in micro_batches(self.recipe.step_ids(step), self.mbs)]

    @property
    def mbs(self) -> int:
        return self.recipe.plan.micro_batch

    def step(self, batches: list[Batch]) -> torch.Tensor:
        targets = sum(b.targets for b in batches)
        for b in batches:
            x, y = b.input_ids.to(self.device, non_blocking=True), b.labels.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                logits = self.model(input_ids=x).logits  # (B, T, V)
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
            (ce / targets).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return ce


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def loop_rounds(recipe: Recipe, plain: Plain, records: list[dict], steps: int, rounds: int) -> tuple[list, list]:
    """Tokens/s per round: `Recipe.train()` (its own metrics record: from train() start to the last step's
    log, before the final eval and checkpoint) and the plain loop on the same steps."""
    ours, theirs = [], []
    for r in range(rounds + 1):
        first = recipe.step
        recipe.total_steps = recipe.step + steps
        recipe.train()
        batches = [plain.batches(s) for s in range(first, first + steps)]
        sync()
        tic = time.perf_counter()
        for b in batches:
            ce = plain.step(b)
        ce.item()  # the runner syncs once per logged step too
        sync()
        if r:  # round 0 warms caches, the allocator and (on GPU) kernels
            ours.append([x for x in records if x.get("kind") == "train"][-1]["tokens_per_s"])
            theirs.append(sum(x.tokens for b in batches for x in b) / (time.perf_counter() - tic))
    return ours, theirs


def interleaved_steps(recipe: Recipe, plain: Plain, steps: int) -> tuple[list, list]:
    """Seconds per optimizer step, a runner step and a plain step on the same samples, taking turns at
    going first (the second one finds the caches holding the other model)."""
    ours, theirs = [], []
    for i in range(steps + 5):
        s = recipe.step
        batches = plain.batches(s)
        sides = [("runner", lambda s=s: recipe.train_step(s)), ("plain", lambda b=batches: plain.step(b))]
        for name, run in sides if i % 2 else reversed(sides):
            sync()
            tic = time.perf_counter()
            run()
            sync()
            if i >= 5:  # warm-up
                (ours if name == "runner" else theirs).append(time.perf_counter() - tic)
        recipe.step += 1
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--packing", action="store_true", help="pack rows to the full --seq length")
    parser.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 (default: fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per loop round")
    parser.add_argument("--rounds", type=int, default=20, help="measured loop rounds per side (after a warm-up)")
    parser.add_argument("--step-samples", type=int, default=150, help="interleaved steps measured per side")
    args = parser.parse_args()
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as run_dir:
        recipe = Recipe(make_spec(args, run_dir))
        recipe.setup()
        records: list[dict] = []
        write = recipe.metrics.write
        recipe.metrics.write = lambda r: (records.append(r), write(r))[1]  # also keep the records in memory
        plain = Plain(recipe)
        try:
            loop = loop_rounds(recipe, plain, records, args.steps, args.rounds)
            per_step = interleaved_steps(recipe, plain, args.step_samples)
        finally:
            recipe.cleanup()
    p = recipe.plan
    print(
        f"device {args.device}, preset {args.preset}, precision {p.precision}, micro-batch {p.micro_batch} x "
        f"{p.grad_accum}, seq <= {args.seq}{' packed' if args.packing else ''}, {torch.get_num_threads()} threads"
    )
    (ours, theirs), (a, b) = loop, per_step
    best, base = max(ours), max(theirs)
    print(f"loop  ({args.rounds} rounds of {args.steps} steps, best round)")
    print(f"  runner {best:>10,.0f} tokens/s   plain {base:>10,.0f} tokens/s   ratio {best / base:.1%}")
    mine, plain_s = statistics.median(a), statistics.median(b)
    print(f"step  ({args.step_samples} interleaved steps, median seconds per step)")
    print(f"  runner {mine * 1e3:>8.2f} ms   plain {plain_s * 1e3:>8.2f} ms   ratio {plain_s / mine:.1%}")
    print("goal: ratio >= 97% (runner throughput as a fraction of the plain loop's)")


if __name__ == "__main__":
    main()
