"""The memory oracle against the formula: `trace_step` (runner/train/trace.py) vs `jobspec.plan.memory.estimate`.

    python -m bench.memory_model [--models qwen2.5-0.5b,llama-3.1-8b] [--tiers fast,zero3] [--ranks 1,8]
                                 [--micro-batches 1,4] [--seq-len 2048]

Prints one row per (model, tier, ranks, micro-batch): the trace's device peak and its parts, the formula's GPU
bytes (without its fixed 1 GiB overhead and 5 % fragmentation, which the trace does not model, and with
them), their ratio, and the trace's seconds and the process's peak RSS so far. Shapes are the public
config.json values (no download); `runner_loss` is how the runner's loss reaches the trace.
"""

from __future__ import annotations

import argparse
import resource
from typing import Any

from jobspec.plan import memory
from jobspec.plan.planner import shape_from_config
from runner.train.trace import runner_loss, trace_step

GIB = 2**30

# config.json fields of public checkpoints (hidden, intermediate, layers, heads, kv heads, vocab, tie)
MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=True),
    "smollm2-1.7b": dict(model_type="llama", vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                         tie_word_embeddings=True),
    "gemma-2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       tie_word_embeddings=True),
    "llama-3.2-3b": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         tie_word_embeddings=True),
    "phi-3-mini": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False),
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tiers", default="fast,zero2,zero2_offload,zero3,minimal")
    ap.add_argument("--ranks", default="1,8")
    ap.add_argument("--micro-batches", default="1,4")
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args(argv)
    cols = [("model", 14), ("tier", 13), ("N", 2), ("mb", 2), ("trace", 7), ("params", 6), ("grads", 6),
            ("optim", 6), ("acts", 6), ("temp", 6), ("host", 6), ("formula", 7), ("+ovh", 7), ("f/t", 5),
            ("secs", 5), ("rss", 5)]  # fmt: skip
    head = " ".join(f"{c:{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in enumerate(cols))
    print(head + "   (GiB; formula without / with its overhead; rss: process peak so far)")
    for name in args.models.split(","):
        cfg = MODELS[name]
        shape = shape_from_config(cfg)
        for tier in args.tiers.split(","):
            for ranks in map(int, args.ranks.split(",")):
                for mb in map(int, args.micro_batches.split(",")):
                    try:
                        r = trace_step(cfg, tier=tier, world_size=ranks, micro_batch=mb, seq_len=args.seq_len,
                                       loss=runner_loss)  # fmt: skip
                    except Exception as err:  # a model this transformers cannot build offline, sdpa + softcap...
                        print(f"{name:14} {tier:13} {ranks:>2} {mb:>2} trace failed: {type(err).__name__}: "
                              f"{str(err).splitlines()[0][:90]}")  # fmt: skip
                        continue
                    est = memory.estimate(shape, tier=tier, seq_len=args.seq_len, micro_batch=mb, world_size=ranks)
                    bare = est.states + est.activations + est.logits
                    p = r.parts
                    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
                    print(f"{name:14} {tier:13} {ranks:>2} {mb:>2} {r.peak / GIB:7.2f} {p['parameters'] / GIB:6.2f} "
                          f"{p['gradients'] / GIB:6.2f} {p['optimizer'] / GIB:6.2f} {p['activations'] / GIB:6.2f} "
                          f"{p['temporaries'] / GIB:6.2f} {r.host / GIB:6.2f} {bare / GIB:7.2f} "
                          f"{est.gpu_bytes / GIB:7.2f} {bare / max(r.peak, 1):5.2f} {r.seconds:5.1f} {rss:5.2f}",
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
