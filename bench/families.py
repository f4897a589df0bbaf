"""The family matrix: formula vs trace at each family's published shape, every tier (jobspec/catalog/families.py).

`CONFIGS` holds config.json contents at the published shapes (the keys and values of the models' own config.json
files on the Hugging Face hub, written down here: nothing is downloaded); transformers builds each from its own
config class. `tiny(name)` is the same family shrunk to 2 layers for CPU training (tests/runner/model/
test_families.py trains and exports each, full and LoRA). `main` traces the runner's step on FakeTensors
(runner/train/trace.py) at every tier and prints the memory model's bytes beside it:

    python -m bench.families                      # every family, every tier, 8 ranks, micro-batch 1, 2048 tokens
    python -m bench.families --models mixtral-8x7b,gemma-2-2b --tiers fast,zero3 --ranks 8 --micro-batch 2

`ratio` is formula / trace, both without the fixed 1 GiB and 5 % overhead the plan adds on top of the formula.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

from jobspec.catalog.families import FAMILIES
from jobspec.catalog.model_config import shape_from_config
from jobspec.catalog.tiers import TIERS
from jobspec.plan import memory

GIB = 1024**3
_DENSE = {"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "hidden_act": "silu"}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {**_DENSE, "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
                     "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "llama-3.1-8b": {**_DENSE, "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                     "vocab_size": 128256, "max_position_embeddings": 131072},
    "mistral-7b": {**_DENSE, "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
                   "vocab_size": 32768, "max_position_embeddings": 32768, "sliding_window": None},
    "qwen2.5-7b": {**_DENSE, "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                   "vocab_size": 152064, "max_position_embeddings": 32768, "use_sliding_window": False},
    "qwen3-8b": {**_DENSE, "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
                 "vocab_size": 151936, "max_position_embeddings": 40960},
    "smollm3-3b": {**_DENSE, "model_type": "smollm3", "hidden_size": 2048, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 11008,
                   "vocab_size": 128256, "max_position_embeddings": 65536, "tie_word_embeddings": True},
    "olmo-2-7b": {**_DENSE, "model_type": "olmo2", "hidden_size": 4096, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
                  "vocab_size": 100352, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6},
    "granite-3.1-8b": {**_DENSE, "model_type": "granite", "hidden_size": 4096, "num_hidden_layers": 40,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12800,
                       "vocab_size": 49155, "max_position_embeddings": 131072, "tie_word_embeddings": True,
                       "logits_scaling": 16.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                       "attention_multiplier": 0.0078125},
    "phi-3-mini": {**_DENSE, "model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 8192,
                   "vocab_size": 32064, "max_position_embeddings": 4096, "pad_token_id": 32000},
    "phi-4": {**_DENSE, "model_type": "phi3", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
              "num_key_value_heads": 10, "intermediate_size": 17920, "vocab_size": 100352,
              "max_position_embeddings": 16384, "pad_token_id": 100349},
    "gpt2-124m": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
                  "n_positions": 1024, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
    "gemma-2b": {"model_type": "gemma", "hidden_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 8,
                 "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 16384, "vocab_size": 256000,
                 "max_position_embeddings": 8192, "tie_word_embeddings": True,
                 "hidden_activation": "gelu_pytorch_tanh"},
    "gemma-2-2b": {"model_type": "gemma2", "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 256000,
                   "max_position_embeddings": 8192, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
                   "hidden_activation": "gelu_pytorch_tanh"},
    "gemma-3-1b": {"model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26,
                   "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
                   "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512,
                   "query_pre_attn_scalar": 256, "tie_word_embeddings": True, "final_logit_softcapping": None},
    "mixtral-8x7b": {**_DENSE, "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "router_aux_loss_coef": 0.02},
    "qwen1.5-moe-a2.7b": {**_DENSE, "model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
                          "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [],
                          "vocab_size": 151936, "max_position_embeddings": 8192, "router_aux_loss_coef": 0.001},
    "qwen3-30b-a3b": {**_DENSE, "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                      "max_position_embeddings": 40960, "router_aux_loss_coef": 0.001},
    "olmoe-1b-7b": {**_DENSE, "model_type": "olmoe", "hidden_size": 2048, "num_hidden_layers": 16,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 1024,
                    "num_experts": 64, "num_experts_per_tok": 8, "vocab_size": 50304,
                    "max_position_embeddings": 4096, "router_aux_loss_coef": 0.01},
    "deepseek-v2-lite": {**_DENSE, "model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
                         "moe_intermediate_size": 1408, "n_routed_experts": 64, "num_experts_per_tok": 6,
                         "n_shared_experts": 2, "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None,
                         "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 102400,
                         "max_position_embeddings": 163840, "topk_method": "greedy", "n_group": 1, "topk_group": 1},
    "gpt-oss-20b": {**_DENSE, "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
                    "max_position_embeddings": 131072, "sliding_window": 128, "router_aux_loss_coef": 0.9},
}  # fmt: skip


def tiny(name: str, vocab: int = 512) -> dict[str, Any]:
    """`CONFIGS[name]` shrunk to 2 layers of width 64 (CPU training in seconds): the family's own keys, its experts
    (4, top 2), latent attention, soft cap and scale kept; head counts and widths scaled down."""
    cfg = dict(CONFIGS[name])
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
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = 32
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
