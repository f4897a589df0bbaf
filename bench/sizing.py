"""Micro-batch sizing on a real GPU: the planner's guess, `verify_micro_batch`, and exhaustive search.

    python bench/sizing.py [--preset gpt2-small] [--seq-len 1024] [--per-rank-batch 360]

Prints the micro-batch the memory model guessed, the one the probe steps verified, how many probe
steps and seconds that took, and the largest micro-batch that fits by exhaustive search (every divisor
of the per-rank batch in ascending order until the first that does not fit), plus peak memory at the
verified micro-batch against the model's estimate. Goal (issue 4): within 10 % of the exhaustive
maximum in at most log2(per-rank batch) + 3 probes. A probe step is a full AdamW step under bf16
autocast at the longest sequence; "fits" means no OOM and peak reserved memory within the plan's
budget (target_utilization x free memory). 360 = 2^3 * 3^2 * 5 has 24 divisors, so the divisor
constraint costs little and the search has real work to do.

The loss is the runner's (`runner.train.step.summed_loss` through the chunked-loss head that `Stepper` installs,
runner/train/loss.py), as the memory model assumes: the fp32 logits never whole. Until 2026-11-28 this probe took
transformers' own loss (`model(labels=...)`: whole (B, T, V) logits, upcast, and their gradient, about 0.5 GiB a
sample of gpt2-small at seq 1024), so its peak was 1.61 x the model's on the H200 (96.6 GiB at micro-batch 72
against 59.9 predicted) while the runner's own step measured +3.6 % at 120 (bench/gpu/records/2026-11-28-h200).
Traced on FakeTensors on the CPU (runner/train/trace.py, gpt2-small, seq 1024, micro-batch 72, fast, 2026-11-28):
transformers' loss 96.56 GiB at the peak (27.6 of it temporaries: the whole logits), the runner's 57.65 GiB; the
memory model says 56.36 without its overhead, 60.18 with it.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any

GiB = 1024**3


def gpt2_probe(preset: str, seq_len: int, device: Any) -> tuple[Callable[[int], None], Any]:
    """(step, model): `step(mbs)` runs forward, the runner's chunked loss, backward and a fused AdamW step on random
    tokens under bf16 autocast (fp32 weights: 4 + 4 + 8 = 16 bytes/param, as the memory model assumes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jobspec.catalog.presets import PRESETS
    from runner.model.build import preset_config
    from runner.train.loss import install_chunked_loss
    from runner.train.step import summed_loss

    shape = PRESETS[preset]
    cfg = preset_config(shape, bos=0, eos=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    head = install_chunked_loss(model, device=device)  # as Stepper installs it
    assert head is not None, f"{preset}: the runner keeps the full logits for this model (see the log)"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(0)

    def step(mbs: int) -> None:
        opt.zero_grad(set_to_none=True)  # a failed step can leave partial gradients behind
        ids = torch.randint(0, shape.vocab, (mbs, seq_len), device=device, generator=gen)  # (B, T)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = summed_loss(model, head, ids, ids) / ids.numel()
        loss.backward()
        opt.step()  # Adam allocates its moments here: a forward/backward-only probe under-counts
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step, model


def exhaustive(per_rank: int, try_step: Callable[[int], bool]) -> tuple[int, int]:
    """(largest divisor that fits, probe steps): ascending until the first failure (memory is monotone)."""
    from jobspec.catalog.tiers import divisors

    best, steps = 0, 0
    for d in divisors(per_rank):
        steps += 1
        if not try_step(d):
            break
        best = d
    return best, steps


def measure(preset: str, seq_len: int, per_rank: int, utilization: float = 0.9) -> dict[str, Any]:
    """Plan, verify and search exhaustively on GPU 0; every figure in one dict."""
    import torch

    from jobspec.spec.models import JobSpec
    from runner.oom.detect import oom_guard
    from runner.sizing.plan import initial_plan, verify_micro_batch
    from runner.sizing.probe import describe, probe_device, probe_host

    host = probe_host()
    device_info = probe_device(0, host=host)
    spec = JobSpec.model_validate({
        "name": "sizing", "model": {"preset": preset}, "data": {"max_seq_len": seq_len},
        "training": {"global_batch": per_rank, "precision": "bf16"},
        "memory": {"tier": "fast", "target_utilization": utilization},
    })  # fmt: skip
    plan = initial_plan(spec, device_info, host, 1)
    step, _model = gpt2_probe(preset, seq_len, torch.device("cuda", 0))
    try_step = oom_guard(step, budget_bytes=plan.budget_bytes)

    t0 = time.perf_counter()
    verified = verify_micro_batch(plan, try_step)
    t_verify = time.perf_counter() - t0
    t0 = time.perf_counter()
    best, steps = exhaustive(per_rank, try_step)
    t_exhaustive = time.perf_counter() - t0

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step(verified.micro_batch)
    return {
        "device": describe(device_info, host),
        "preset": preset,
        "seq_len": seq_len,
        "per_rank": per_rank,
        "budget_gib": plan.budget_bytes / GiB,
        "model_guess": plan.micro_batch,
        "model_max": plan.model_max_micro_batch,
        "verified": verified.micro_batch,
        "probes": verified.probes,
        "probe_bound": math.log2(per_rank) + 3,
        "verify_s": t_verify,
        "exhaustive": best,
        "exhaustive_steps": steps,
        "exhaustive_s": t_exhaustive,
        "predicted_gib": verified.estimated_bytes / GiB,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
        "reasons": verified.reasons,
    }


def report(r: dict[str, Any]) -> str:
    ratio = r["verified"] / r["exhaustive"] if r["exhaustive"] else float("nan")
    return "\n".join([
        r["device"],
        f"{r['preset']} seq {r['seq_len']}, per-rank batch {r['per_rank']}, budget {r['budget_gib']:.1f} GiB",
        f"  memory model: guess {r['model_guess']} (max {r['model_max']})",
        f"  verified:     {r['verified']} in {r['probes']} probe steps (bound {r['probe_bound']:.1f}), "
        f"{r['verify_s']:.1f} s",
        f"  exhaustive:   {r['exhaustive']} in {r['exhaustive_steps']} steps, {r['exhaustive_s']:.1f} s",
        f"  verified / exhaustive = {ratio:.2f} (goal >= 0.90)",
        f"  peak at {r['verified']}: {r['peak_allocated_gib']:.2f} GiB allocated, {r['peak_reserved_gib']:.2f} GiB "
        f"reserved; model predicted {r['predicted_gib']:.2f} GiB (incl. 1 GiB context/workspace overhead)",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt2-small", help="jobspec model preset (default gpt2-small)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default 1024)")
    parser.add_argument("--per-rank-batch", type=int, default=360, help="samples per optimizer step (default 360)")
    parser.add_argument("--utilization", type=float, default=0.9, help="memory.target_utilization (default 0.9)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/sizing.py needs a CUDA or ROCm GPU (torch.cuda.is_available() is False): nothing measured",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(report(measure(args.preset, args.seq_len, args.per_rank_batch, args.utilization)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
