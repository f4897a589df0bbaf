"""Generate the bundled synthetic SFT set: `python runner/data/make_sft.py` rewrites sft_synthetic.jsonl.

Deterministic (fixed seed, no third-party imports), so the file in the repository is exactly what this
script writes. Four short tasks that a 2-layer byte-level model visibly learns in a few hundred steps:
reverse a word, uppercase a word, add two numbers below 100, and look a key up in a small table. Words
are made-up syllable strings so that no task can be solved by memorising English; no record repeats.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 1234
RECORDS = 4000
OUT = Path(__file__).with_name("sft_synthetic.jsonl")
SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "ve", "zu", "bo", "da", "fi", "ge", "ju", "ny"]
KEYS = ["a", "b", "c", "d", "e", "f", "g", "h"]


def word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def record(rng: random.Random) -> dict[str, str]:
    task = rng.choice(["reverse", "upper", "add", "lookup"])
    if task == "reverse":
        w = word(rng)
        return {"prompt": f"reverse: {w}", "response": w[::-1]}
    if task == "upper":
        w = word(rng)
        return {"prompt": f"upper: {w}", "response": w.upper()}
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"prompt": f"add: {a}+{b}", "response": str(a + b)}
    keys = rng.sample(KEYS, 3)
    table = {k: str(rng.randint(0, 9)) for k in keys}
    key = rng.choice(keys)
    pairs = " ".join(f"{k}={v}" for k, v in table.items())
    return {"prompt": f"lookup {key} in {pairs}", "response": table[key]}


def main() -> None:
    rng = random.Random(SEED)
    lines: dict[str, None] = {}  # insertion-ordered set: no record twice, so the eval split is unseen data
    while len(lines) < RECORDS:
        lines[json.dumps(record(rng), separators=(",", ":"))] = None
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} records to {OUT}")


if __name__ == "__main__":
    main()
