"""`training.optimizer`: AdamW against torchao's 8-bit AdamW, the optimizer step alone, as the runner takes it.

    python bench/optimizer.py                          # CPU: the tiny preset
    python bench/optimizer.py --preset gpt2-small      # CPU, 124M parameters
    python bench/optimizer.py --device cuda --preset llama-1b

Both sides step twin models (same preset, seed and fixed random gradients) through the runner's own pieces:
`engine.make_optimizer` for the spec's `training.optimizer`, and `Update.prepare` + `Update.apply` (clipping, the
learning rate, AdamW's group-by-group step or AdamW8bit's parameter-by-parameter one). The first steps (torchao's
compile of each parameter shape) are warm-up; then the two take turns, step by step, taking turns at going first,
and the medians of wall and CPU time per step are compared. Also printed: the optimizer state's bytes counted on
the real tensors (codes and scales for the 8-bit moments) against the memory model's, and on a GPU the peak bytes a
step allocates beyond the states (the model counts LOW_BIT_STEP_BYTES a value of the largest tensor).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobspec.catalog.presets import PRESETS  # noqa: E402
from jobspec.plan import memory  # noqa: E402
from jobspec.spec.loader import parse_spec  # noqa: E402
from runner import internals  # noqa: E402
from runner.model.build import build_model  # noqa: E402
from runner.train import engine  # noqa: E402
from runner.train.update import Update  # noqa: E402

OPTIMIZERS = ("adamw", "adamw_8bit")


class Side:
    """One optimizer on its own twin model, its gradients fixed."""

    def __init__(self, optimizer: str, preset: str, device: torch.device):
        vendor = "cpu" if device.type == "cpu" else "cuda"
        spec = parse_spec(yaml.safe_dump({"name": "optimizer-bench", "model": {"preset": preset},
                                          "data": {"max_seq_len": 128}, "hardware": {"vendor": vendor},
                                          "training": {"global_batch": 8, "optimizer": optimizer}}))  # fmt: skip
        vocab = PRESETS[preset].vocab
        self.model = build_model(spec, bos=0, eos=1, vocab=vocab).to(device)
        self.opt = engine.make_optimizer(self.model, spec, device, "fast")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.update = Update(self.opt, self.params, world_size=1, manual_sync=False, max_grad_norm=1.0, device=device)
        g = torch.Generator(device=device).manual_seed(0)
        self.grads = [torch.randn(p.shape, generator=g, device=device) * 1e-3 for p in self.params]
        self.device = device

    def step(self) -> tuple[float, float]:
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g.clone()
        sync(self.device)
        wall, cpu = time.perf_counter(), time.process_time()
        prepared = self.update.prepare([torch.zeros((), device=self.device)], self.device)
        self.update.apply(prepared, 1e-4)
        sync(self.device)
        return time.perf_counter() - wall, time.process_time() - cpu

    def state_bytes(self) -> int:
        total = 0
        for state in self.opt.state.values():
            for key, value in state.items():
                if key == "step" or not torch.is_tensor(value):
                    continue
                local = value.to_local() if hasattr(value, "to_local") else value
                parts = (local.codes, local.scale) if internals.is_quantized(value) else (local,)
                total += sum(t.numel() * t.element_size() for t in parts)
        return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per side")
    args = parser.parse_args()
    device = torch.device(args.device)
    sides = {name: Side(name, args.preset, device) for name in OPTIMIZERS}
    compile_s = {}
    for name, side in sides.items():
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            side.step()
        compile_s[name] = time.perf_counter() - t0
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in OPTIMIZERS}
    for i in range(args.steps):
        order = OPTIMIZERS if i % 2 == 0 else OPTIMIZERS[::-1]
        for name in order:
            times[name].append(sides[name].step())
    shape = PRESETS[args.preset]
    t = sum(p.numel() for p in sides["adamw"].params)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"optimizer step, {args.preset} ({t / 1e6:.1f}M trainable), {args.device}, {when}, torch {torch.__version__}")
    print(f"{'optimizer':12s} {'warm-up s':>10s} {'wall ms':>9s} {'cpu ms':>8s} {'state MiB':>10s} {'model MiB':>10s}")
    for name, side in sides.items():
        wall = statistics.median(w for w, _ in times[name]) * 1e3
        cpu = statistics.median(c for _, c in times[name]) * 1e3
        model = memory.optimizer_bytes(shape, None, name, t, 1)
        print(f"{name:12s} {compile_s[name]:10.1f} {wall:9.2f} {cpu:8.2f} {side.state_bytes() / 2**20:10.2f} "
              f"{model / 2**20:10.2f}")  # fmt: skip
    ratio = statistics.median(w for w, _ in times["adamw_8bit"]) / statistics.median(w for w, _ in times["adamw"])
    print(f"adamw_8bit / adamw step time: {ratio:.2f} (medians of {args.steps} interleaved steps; the model's "
          f"MiB for adamw_8bit include the step's working copies of the largest tensor)")
    if device.type == "cuda":
        side = sides["adamw_8bit"]
        for p, g in zip(side.params, side.grads, strict=True):
            p.grad = g.clone()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        side.update.apply(side.update.prepare([torch.zeros((), device=device)], device), 1e-4)
        sync(device)
        extra = torch.cuda.max_memory_allocated(device) - base
        largest = max(p.numel() for p in side.params)
        print(f"adamw_8bit step: {extra / 2**20:.1f} MiB beyond the states, {extra / largest:.2f} bytes a value of "
              f"the largest tensor (model: {memory.LOW_BIT_STEP_BYTES})")  # fmt: skip


if __name__ == "__main__":
    main()
