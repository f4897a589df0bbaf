"""Training speed side by side: the runner, a careful plain PyTorch loop and Hugging Face `Trainer`, on the same
model, tokens, sequence length, global batch, micro-batch and precision, in one process, rounds interleaved.

    python -m bench.throughput --smoke                   # CPU: the tiny preset, seq 128, fp32 (CI's mode)
    python -m bench.throughput                           # a GPU: gpt2-small seq 1024 and llama-1b seq 2048, bf16
    python -m bench.throughput --rows llama-1b --rounds 4 --json out.json
    python -m bench.throughput --rows llama-1b --compile blocks   # every side compiled (issue 42)
    python -m bench.throughput --rows llama-1b --block-kernels liger   # Liger's RMSNorm, SwiGLU, RoPE on every side

Sides (each its own model, built from the same preset config and seed; each trains the same optimizer steps' samples):
  runner   `Recipe.train_step`, the code path `jobspec run` takes (OOM guard, stop/OOM agreement, prefetching
           loader, chunked loss head, update transaction), micro-batch fixed to the row's so all sides match.
  plain    bench/overhead.py's `Plain`: forward under autocast (bf16 on a GPU), full logits upcast and token-summed
           cross-entropy, backward, clip_grad_norm_, fused AdamW, zero_grad; its batches (the runner's own collate)
           are made outside its timer: a strict baseline.
  trainer  `transformers.Trainer` with its usual fast settings: bf16 on a GPU, SDPA, `adamw_torch_fused`, clipping,
           constant LR, no logging, checkpoints or evaluation, the samples in the runner's order (sequential
           sampler). Collator: `DataCollatorWithFlattening` (padding-free) with a varlen flash kernel where one is
           installed; with SDPA the rows are stacked as they are (they are full, so there is no padding to remove,
           and flattening under SDPA would build a (B*T)^2 mask).
How the rounds interleave: Trainer's loop runs once for all rounds; a callback at each round's end stops its clock and
runs one round of the runner and one of the plain loop (which goes first alternates), then restarts the clock. Round 0
of each side is a warm-up, dropped. Synchronised before every clock read.

Reported per side: tokens/s (input tokens, padding excluded; rows are full), MFU = tokens/s x FLOPs/token / dense
bf16 peak with FLOPs/token = 6N + 6*L*C*T (llm.c; N all parameters, L layers, C hidden, T row length; recomputation
not counted), peak allocated device memory in the side's rounds (all three models resident: the weights and optimizer
states of the other two are in it) and its rise over the round's start (what the side's steps add), wall and CPU
seconds per step (CPU: this process and its loader workers); medians over rounds, and runner/plain and
runner/trainer ratios (of medians, and the median of the per-round ratios).
Also called by the GPU proof's throughput part (bench/gpu/throughput.py) for issue 42's rows (llama-1b full
fine-tuning, then `llama-8b-lora`: rank 16 on every projection of Llama 3.1 8B's shape) at the defaults, with part of
that part's budget: rounds, and rows, that would not end inside it are not started (`measure_rows`). Run alone for
the variants (`--compile`, `--block-kernels`) and gpt2-small, `--budget-s` bounding the call.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.gpu.common import Budget, cpu_seconds, median, recipe_for, spec_for, sync, write_data
from bench.gpu.device import flops_per_token, mfu

SIDES = ("runner", "plain", "trainer")


@dataclass(frozen=True)
class Row:
    preset: str
    seq: int
    global_batch: int
    micro_batch: int
    lora: tuple[str, ...] = ()  # adapted projections (rank LORA_RANK); () full fine-tuning


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 16


GPU_ROWS = {  # gpt2-small: the 2026-11-28 record's shape (continuity); llama-1b: issue 42's full fine-tuning row
    "gpt2-small": Row("gpt2-small", 1024, 32, 32),
    "llama-1b": Row("llama-1b", 2048, 16, 4),
    "llama-8b-lora": Row("llama-8b", 2048, 16, 2, ALL_PROJECTIONS),  # issue 42's LoRA row: Llama 3.1 8B's shape
}
CPU_ROWS = {"tiny": Row("tiny", 128, 16, 16), "llama-tiny": Row("llama-tiny", 128, 16, 16),
            "llama-tiny-lora": Row("llama-tiny", 128, 16, 16, ALL_PROJECTIONS)}  # --smoke: tiny  # fmt: skip


def named_row(name: str, device: str) -> Row:
    """A row by name: of GPU_ROWS on a GPU (`device` cuda), of CPU_ROWS on the CPU."""
    rows = GPU_ROWS if device == "cuda" else CPU_ROWS
    if name not in rows:
        raise ValueError(f"no {device} row {name!r}: the rows are {', '.join(rows)}")
    return rows[name]


def _peak_reset() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _allocated() -> int | None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return None


def _memory(start: int | None) -> dict[str, int | None]:
    """Peak allocated bytes since the last reset (all three models' weights and optimizer states are resident), and
    its rise over `start` (allocated when the side's round began: what the side's steps add at their peak)."""
    import torch

    if start is None:
        return {"peak_bytes": None, "rise_bytes": None}
    peak = int(torch.cuda.max_memory_allocated())
    return {"peak_bytes": peak, "rise_bytes": peak - start}


def _hf_rows(batches: list[Any]) -> list[dict[str, Any]]:
    """The runner's collated rows as a causal LM dataset: input_ids as they are; labels unshifted (the model shifts),
    -100 where the runner's shifted labels ignore the next token (the prompt) and at position 0."""
    from runner.data.dataset import IGNORE

    out = []
    for b in batches:
        for ids, shifted in zip(b.input_ids, b.labels, strict=True):
            labels = ids.clone()
            labels[0] = -100
            labels[1:][shifted[:-1] == IGNORE] = -100
            out.append({"input_ids": ids, "labels": labels})
    return out


def _collator() -> tuple[Any, str, str]:
    """(collator, its name, attention kernel) for the Trainer side (see the module docstring)."""
    import importlib.util

    import torch
    from transformers import DataCollatorWithFlattening, default_data_collator

    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return DataCollatorWithFlattening(), "DataCollatorWithFlattening", "flash_attention_2"

    def stack(features: list[dict[str, Any]]) -> dict[str, Any]:
        return default_data_collator(features)

    return stack, "default_data_collator (full rows, no padding)", "sdpa"


def row_spec(row: Row, device: str, run_dir: Path, data: Path, precision: str | None = None,
             compile_scope: str = "off", block_kernels: str = "plain"):  # -> JobSpec  # fmt: skip
    """The runner side's spec of `row` (tier fast, the row's micro-batch fixed), validated: `precision` fp32 | bf16
    (default bf16 on a GPU, fp32 on the CPU), `compile_scope` and `block_kernels` as in `measure`."""
    cfg = SimpleNamespace(seq=row.seq, precision=precision or ("bf16" if device == "cuda" else "fp32"), device=device)
    lora = {"rank": LORA_RANK, "alpha": 2 * LORA_RANK, "targets": list(row.lora)} if row.lora else None
    spec = spec_for(cfg, run_dir, data, preset=row.preset, tier="fast", global_batch=row.global_batch,
                    micro_batch=row.micro_batch, utilization=0.5, lora=lora)  # fmt: skip
    update = {"compile": compile_scope, "block_kernels": block_kernels}
    return spec.model_copy(update={"training": spec.training.model_copy(update=update)})


def measure(row: Row, device: str, rounds: int, steps: int, budget: Budget | None = None,
            peak_tflops: float | None = None, work: Path | None = None,
            precision: str | None = None, compile_scope: str = "off",
            block_kernels: str = "plain") -> dict[str, Any]:  # fmt: skip
    """One row: `rounds` measured rounds (after a warm-up round) of `steps` optimizer steps per side; `precision`
    fp32 | bf16 (default bf16 on a GPU, fp32 on the CPU); `compile_scope` off | blocks | model: the runner's
    `training.compile`, the plain loop's model compiled the same way (runner.train.engine.compile_model) and
    Trainer's `torch_compile` (the whole model: Trainer has no regional switch). The warm-up round compiles.
    `block_kernels` plain | liger: the runner's `training.block_kernels`, Liger's blocks in the plain loop's model
    (runner.model.build.liger_blocks) and Trainer's `use_liger_kernel` with the same three kernels (its loss stays)."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from bench.overhead import Plain

    with tempfile.TemporaryDirectory() as tmp:
        base = work or Path(tmp)
        total = (rounds + 1) * steps
        data = write_data(base / "data.jsonl", rows=row.global_batch * total + 64, seq=row.seq)
        spec = row_spec(row, device, base / "runner", data, precision, compile_scope, block_kernels)
        precision = spec.training.precision
        with recipe_for(spec) as recipe:
            plain, plan = Plain(recipe), recipe.plan
            trainable = _trainable(recipe)
            if block_kernels == "liger":
                from runner.model.build import liger_blocks

                liger_blocks(plain.model, device)
            if compile_scope != "off":
                from runner.train.engine import compile_model

                compile_model(plain.model, compile_scope)
            step_batches = [plain.batches(s) for s in range(total)]
            collate, collator_name, attn = _collator()
            hf_model = plain_twin(recipe, attn)
            per_round: list[dict[str, Any]] = []
            clock: dict[str, float] = {}

            def timed(fn: Any) -> dict[str, Any]:
                sync()
                _peak_reset()
                start, w0, c0 = _allocated(), time.perf_counter(), cpu_seconds()
                tokens = fn()
                sync()
                wall, cpu = time.perf_counter() - w0, cpu_seconds() - c0
                return {"wall_s": round(wall, 5), "cpu_s": round(cpu, 5), "tokens": tokens,
                        "tokens_per_s": round(tokens / wall, 1), **_memory(start)}  # fmt: skip

            def tokens_of(r: int) -> int:
                return sum(b.tokens for s in range(r * steps, (r + 1) * steps) for b in step_batches[s])

            def others(r: int) -> dict[str, Any]:
                span = range(r * steps, (r + 1) * steps)

                def runner_side() -> int:
                    return sum(recipe.train_step(s).tokens for s in span)

                def plain_side() -> int:
                    for s in span:
                        plain.step(step_batches[s])
                    return tokens_of(r)

                order = [("runner", runner_side), ("plain", plain_side)]
                order = order if r % 2 == 0 else order[::-1]
                return {"first": order[0][0], **{name: timed(fn) for name, fn in order}}

            class Interleave(TrainerCallback):
                """At each round's end: the Trainer's clock stops, the other sides run one round, the clock restarts."""

                def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                    sync()
                    _peak_reset()
                    clock.update(m=_allocated(), w=time.perf_counter(), c=cpu_seconds())

                def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                    if state.global_step % steps:
                        return
                    sync()
                    wall, cpu = time.perf_counter() - clock["w"], cpu_seconds() - clock["c"]
                    r = state.global_step // steps - 1
                    tokens = tokens_of(r)
                    mine = {"wall_s": round(wall, 5), "cpu_s": round(cpu, 5), "tokens": tokens,
                            "tokens_per_s": round(tokens / wall, 1), **_memory(clock["m"])}  # fmt: skip
                    t0 = time.perf_counter()
                    res = others(r)
                    took = time.perf_counter() - t0 + wall
                    per_round.append({"round": r, **res, "trainer": mine})
                    if r + 1 < rounds + 1 and budget is not None and r >= 1 and not budget.fits(took):
                        control.should_training_stop = True
                    sync()
                    _peak_reset()
                    clock.update(m=_allocated(), w=time.perf_counter(), c=cpu_seconds())

            class InOrder(Trainer):
                def _get_train_sampler(self, train_dataset: Any = None) -> Any:
                    return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

            gpu = device == "cuda"
            liger = {"use_liger_kernel": True, "liger_kernel_config": {
                "rms_norm": True, "swiglu": True, "rope": True, "cross_entropy": False,
                "fused_linear_cross_entropy": False}} if block_kernels == "liger" else {}  # fmt: skip
            args = TrainingArguments(
                output_dir=str(base / "trainer"), per_device_train_batch_size=plan.micro_batch,
                gradient_accumulation_steps=plan.grad_accum, max_steps=total, learning_rate=1e-4,
                lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
                max_grad_norm=recipe.spec.training.max_grad_norm, bf16=precision == "bf16", optim="adamw_torch_fused",
                logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
                dataloader_num_workers=0, dataloader_pin_memory=gpu, use_cpu=not gpu, seed=0,
                torch_compile=compile_scope != "off", **liger,
            )  # fmt: skip
            trainer = InOrder(model=hf_model, args=args, train_dataset=_hf_rows([b for bs in step_batches for b in bs]),
                              data_collator=collate, callbacks=[Interleave()])  # fmt: skip
            trainer.train()
            plain.model = plain.opt = None
            del trainer, hf_model
    fpt = flops_per_token(row.preset, row.seq, trainable=trainable if row.lora else None)
    measured = [x for x in per_round if x["round"] >= 1]  # round 0 warms caches, the allocator and kernels
    out: dict[str, Any] = {
        "preset": row.preset, "lora": list(row.lora), "seq_len": row.seq, "precision": plan.precision,
        "micro_batch": plan.micro_batch,
        "grad_accum": plan.grad_accum, "global_batch": plan.global_batch, "steps_per_round": steps,
        "rounds": len(measured), "flops_per_token": fpt,
        "flops_formula": "4N + 2T_lora + 6*L*C*T (a frozen base takes no weight gradients)" if row.lora
        else "6N + 6*L*C*T (llm.c)",
        "trainer_collator": collator_name, "trainer_attention": attn, "loss_kernel": recipe.spec.training.loss_kernel,
        "compile": compile_scope, "block_kernels": block_kernels,
    }  # fmt: skip
    for side in SIDES:
        tps = median([x[side]["tokens_per_s"] for x in measured])
        peaks = [x[side]["peak_bytes"] for x in measured if x[side]["peak_bytes"] is not None]
        rises = [x[side]["rise_bytes"] for x in measured if x[side]["rise_bytes"] is not None]
        out[side] = {
            "median_tokens_per_s": tps,
            "median_wall_s_per_step": _r(median([x[side]["wall_s"] / steps for x in measured])),
            "median_cpu_s_per_step": _r(median([x[side]["cpu_s"] / steps for x in measured])),
            "peak_bytes": max(peaks) if peaks else None,
            "rise_bytes": max(rises) if rises else None,
            "mfu": _r(mfu(tps, fpt, peak_tflops)),
        }
    for other in ("plain", "trainer"):
        a, b = out["runner"]["median_tokens_per_s"], out[other]["median_tokens_per_s"]
        out[f"runner_over_{other}"] = _r(a / b) if a and b else None
        out[f"runner_over_{other}_paired"] = _r(median(
            [x["runner"]["tokens_per_s"] / x[other]["tokens_per_s"] for x in measured]))  # fmt: skip
    out["per_round"] = per_round
    return out


def step_flops(row: Row) -> int:
    """One optimizer step's model FLOPs (FLOPs/token as `measure` counts them, a LoRA row's base at 4N, times the
    step's tokens): what a row's seconds scale with, set-up included (its models' sizes scale alike)."""
    return flops_per_token(row.preset, row.seq, trainable=0 if row.lora else None) * row.global_batch * row.seq


def measure_rows(names: list[str], device: str, rounds: int, steps: int, budget: Budget | None = None,
                 peak_tflops: float | None = None, work: Path | None = None, first_s: float = 12.0,
                 on_row: Callable[[list[dict[str, Any]]], None] | None = None,
                 **variant: Any) -> list[dict[str, Any]]:  # fmt: skip
    """`measure` for each named row in turn (`named_row`), each result with its "row" name and "seconds"; `variant`:
    precision, compile_scope, block_kernels. With `budget`, a row is not started unless what it is expected to take is
    left: `first_s` for the first, then the last measured row's seconds scaled by `step_flops` (`first_s` at least).
    A row not started, or failed, is {"row", "status"}: a finding, not the end of the others. `on_row` gets the
    results so far after each row (a caller that saves as it goes keeps them if it is cut off later)."""
    out: list[dict[str, Any]] = []
    last: tuple[float, Row, str] | None = None  # the last measured row's seconds, row and name
    for name in names:
        row = named_row(name, device)
        expected, why = first_s, f"{first_s:.0f} s for a first row"
        if last is not None:
            scale = step_flops(row) / step_flops(last[1])
            expected, why = max(first_s, last[0] * scale), f"{last[2]}'s {last[0]:.1f} s x {scale:.2f}, by FLOPs a step"
        if budget is not None and not budget.fits(expected):
            out.append({"row": name, "status": f"skipped: would not end inside the time budget ({budget.left():.0f} s "
                        f"left of {budget.seconds:.0f} s, expected {expected:.0f} s: {why})"})  # fmt: skip
        else:
            t0 = time.perf_counter()
            try:
                res = measure(row, device, rounds, steps, budget, peak_tflops,
                              work=None if work is None else work / name, **variant)  # fmt: skip
                took = time.perf_counter() - t0
                out.append({"row": name, "seconds": round(took, 1), **res})
                last = (took, row, name)
            except Exception as err:
                out.append({"row": name, "status": f"error: {type(err).__name__}: {err}"[:500]})
        if on_row is not None:
            on_row(out)
    return out


def _trainable(recipe: Any) -> int:
    return sum(p.numel() for p in recipe.model.parameters() if p.requires_grad)


def plain_twin(recipe: Any, attn: str) -> Any:
    """Another twin of the runner's model (same preset, config, seed, LoRA and frozen base width) on its device, for
    the Trainer."""
    from runner.model.build import build_model

    gpu = recipe.device.type == "cuda"  # built where it trains: llama-1b on the host took ~30 s (issue 41)
    model = build_model(recipe.spec, bos=257, eos=258, vocab=262, device=recipe.device if gpu else None,
                        precision=recipe.plan.precision)  # fmt: skip
    model.set_attn_implementation(attn)
    return model.to(recipe.device).train()


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| row | side | tokens/s | MFU | peak / rise GiB | wall s/step | CPU s/step | runner / side (median, "
             "paired) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for res in results:
        lora = " LoRA" if res.get("lora") else ""
        name = (f"{res['preset']}{lora} seq {res['seq_len']} {res['precision']} "
                f"{res['micro_batch']}x{res['grad_accum']}")  # fmt: skip
        for side in SIDES:
            s = res[side]
            ratio = "" if side == "runner" else f"{res[f'runner_over_{side}']} / {res[f'runner_over_{side}_paired']}"
            peak = f"{s['peak_bytes'] / 2**30:.2f} / {s['rise_bytes'] / 2**30:.2f}" if s["peak_bytes"] else "n/a"
            mfu_s = f"{s['mfu']:.1%}" if s["mfu"] is not None else "n/a"
            lines.append(f"| {name} | {side} | {s['median_tokens_per_s']:,.0f} | {mfu_s} | {peak} | "
                         f"{s['median_wall_s_per_step']} | {s['median_cpu_s_per_step']} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny preset (CI)")
    parser.add_argument("--rows", default=None, help=f"GPU rows, of {', '.join(GPU_ROWS)} (default all); CPU rows, "
                        f"of {', '.join(CPU_ROWS)} (default tiny)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds per row (after a warm-up round)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per side per round")
    parser.add_argument("--budget-s", type=float, default=None, help="no round started that would end after it")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="default: bf16 GPU, fp32 CPU")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: the GPU's)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    parser.add_argument("--compile", choices=["off", "blocks", "model"], default="off",
                        help="torch.compile on every side: the runner's training.compile, the plain loop's model the "
                        "same way, Trainer's torch_compile (default off)")  # fmt: skip
    parser.add_argument("--block-kernels", choices=["plain", "liger"], default="plain",
                        help="Liger's RMSNorm, SwiGLU and RoPE on every side: the runner's training.block_kernels, the "
                        "plain loop's model the same way, Trainer's use_liger_kernel (default plain)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    gpu = torch.cuda.is_available() and not args.smoke
    where = "cuda" if gpu else "cpu"
    names = (args.rows or (",".join(GPU_ROWS) if gpu else "tiny")).split(",")
    for name in names:
        try:
            named_row(name, where)  # an unknown row fails before any is measured
        except ValueError as err:
            parser.error(f"--rows: {err}")
    rounds, steps = args.rounds or (4 if gpu else 5), args.steps or (3 if gpu else 4)
    peak = args.peak_tflops
    if gpu and peak is None:
        from bench.gpu.device import DENSE_BF16_TFLOPS

        name = torch.cuda.get_device_name()
        peak = next((t for key, t in DENSE_BF16_TFLOPS if key.lower() in name.lower()), None)
    budget = Budget(args.budget_s) if args.budget_s else None
    results = measure_rows(names, where, rounds, steps, budget, peak, precision=args.precision,
                           compile_scope=args.compile, block_kernels=args.block_kernels)  # fmt: skip
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {torch.get_num_threads()} threads, "
          f"{torch.cuda.get_device_name() if gpu else 'CPU'}, torch {torch.__version__}")  # fmt: skip
    print(table([r for r in results if "status" not in r]))
    for r in results:
        if "status" in r:
            print(f"{r['row']}: {r['status']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
