"""Peak memory and time of a forward + backward: full-logits cross-entropy vs the chunked one (runner/train/loss.py).

    python bench/loss.py                                   # CPU: gpt2-small shape, 2 layers, mbs 4 x seq 512, fp32
    python bench/loss.py --precision bf16                  # bf16 autocast, fp32 weights (the runner's mixed precision)
    python bench/loss.py --device cuda --layers 12 --micro-batch 8 --seq 1024 --precision bf16   # on a GPU
    python bench/loss.py --device cuda --precision bf16 --liger   # and each chunk by Liger Kernel's Triton kernel

The same model (GPT-2, vocab 50257, hidden 768), weights and tokens on both sides. Peak: torch's MemTracker on
the CPU (every tensor the step allocates, parameters included), the CUDA allocator's max_memory_allocated on a
GPU; the model's weights are allocated before the step and counted. Time: median of `--repeats` steps per side,
taking turns at going first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.data.dataset import IGNORE  # noqa: E402
from runner.train.loss import CHUNK_BYTES, chunk_tokens, install_chunked_loss  # noqa: E402

MIB = 2**20


def peak_bytes(step: Callable[[], None], model: torch.nn.Module, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[device]["Total"])


def timed(step: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tic = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - tic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES // MIB, help="fp32 logits a chunk, MiB")
    ap.add_argument("--liger", action="store_true", help="a third side: training.loss_kernel liger (a GPU's)")
    args = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=args.vocab, n_embd=768, n_layer=args.layers, n_head=12, n_positions=max(1024, args.seq),
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    model = GPT2LMHeadModel(cfg).to(device).train()
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), device=device)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    chunk = chunk_tokens(args.vocab, args.chunk_mib * MIB)
    head = install_chunked_loss(model, chunk=chunk)
    assert head is not None

    def old() -> None:
        with autocast:
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        loss.backward()
        model.zero_grad(set_to_none=True)

    def new() -> None:
        with autocast, head.targets(labels):
            loss = model(input_ids=ids).logits.float().sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    sides = {"full logits": old, "chunked": new}
    if args.liger:  # the same head with Liger's kernel: the runner's chunks, 256 MiB of logits at the compute width
        from runner import internals

        internals.check_liger(device.type)

        def kernel(name: str, step: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                head.kernel, head.chunk = name, None if name == "liger" else chunk
                step()

            return run

        sides = {"full logits": old, "chunked": kernel("chunked", new), "liger": kernel("liger", new)}
    for step in sides.values():
        step()  # warm-up
    peaks = {name: peak_bytes(step, model, device) for name, step in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.repeats):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(timed(sides[name], device))
    tokens = args.micro_batch * args.seq
    print(f"{device} {args.precision}: GPT-2 {args.layers} layers, hidden 768, vocab {args.vocab}, "
          f"{args.micro_batch} x {args.seq} tokens, one fp32 logits {tokens * args.vocab * 4 / MIB:.0f} MiB, "
          f"chunks of {chunk} tokens ({chunk * args.vocab * 4 / MIB:.0f} MiB), "
          f"{torch.get_num_threads()} CPU threads")  # fmt: skip
    for name in sides:
        print(f"  {name:12s} peak {peaks[name] / MIB:8.1f} MiB   step {statistics.median(times[name]) * 1e3:8.1f} ms "
              f"(median of {args.repeats})")  # fmt: skip


if __name__ == "__main__":
    main()
