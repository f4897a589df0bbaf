"""Preparing the data: cold tokenizing vs `datasets.map`, a restart from the cache, resident memory, turns.

    python bench/data.py                    # 20k synthetic chats (~8M byte tokens), 2 rounds, both tokenizers
    python bench/data.py --quick            # 1,000 chats, 1 round (what the test runs)
    python bench/data.py --tokenizer hf --rounds 3

Generates the chats in a temp dir (2-16 turns, a third with a system prompt; about 400 byte tokens a chat) and
prints, for the byte tokenizer (the presets') and a transformers fast tokenizer built here (a byte-level BPE
trained on the bundled data, 1,000 ids, a ChatML template without generation blocks: reply masks by markers):

  cold       `encode_file` with a fresh cache dir (read, render, pack into Streams, write the cache), against
             `datasets.load_dataset("json")` + `.map(batched=True, num_proc=1)` rendering the same chats with the
             same tokenizer (ids and flags as lists: what a datasets pipeline would store). The two alternate,
             each round starting with the other side; medians of wall time, and CPU time beside it (this
             process and its finished children: the worker pool).
  restart    a fresh process: `encode_file` again on the same cache (check + map), wall seconds.
  memory     the same fresh process: RSS after the load and a pass over every record's ids and flags, minus
             RSS before, per token (what one rank holds; the pages are shared by the ranks of a node).
  turns      CPU time per token of `render_batch` over 64-turn chats vs 4-turn chats of the same total
             length, alternated, median of 5 (goal <= 1.5x).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobspec.spec.models import DataSpec  # noqa: E402
from runner.data.dataset import BUNDLED, encode_file, flatten  # noqa: E402
from runner.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer  # noqa: E402

WORDS = ["the", "a", "model", "data", "token", "cache", "rank", "restart", "quick", "brown", "fox", "jumps", "over",
         "lazy", "dog", "é", "✓", "42", "answer:", "add", "sum"]  # fmt: skip
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SEQ = 2048  # long enough that no chat is truncated


def chats(n: int, seed: int, turns: int | None = None, words: tuple[int, int] = (3, 18)) -> list[dict]:
    rng = np.random.default_rng(seed)
    vocab = np.array(WORDS)
    out = []
    for _ in range(n):
        t = turns or int(rng.choice([2, 4, 6, 8, 12, 16]))
        messages = [{"role": "system", "content": "You are helpful."}] if turns is None and rng.random() < 0.3 else []
        for k in range(t):
            text = " ".join(rng.choice(vocab, int(rng.integers(*words))))
            messages.append({"role": "user" if k % 2 == 0 else "assistant", "content": text})
        out.append({"messages": messages})
    return out


def write(path: Path, records: list[dict]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def hf_tokenizer(folder: Path) -> HFTokenizer:
    """A byte-level BPE trained here (nothing downloaded) with a ChatML template."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", "<|pad|>", "<|bos|>"]
    bpe = Raw(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator([*BUNDLED.read_text().splitlines()[:2000], *WORDS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|bos|>", eos_token="<|im_end|>",
                                   pad_token="<|pad|>")  # fmt: skip
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return HFTokenizer(AutoTokenizer.from_pretrained(folder), str(folder))


def cpu_s() -> float:
    """CPU seconds of this process and its finished children (the pool's workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), cpu_s()
    fn()
    return time.perf_counter() - wall, cpu_s() - cpu


def ours(source: Path, tok: Tokenizer, work: Path) -> None:
    encode_file(source, DataSpec(max_seq_len=SEQ), tok, cache_dir=Path(tempfile.mkdtemp(dir=work)))


def with_datasets(source: Path, tok: Tokenizer, work: Path) -> None:
    import datasets

    datasets.disable_progress_bars()

    def render(batch: dict) -> dict:
        out = [flatten(tok.render(m), SEQ + 1) for m in batch["messages"]]
        return {"ids": [i.tolist() for i, _ in out], "flags": [f.tolist() for _, f in out]}

    cache = tempfile.mkdtemp(dir=work)
    data = datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=cache)
    data.map(render, batched=True, num_proc=1, remove_columns=data.column_names)


RESTART = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import numpy as np
from jobspec.spec.models import DataSpec
from runner.data.dataset import encode_file
from runner.data.tokenizer import ByteTokenizer, HFTokenizer
if sys.argv[4] == "bytes":
    tok = ByteTokenizer()
else:
    from transformers import AutoTokenizer
    tok = HFTokenizer(AutoTokenizer.from_pretrained(sys.argv[4]), sys.argv[4])
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = rss()
start = time.perf_counter()
streams = encode_file(sys.argv[2], DataSpec(max_seq_len=2048), tok, cache_dir=Path(sys.argv[3]))
seconds = time.perf_counter() - start
touched = sum(int(streams[k][1].sum()) for k in range(0, len(streams)))  # every record's ids and flags
arrays = sum(getattr(streams, a).nbytes for a in ("ids", "flags", "bounds", "trainable"))
print(json.dumps({"seconds": seconds, "bytes": rss() - before, "tokens": len(streams.ids), "arrays": arrays}))
"""


def restart(source: Path, tok: Tokenizer, tok_arg: str, work: Path) -> dict:
    cache = Path(tempfile.mkdtemp(dir=work))
    encode_file(source, DataSpec(max_seq_len=SEQ), tok, cache_dir=cache)
    done = subprocess.run([sys.executable, "-c", RESTART, str(ROOT), str(source), str(cache), tok_arg],
                          capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_token(tok: Tokenizer, sample: list[list[dict]]) -> float:
    """CPU seconds per token of rendering `sample`."""
    start = time.process_time()
    tokens = sum(len(ids) for ids, _ in tok.render_batch(sample))  # type: ignore[attr-defined]
    return (time.process_time() - start) / tokens


def turns(tok: Tokenizer, tokens: int, rounds: int = 5) -> tuple[float, float]:
    """Per-token CPU cost of 4-turn and 64-turn chats of about `tokens` tokens in all."""
    short = [c["messages"] for c in chats(max(1, tokens // 320), seed=1, turns=4)]
    long = [c["messages"] for c in chats(max(1, tokens // 5100), seed=2, turns=64)]
    a, b = [], []
    for r in range(rounds):
        for side in ((a, short), (b, long)) if r % 2 == 0 else ((b, long), (a, short)):
            side[0].append(per_token(tok, side[1]))
    return statistics.median(a), statistics.median(b)


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())  # fmt: skip
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores, Python {platform.python_version()}, {datetime.date.today().isoformat()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokenizer", choices=["bytes", "hf", "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="1,000 chats, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.chats, args.rounds = 1000, 1
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = write(work / "chats.jsonl", chats(args.chats, seed=0))
        print(f"data: {args.chats} chats, {source.stat().st_size / 1e6:.1f} MB of JSON lines")
        kinds = ["bytes", "hf"] if args.tokenizer == "both" else [args.tokenizer]
        for kind in kinds:
            tok: Tokenizer = ByteTokenizer() if kind == "bytes" else hf_tokenizer(work / "tok")
            tok_arg = "bytes" if kind == "bytes" else str(work / "tok")
            sides = {"ours": [], "datasets.map": []}
            for r in range(args.rounds):
                order = ["ours", "datasets.map"] if r % 2 == 0 else ["datasets.map", "ours"]
                for name in order:
                    fn = ours if name == "ours" else with_datasets
                    sides[name].append(timed(lambda fn=fn, tok=tok: fn(source, tok, work)))
            print(f"\n[{kind} tokenizer]")
            for name, runs in sides.items():
                wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
                print(f"  cold {name:13s} {wall:7.2f} s wall  {cpu:7.2f} s CPU   (runs: "
                      + ", ".join(f"{w:.2f}" for w, _ in runs) + ")")  # fmt: skip
            ratio = statistics.median(w for w, _ in sides["ours"]) / statistics.median(
                w for w, _ in sides["datasets.map"]
            )
            print(f"  cold ours / datasets.map     {ratio:.2f}x wall (goal <= 1)")
            again = restart(source, tok, tok_arg, work)
            print(f"  restart (fresh process, from the cache)  {again['seconds']:.2f} s for {again['tokens']:,} "
                  "tokens (goal < 5 s)")  # fmt: skip
            print(f"  resident per token after touching every record  {again['bytes'] / again['tokens']:.2f} B "
                  f"(goal < 4; {again['bytes'] / 2**20:.1f} MiB, of which the mapped arrays "
                  f"{again['arrays'] / 2**20:.1f} MiB)")  # fmt: skip
            four, sixty_four = turns(tok, 50_000 if args.quick else 400_000)
            print(f"  turns: 4-turn {four * 1e9:.0f} ns/token, 64-turn {sixty_four * 1e9:.0f} ns/token: "
                  f"{sixty_four / four:.2f}x (goal <= 1.5)")  # fmt: skip


if __name__ == "__main__":
    main()
