"""Streaming (runner/data/stream.py) against the prepared path on one generated .jsonl: tokens/s, resume cost, RSS.

    python bench/stream.py [RECORDS] [DIR]

Prints: tokens/s of the streamed path (reader thread, steps of 64 rows) and of the prepared path (`encode_file`
without the cache, then the rows), the cost of reaching a far sample on restart (from the position index; by reading
and dropping records), per 100k records.
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

from runner.data.dataset import load_data
from runner.data.records import read_records
from runner.data.stream import load_stream
from runner.data.tokenizer import ByteTokenizer
from tests.runner.train_helpers import tiny_spec


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    root = Path(sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp())
    path = root / "data.jsonl"
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"question {i} " + "x" * (i % 200), "response": f"answer {i} " + "y" * 90}))
            f.write("\n")
    g = 64
    spec = tiny_spec(root / "s", data={"path": str(path), "streaming": True, "max_seq_len": 512, "eval_fraction": 0},
                     training={"global_batch": g, "steps": 10})  # fmt: skip
    tok = ByteTokenizer()
    t0 = time.perf_counter()
    data = load_stream(spec, tok)
    steps = n // g
    tokens = sum(len(s.ids) for step in range(steps) for s in data.step_rows(step).values())
    stream_s = time.perf_counter() - t0
    data.close()
    print(f"streamed: {steps * g:,} samples, {tokens:,} tokens in {stream_s:.2f} s: {tokens / stream_s:,.0f} tokens/s")
    prep = tiny_spec(root / "p", data={"path": str(path), "max_seq_len": 512, "eval_fraction": 0, "cache_dir": None},
                     training={"global_batch": g, "steps": 10})  # fmt: skip
    t0 = time.perf_counter()
    rows = load_data(prep, tok).train
    ptok = int(rows.lengths.sum()) + len(rows)
    prep_s = time.perf_counter() - t0
    print(f"prepared (tokenize into the cache, all workers): {len(rows):,} rows, {ptok:,} tokens in {prep_s:.2f} s: "
          f"{ptok / prep_s:,.0f} tokens/s")  # fmt: skip
    far = (steps - 2) * g
    again = load_stream(spec, tok, write_index=False).streams[0]
    t0 = time.perf_counter()
    next(again.samples(far))
    index_s = time.perf_counter() - t0
    again.index.path = None
    t0 = time.perf_counter()
    next(again.samples(far))
    replay_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in itertools.islice(read_records(path, spec.data), n):
        pass
    read_s = time.perf_counter() - t0
    per = 100_000 / far
    print(f"restart at sample {far:,}: from the index {index_s * 1000:.0f} ms; replayed (tokenizing) {replay_s:.2f} s "
          f"= {replay_s * per:.2f} s per 100k; skip by reading and dropping .jsonl records {read_s / n * 1e5:.2f} s "
          "per 100k")  # fmt: skip


if __name__ == "__main__":
    main()
