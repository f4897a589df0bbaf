"""What compiled blocks keep less for backward than eager ones, per layer and token: measured on one block of each
shape (runner/train/trace_compiled.py, AOT autograd's min-cut partitioner on fakes, as the trace measures it) and
fitted per (family, tier kind, full or LoRA) to bytes = c_h * hidden + c_q * q_width + c_kv * kv_width + c_i *
intermediate: jobspec/plan/activations.py COMPILE_SAVED_BYTES.

    python -m bench.compile_memory              # the grid: 3 families x hidden 512/768 x MLP 2x/4x x MHA/GQA
                                                # (Llama: x head width hidden/heads or twice that)
    python -m bench.compile_memory --quick      # hidden 512 only

bf16; `fast` (autocast over fp32 weights, the GPU's autocast decisions) and `zero2` (FSDP2's 16-bit weights, no
autocast); full fine-tuning and LoRA rank 8 on every projection. Prints each measurement and each fit's worst error.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from typing import Any

import numpy as np
import torch

from bench.families import tiny
from jobspec.catalog.model_config import shape_from_config
from jobspec.catalog.presets import PRESETS
from jobspec.spec.models import LoraSpec
from runner import internals
from runner.train import trace, trace_compiled

TOKENS = (2, 256)
FAMILIES = {  # family -> a preset (Llama's, GPT-2's blocks) or a config.json (Phi-3's) to vary
    "llama": dataclasses.replace(PRESETS["llama-tiny"], layers=2, vocab=512),
    "gpt2": dataclasses.replace(PRESETS["tiny"], layers=2),
    "phi3": tiny("phi-3-mini"),
}


def vary(base: Any, hidden: int, intermediate: int, heads: int, kv_heads: int | None, head_dim: int | None) -> Any:
    """`base` at these widths: a ModelShape, or a config.json dict (its own keys)."""
    if not isinstance(base, dict):
        return dataclasses.replace(base, hidden=hidden, heads=heads, intermediate=intermediate, kv_heads=kv_heads,
                                   head_dim=head_dim)  # fmt: skip
    return {**base, "hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads or heads, **({"head_dim": head_dim} if head_dim else {})}  # fmt: skip
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], "gpt2": ["c_attn", "c_proj", "c_fc"]}


def measure(model: Any, family: str, tier: str, lora: bool) -> tuple[float, float]:
    """(eager, compiled) bytes one block keeps per token."""
    spec = LoraSpec(rank=8, targets=TARGETS[family]) if lora else None
    net = trace._build(trace.hf_config(model), lora=spec, precision="bf16", attention="sdpa", meta=True)
    with trace.gpu_decisions(), internals.packed_search(False):  # as trace_step measures it
        s = trace._compiled_saving(net, tier != "fast", "bf16", *TOKENS)
    if s.compiled is None:
        raise RuntimeError(s.why)
    n = TOKENS[0] * TOKENS[1]
    return s.eager / n, s.compiled / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    trace_compiled.prime()
    hiddens = (512,) if args.quick else (512, 768)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}")
    for family, base in FAMILIES.items():
        for tier, lora in itertools.product(("fast", "zero2"), (False, True)):
            rows, saved = [], []
            for hidden, mult, gqa, wide in itertools.product(hiddens, (2, 4), (False, True), (False, True)):
                if (family == "gpt2" and (gqa or wide)) or (family == "phi3" and wide):
                    continue
                heads = 8  # `wide`: heads twice hidden / heads wide, so that q is not `hidden` wide (Qwen3, Gemma)
                model = vary(base, hidden, mult * hidden, heads, heads // 4 if gqa else None,
                             2 * hidden // heads if wide else None)  # fmt: skip
                shape = shape_from_config(model) if isinstance(model, dict) else model
                eager, compiled = measure(model, family, tier, lora)
                rows.append((shape.hidden, shape.q_width, shape.kv_width, shape.intermediate))
                saved.append(eager - compiled)
                print(f"  {family} {tier} {'lora' if lora else 'full'} h {hidden} i {mult * hidden} "
                      f"q {shape.q_width} kv {shape.kv_width}: eager {eager:.0f} B/token, "
                      f"compiled {compiled:.0f} ({compiled / eager:.2f})")
            a, b = np.array(rows, dtype=float), np.array(saved)
            if family != "llama":  # q and kv are hidden wide (gpt2) or fused (phi3): their terms fold into c_h
                a = a[:, [0, 2, 3]] if family == "phi3" else a[:, [0, 3]]
            coef, *_ = np.linalg.lstsq(a, b, rcond=None)
            worst = float(np.max(np.abs(a @ coef - b)))
            print(f"{family} {tier} {'lora' if lora else 'full'}: saved = {np.round(coef, 2).tolist()} "
                  f"(worst {worst:.1f} B/token of {b.min():.0f}-{b.max():.0f})")


if __name__ == "__main__":
    main()
