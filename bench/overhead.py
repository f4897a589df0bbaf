"""Runner steady-state tokens/s vs a plain PyTorch loop on the same model, micro-batch, precision and tokens.

    python bench/overhead.py                       # CPU: tiny preset, quickstart shapes (mbs 16, seq 128)
    python bench/overhead.py --accum 4             # 4 micro-batches per step (the no_sync path)
    python bench/overhead.py --device cuda --preset gpt2-small --precision bf16 --packing   # on a GPU

Both sides train rounds of `--steps` optimizer steps on the identical micro-batches (the runner's own
step_samples and collate; padding excluded from the token count), interleaved so that machine noise
hits both alike; round 0 is warm-up. The runner side is `Worker.train()` itself (stop-flag checks, token
all-reduce, metrics, progress, LR schedule) timed by its own metrics record; the plain side is
forward, token-summed cross-entropy, backward, clip, AdamW step, zero_grad. Goal: runner >= 97 % of plain.
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

from jobspec.loader import parse_spec  # noqa: E402
from runner.data import IGNORE, micro_batches  # noqa: E402
from runner.model import build_model  # noqa: E402
from runner.worker import Worker  # noqa: E402


def make_spec(args: argparse.Namespace, run_dir: str):  # -> JobSpec
    gpu = args.device == "cuda"
    return parse_spec(yaml.safe_dump({
        "name": "overhead",
        "model": {"preset": args.preset},
        "data": {"max_seq_len": args.seq, "packing": args.packing, "eval_fraction": 0.01},
        "training": {"global_batch": args.micro_batch * args.accum, "micro_batch": args.micro_batch,
                     "steps": 10**6, "warmup_steps": 0, "learning_rate": 1e-4, "precision": args.precision,
                     "log_every": 10**6, "eval_batches": 1},
        "hardware": {"vendor": "cuda" if gpu else "cpu", "gpus": 1},
        "memory": {"tier": "fast"},
        "checkpoints": {"dir": run_dir, "every_steps": 10**6, "keep": 1},
    }))


def runner_round(worker: Worker, steps: int, records: list[dict]) -> float:
    """Tokens/s of `steps` more steps of the real loop, from its own end-of-run metrics record (the window
    starts when train() starts and ends at the last step's log, before the final eval and checkpoint)."""
    worker.total_steps = worker.step + steps
    worker.train()
    return [r for r in records if r.get("kind") == "train"][-1]["tokens_per_s"]


class Plain:
    """The textbook loop on a twin of the runner's model (same seed, config, optimizer settings)."""

    def __init__(self, worker: Worker, device: torch.device, precision: str):
        spec = worker.spec
        self.model = build_model(spec, bos=257, eos=258, vocab=262).to(device).train()
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=fused or None)
        self.device, self.worker = device, worker
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.max_norm = spec.training.max_grad_norm

    def round(self, first_step: int, steps: int) -> float:
        w, dev = self.worker, self.device
        plan = w.plan
        batches = [[w.data.collate(ids) for ids in micro_batches(w.step_ids(s), plan.micro_batch)]
                   for s in range(first_step, first_step + steps)]
        tokens = sum(b.tokens for step in batches for b in step)
        sync()
        tic = time.perf_counter()
        for step in batches:
            targets = sum(b.targets for b in step)
            for b in step:
                x, y = b.input_ids.to(dev, non_blocking=True), b.labels.to(dev, non_blocking=True)
                with torch.autocast(dev.type, dtype=self.dtype, enabled=self.dtype is not None):
                    logits = self.model(input_ids=x).logits  # (B, T, V)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE,
                                       reduction="sum") / targets
                loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        loss.item()  # the runner syncs once per logged step too
        sync()
        return tokens / (time.perf_counter() - tic)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--packing", action="store_true", help="pack rows to the full --seq length")
    parser.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 (default: fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per side (after one warm-up)")
    args = parser.parse_args()
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as run_dir:
        worker = Worker(make_spec(args, run_dir))
        worker.setup()
        records: list[dict] = []
        write = worker.metrics.write
        worker.metrics.write = lambda r: (records.append(r), write(r))[1]  # also keep the records in memory
        plain = Plain(worker, worker.device, worker.plan.precision)
        ours, theirs = [], []
        try:
            for r in range(args.rounds + 1):
                first = worker.step
                a = runner_round(worker, args.steps, records)
                b = plain.round(first, args.steps)
                if r:  # round 0 warms caches, allocator and (on GPU) kernels
                    ours.append(a)
                    theirs.append(b)
        finally:
            worker.cleanup()
    p = worker.plan
    print(f"device {args.device}, preset {args.preset}, precision {p.precision}, micro-batch {p.micro_batch} x "
          f"{p.grad_accum}, seq <= {args.seq}{' packed' if args.packing else ''}, {args.steps} steps x "
          f"{args.rounds} rounds, {torch.get_num_threads()} CPU threads")
    print(f"runner  {statistics.median(ours):>12,.0f} tokens/s  (rounds: {', '.join(f'{x:,.0f}' for x in ours)})")
    print(f"plain   {statistics.median(theirs):>12,.0f} tokens/s  (rounds: {', '.join(f'{x:,.0f}' for x in theirs)})")
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    print(f"ratio   {statistics.median(ours) / statistics.median(theirs):.1%} of the plain loop "
          f"(per-round median {statistics.median(ratios):.1%}; goal >= 97%)")


if __name__ == "__main__":
    main()
