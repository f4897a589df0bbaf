"""GRPO step time, the runner against TRL's GRPOTrainer, on the same model, prompts, reward and settings.

    python bench/grpo.py                      # CPU, fp32: a 4-layer Llama of 3.4M parameters, 3 rounds of 6 steps
    python bench/grpo.py --rounds 5 --steps 8 --hidden 512 --layers 8

Both sides start from the same weights (a Llama built from config, saved with the runner's byte tokenizer) and train
on the 16 text prompts of examples/objectives/prompts.jsonl (TRL's GRPOTrainer takes a batch of text prompts or of
chats, not both), rewarded by examples/objectives/rewards.py's `plain_words`. Both use 4
completions per prompt, 4 prompts a step (16 completions, one micro-batch, no accumulation), completions of at most
`--completion` tokens at temperature 1, beta 0, AdamW at a constant 1e-3 with no weight decay, clipping at 1.0, and
TRL's loss (dapo). Each round builds each side afresh (not timed), then times every step: the sampling, the rewards,
the forward and backward, and the optimizer step. TRL's step is timed by a callback from `on_step_begin` to
`on_step_end`; the runner's around `Recipe.train_step`. The sides take turns at going first. The figures: each
side's median step over the rounds' steady steps (the first of each round left out: warm-up), its CPU time per step
(this process's `time.process_time`), and its completion tokens per step, since a step's time grows with how long
the sampled completions are and the two sides' samplers draw differently.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "objectives"))

PROMPTS = ROOT / "examples" / "objectives" / "prompts.jsonl"
REWARDS = ROOT / "examples" / "objectives" / "rewards.py"


def save_prompts(path: Path) -> None:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if isinstance(r["prompt"], str)))


def save_model(path: Path, hidden: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from runner.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tok.PAD,
                         bos_token_id=tok.BOS, eos_token_id=tok.EOS)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.to_hf().save_pretrained(path)


def runner_round(model: Path, run: Path, args: argparse.Namespace) -> list[tuple[float, float, float]]:
    """(wall s, CPU s, completion tokens) of each of the round's steps."""
    from jobspec.spec.loader import parse_spec
    from runner.train.recipe import Recipe

    spec = parse_spec(yaml.safe_dump({
        "name": "bench-grpo",
        "model": {"path": str(model)},
        "data": {"path": str(model / "prompts.jsonl"), "max_seq_len": 64 + args.completion, "packing": False},
        "training": {"objective": "grpo", "global_batch": 4, "micro_batch": 4, "steps": args.steps,
                     "learning_rate": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0, "precision": "fp32",
                     "max_grad_norm": 1.0, "log_every": 10**6,
                     "grpo": {"num_generations": 4, "max_completion_length": args.completion,
                              "rewards": [{"kind": "python", "file": str(REWARDS), "function": "plain_words"}]}},
        "hardware": {"vendor": "cpu", "gpus": 1},
        "memory": {"tier": "fast"},
        "output": {"export": False},
        "checkpoints": {"dir": str(run), "every_steps": 10**6, "keep": 1},
    }))  # fmt: skip
    recipe = Recipe(spec)
    out = []
    try:
        recipe.setup()
        for step in range(args.steps):
            wall, cpu = time.perf_counter(), time.process_time()
            result = recipe.train_step(step)
            float(result.loss_sum)  # the step's work done
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            tokens = recipe.stepper.rollouts.metrics["completions/mean_length"] * 16
            out.append((wall, cpu, tokens))
    finally:
        recipe.cleanup()
    return out


def trl_round(model: Path, run: Path, args: argparse.Namespace) -> list[tuple[float, float, float]]:
    from datasets import load_dataset
    from rewards import plain_words  # examples/objectives/rewards.py
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    steps: list[tuple[float, float, float]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t = (time.perf_counter(), time.process_time())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            steps.append((time.perf_counter() - self.t[0], time.process_time() - self.t[1], 0.0))

    config = GRPOConfig(output_dir=str(run), per_device_train_batch_size=16, gradient_accumulation_steps=1,
                        num_generations=4, max_completion_length=args.completion, temperature=1.0, beta=0.0,
                        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                        max_grad_norm=1.0, max_steps=args.steps, logging_steps=1, save_strategy="no",
                        report_to=[], use_cpu=True, bf16=False, fp16=False, seed=42, disable_tqdm=True,
                        dataloader_num_workers=0)  # fmt: skip
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                          reward_funcs=[plain_words], args=config,
                          train_dataset=load_dataset("json", data_files=str(model / "prompts.jsonl"), split="train"),
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Timer()])  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # its dict a step on stderr
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return [(w, c, n * 16) for (w, c, _), n in zip(steps, lengths, strict=False)]


def summary(rows: list[tuple[float, float, float]]) -> dict[str, float]:
    return {"step_s": statistics.median(r[0] for r in rows), "cpu_s": statistics.median(r[1] for r in rows),
            "completion_tokens": statistics.median(r[2] for r in rows), "steps": len(rows)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--completion", type=int, default=32, help="max_completion_length")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_model(model, args.hidden, args.layers)
        save_prompts(model / "prompts.jsonl")
        sides = {"runner": runner_round, "trl": trl_round}
        steady: dict[str, list[tuple[float, float, float]]] = {name: [] for name in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                rows = sides[name](model, Path(tmp) / f"{name}-{r}", args)
                steady[name] += rows[1:]
                print(f"round {r + 1} {name}: " + ", ".join(f"{w:.3f}" for w, _, _ in rows) + " s a step",
                      file=sys.stderr)  # fmt: skip
    figures = {name: summary(rows) for name, rows in steady.items()}
    figures["runner_over_trl"] = figures["runner"]["step_s"] / figures["trl"]["step_s"]
    per_token = {n: figures[n]["step_s"] / max(figures[n]["completion_tokens"], 1.0) for n in sides}
    figures["runner_over_trl_per_completion_token"] = per_token["runner"] / per_token["trl"]
    figures["machine"] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                          "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
