"""Packing without cross-contamination, measured: logits of packed records vs alone, and what the positions cost.

`python -m bench.packing [--preset llama-tiny] [--attention sdpa] [--rows 8] [--seq 512] [--repeats 5]` prints, for
rows of records packed to `seq` tokens (random record lengths 16..seq/2):
- the largest |logit| difference of every record in its packed row vs the same record alone, without per-record
  position ids (what packing did before: one causal row) and with them (the runner's packed step);
- the time of one training micro-step (forward, the runner's summed loss, backward) on the same packed batch
  without and with position ids, paired (alternating runs, medians), on this machine's device (CPU here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from jobspec.catalog.presets import PRESETS
from runner.data.dataset import SFTData, pack
from runner.data.tokens import StreamsBuilder
from runner.model.build import preset_config
from runner.train.loss import install_chunked_loss
from runner.train.step import summed_loss


def packed_data(vocab: int, rows: int, seq: int, seed: int = 0) -> tuple[SFTData, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    out, records = StreamsBuilder(vocab), []
    while len(records) < rows * seq // 16:
        n = int(rng.integers(16, seq // 2))
        ids = rng.integers(0, vocab, n)
        out.add(ids, np.arange(n) >= 4)
        records.append(ids)
    streams = out.build()
    packed = pack(streams, seq)
    return SFTData(packed, packed, pad_id=0, max_seq_len=seq), records


def logits_gap(model: torch.nn.Module, data: SFTData, records: list[np.ndarray], rows: int) -> tuple[float, float]:
    batch = data.collate(list(range(rows)))
    before = after = 0.0
    with torch.no_grad():
        plain = model(input_ids=batch.input_ids).logits
        positioned = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        for r in range(rows):
            start = 0
            for k in data.train.records[data.train.groups[r] : data.train.groups[r + 1]]:
                ids = torch.from_numpy(records[k][:-1])[None]
                alone = model(input_ids=ids).logits[0]
                n = ids.shape[1]
                before = max(before, float((plain[r, start : start + n] - alone).abs().max()))
                after = max(after, float((positioned[r, start : start + n] - alone).abs().max()))
                start += n + 1
    return before, after


def step_seconds(model: torch.nn.Module, head, batch, positions: bool) -> float:
    t = time.perf_counter()
    loss = summed_loss(model, head, batch.input_ids, batch.labels, batch.position_ids if positions else None)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def main() -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-tiny")
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = PRESETS[args.preset]
    model = AutoModelForCausalLM.from_config(preset_config(shape, 0, 1), attn_implementation=args.attention)
    model.config.use_cache = False  # as runner/model/build.py: a training forward has no KV cache
    data, records = packed_data(shape.vocab, args.rows, args.seq)
    before, after = logits_gap(model.eval(), data, records, args.rows)
    print(f"{args.preset} {args.attention}, {args.rows} rows of {args.seq} tokens packed from "
          f"{len(data.train.records)} records: max |logits packed - alone| without positions {before:.3g}, "
          f"with per-record positions {after:.3g}")  # fmt: skip
    model.train()
    head = install_chunked_loss(model, run=model, device=torch.device("cpu"))
    batch = data.collate(list(range(args.rows)))
    step_seconds(model, head, batch, False), step_seconds(model, head, batch, True)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for positions in (False, True):
            times[positions].append(step_seconds(model, head, batch, positions))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"micro-step (forward + loss + backward), medians of {args.repeats} paired runs: without positions "
          f"{off * 1e3:.0f} ms, with {on * 1e3:.0f} ms ({(on / off - 1) * 100:+.1f} %)")  # fmt: skip


if __name__ == "__main__":
    main()
