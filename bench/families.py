"""The family matrix: formula vs trace at each family's published shape, every tier (jobspec/catalog/families.py).

`CONFIGS` (bench/families.json) holds config.json contents at the published shapes (the keys and values of the
models' own config.json files on the Hugging Face hub, written down here: nothing is downloaded); transformers
builds each from its own config class. `tiny(name)` is the same family shrunk to 2 layers for CPU training
(tests/runner/model/test_families.py trains and exports each, full and LoRA). `main` traces the runner's step on
FakeTensors (runner/train/trace.py) at every tier and prints the memory model's bytes beside it:

    python -m bench.families                      # every family, every tier, 8 ranks, micro-batch 1, 2048 tokens
    python -m bench.families --models mixtral-8x7b,gemma-2-2b --tiers fast,zero3 --ranks 8 --micro-batch 2

`ratio` is formula / trace, both without the fixed 1 GiB and 5 % overhead the plan adds on top of the formula.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

from jobspec.catalog.families import FAMILIES
from jobspec.catalog.model_config import shape_from_config
from jobspec.catalog.tiers import TIERS
from jobspec.plan import memory

GIB = 1024**3
# config.json contents at the published shapes, keyed by a short model name (bench/families.json)
CONFIGS: dict[str, dict[str, Any]] = json.loads((Path(__file__).with_name("families.json")).read_text())


def tiny(name: str, vocab: int = 512) -> dict[str, Any]:
    """`CONFIGS[name]` shrunk to 2 layers of width 64 (CPU training in seconds): the family's own keys, its experts
    (4, top 2), latent attention, soft cap and scale kept; head counts and widths scaled down."""
    return _shrunk(dict(CONFIGS[name]), vocab)


def _shrunk(cfg: dict[str, Any], vocab: int) -> dict[str, Any]:
    """`tiny`'s work on one config; a multimodal one's text model shrunk so, its vision tower to one layer of 32."""
    if "text_config" in cfg:
        vision = {**cfg["vision_config"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
        for key in ("vision_output_dim", "projector_input_dim", "projector_output_dim"):  # Llama 4's projector
            if key in vision:
                vision[key] = 64
        text = _shrunk({**dict(FAMILIES[cfg["model_type"]].text_defaults), **cfg["text_config"]}, vocab)
        return {**cfg, "text_config": text, "vision_config": vision, "mm_tokens_per_image": 4,
                "image_token_index": vocab - 2, "boi_token_index": 2, "eoi_token_index": 3,
                "pad_token_id": vocab - 1, "bos_token_id": 0, "eos_token_id": 1}  # fmt: skip
    if cfg["model_type"] == "gpt2":
        cfg.update(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=512, bos_token_id=0, eos_token_id=1)
        return cfg
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    small_heads = 4
    cfg.update(num_hidden_layers=2, hidden_size=64, num_attention_heads=small_heads,
               num_key_value_heads=max(1, small_heads * kv // heads), intermediate_size=128, vocab_size=vocab,
               max_position_embeddings=512)  # fmt: skip
    if "head_dim" in cfg:
        cfg["head_dim"] = 16
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in cfg:
            cfg[key] = 32 if key == "moe_intermediate_size" else 64
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if key in cfg:
            cfg[key] = 4
    if "num_experts_per_tok" in cfg:
        cfg["num_experts_per_tok"] = 2
    if cfg.get("kv_lora_rank"):
        cfg.update(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    if cfg.get("q_lora_rank"):
        cfg["q_lora_rank"] = 32
    if cfg.get("first_k_dense_replace"):  # one dense layer, one mixture of experts
        cfg["first_k_dense_replace"] = 1
    if (cfg.get("n_group") or 1) > 1:  # group-limited routing kept: 2 groups of 2 experts, the best group's top 2
        cfg.update(n_group=2, topk_group=1)
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = 32
    if "linear_num_key_heads" in cfg:  # Qwen3-Next: one linear-attention layer and one full, 2 key heads of 4 values
        cfg.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   full_attention_interval=2)  # fmt: skip
    if cfg["model_type"] == "llama4_text":  # one dense layer and one MoE, the second without rope, chunks of 32
        cfg.update(intermediate_size_mlp=256, interleave_moe_layer_step=2, no_rope_layers=[], no_rope_layer_interval=2,
                   attention_chunk_size=32)  # fmt: skip
    cfg["pad_token_id"] = vocab - 1  # some config classes default to an id of the full vocabulary
    cfg.update(bos_token_id=0, eos_token_id=1)
    return cfg


def attention(name: str) -> str:
    """The kernel the family runs under the spec's default (jobspec/catalog/families.py `attention_for`)."""
    fam = FAMILIES[CONFIGS[name]["model_type"]]
    return "sdpa" if "sdpa" in fam.attentions else "eager"


def main(argv: list[str] | None = None) -> None:
    from runner.train.trace import trace_step

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(CONFIGS))
    ap.add_argument("--tiers", default=",".join(TIERS))
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args(argv)
    print(f"{'model':18} {'type':12} {'params':>7} {'tier':13} {'trace':>7} {'formula':>7} {'ratio':>6} {'secs':>5}"
          f"   (GiB, {args.ranks} ranks except fast on 1, micro-batch {args.micro_batch}, {args.seq_len} tokens)")
    for name in args.models.split(","):
        cfg = CONFIGS[name]
        shape = shape_from_config(cfg, where=name)
        kernel = attention(name)
        for tier in args.tiers.split(","):
            ranks = 1 if tier == "fast" else args.ranks
            t0 = time.perf_counter()
            try:
                r = trace_step(cfg, tier=tier, world_size=ranks, micro_batch=args.micro_batch, seq_len=args.seq_len,
                               attention=kernel)  # fmt: skip
            except Exception as err:  # a family this transformers cannot trace: say so, go on
                print(f"{name:18} {cfg['model_type']:12} {tier:13} trace failed: {type(err).__name__}: "
                      f"{str(err).splitlines()[0][:100]}", flush=True)  # fmt: skip
                continue
            est = memory.estimate(shape, tier=tier, seq_len=args.seq_len, micro_batch=args.micro_batch,
                                  world_size=ranks, attention=kernel)  # fmt: skip
            bare = est.states + est.activations + est.logits
            print(f"{name:18} {cfg['model_type']:12} {shape.params / 1e9:6.2f}B {tier:13} {r.peak / GIB:7.2f} "
                  f"{bare / GIB:7.2f} {bare / max(r.peak, 1):6.3f} {time.perf_counter() - t0:5.0f}", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"host peak RSS {rss:.1f} GiB")


if __name__ == "__main__":
    main()
