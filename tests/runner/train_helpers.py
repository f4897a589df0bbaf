"""Helpers for the training tests: a tiny CPU spec, in-process and subprocess runs, metrics, test data.

Real training everywhere (tiny preset, short sequences, few steps); only the GPU probe is ever faked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from runner.data import BUNDLED

ROOT = Path(__file__).resolve().parents[2]


def tiny_spec_dict(run_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A CPU spec that trains in a second or two: tiny preset, seq 64, global batch 8, fp32."""
    spec: dict[str, Any] = {
        "name": "runner-test",
        "model": {"preset": "tiny"},
        "data": {"max_seq_len": 64},
        "training": {
            "global_batch": 8,
            "learning_rate": 3e-3,
            "warmup_steps": 2,
            "steps": 8,
            "precision": "fp32",
            "log_every": 1,
        },
        "hardware": {"vendor": "cpu", "gpus": 1},
        "memory": {"tier": "fast"},
        "checkpoints": {"dir": str(run_dir), "every_steps": 4, "keep": 5},
    }
    for section, values in sections.items():
        spec[section] = {**spec.get(section, {}), **values}
    return spec


def tiny_spec(run_dir: Path, **sections: dict[str, Any]):  # -> JobSpec
    from jobspec.loader import parse_spec

    return parse_spec(yaml.safe_dump(tiny_spec_dict(run_dir, **sections)))


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def train_in_process(spec, keep_worker: bool = False):
    """Run one Recipe (rank 0 of 1) in this process; returns (exit code, worker)."""
    from runner.recipe import Recipe

    worker = Recipe(spec)
    try:
        worker.setup()
        code = worker.train()
    finally:
        worker.cleanup()
    return code, worker


def records(run_dir: Path, kind: str = "train") -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("kind") == kind]


def runner_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("JOBSPEC_FAULT_OOM", None)  # fault injection only when a test passes it in `extra`
    return {**env, **extra}


def run_supervisor(args: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        cwd=ROOT,
        env=runner_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "ok"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_test_tokenizer(path: Path) -> None:
    """A small byte-level BPE tokenizer with a chat template, trained here (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(BUNDLED.read_text().splitlines()[:300], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
