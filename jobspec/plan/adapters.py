"""LoRA adapters in the memory model: the linear layers of a block a `LoraShape` wraps (by family, layer kind and
peft's `target_modules` names), the trainable parameters they add, and a block's parameters (FSDP2 gathers it
whole). Read before jobspec/plan/activations.py and jobspec/plan/memory.py, which count their bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jobspec.catalog.presets import ModelShape
from jobspec.errors import ConfigError


@dataclass(frozen=True)
class LoraShape:
    """LoRA adapters: rank r and the module names they wrap (PEFT `target_modules`, by suffix)."""

    rank: int
    targets: tuple[str, ...]


def _lora_modules(
    shape: ModelShape, moe: bool = False, linear: bool = False
) -> dict[str, list[tuple[str, int, int, str]]]:
    """Target name -> (module, in, out features, the tensor it reads) of the linear layers it matches in one block
    (`moe`: a mixture-of-experts block, whose MLP projections are only its shared experts'; the routed experts are
    3-D parameters, not linear layers; `linear`: a linear-attention block, whose projections replace q, k, v and o).
    Modules that read one tensor (q, k and v read the attention's normed input) name the same one. A name the other
    kind of block has maps to no module here (peft adapts what each block holds)."""
    h, i = shape.hidden, shape.intermediate
    if shape.family == "gpt2":  # Conv1D layers; `c_proj` is the suffix of both projections
        attn, mlp = ("attn.c_proj", h, h, "attn_out"), ("mlp.c_proj", i, h, "mlp_act")
        return {
            "c_attn": [("c_attn", h, 3 * h, "attn_in")],
            "c_fc": [("c_fc", h, i, "mlp_in")],
            "c_proj": [attn, mlp],
            "attn.c_proj": [attn],
            "mlp.c_proj": [mlp],
        }
    q, kv = shape.q_width, shape.kv_width  # heads x head_dim, and the grouped-query k/v width
    if moe:
        i = shape.shared_intermediate
    if shape.fused_projections:  # Phi-3: one projection for q, k and v, one for the MLP's gate and up
        shapes = {"qkv_proj": (h, q + 2 * kv, "attn_in"), "o_proj": (q, h, "attn_out"),
                  "gate_up_proj": (h, 2 * i, "mlp_in"), "down_proj": (i, h, "mlp_act")}  # fmt: skip
    elif shape.mla:  # DeepSeek-V2's latent attention: q (or its low-rank pair), the k/v latent and its expansion
        q_rank, kv_rank, nope, rope, v = shape.mla
        attn = {"q_a_proj": (h, q_rank, "attn_in"), "q_b_proj": (q_rank, q, "q_latent")} if q_rank else {
            "q_proj": (h, q, "attn_in")}  # fmt: skip
        shapes = {**attn, "kv_a_proj_with_mqa": (h, kv_rank + rope, "attn_in"),
                  "kv_b_proj": (kv_rank, shape.heads * (nope + v), "kv_latent"),
                  "o_proj": (shape.heads * v, h, "attn_out"), "gate_proj": (h, i, "mlp_in"),
                  "up_proj": (h, i, "mlp_in"), "down_proj": (i, h, "mlp_act")}  # fmt: skip
    else:
        shapes = {"q_proj": (h, q * (2 if shape.gated_attention else 1), "attn_in"), "k_proj": (h, kv, "attn_in"),
                  "v_proj": (h, kv, "attn_in"), "o_proj": (q, h, "attn_out"), "gate_proj": (h, i, "mlp_in"),
                  "up_proj": (h, i, "mlp_in"), "down_proj": (i, h, "mlp_act")}  # fmt: skip
    if shape.linear:  # Gated DeltaNet's projections in its layers, softmax attention's in the others
        key, value = shape.linear_widths
        on = {"in_proj_qkvz": (h, 2 * key + 2 * value, "attn_in"), "in_proj_ba": (h, 2 * shape.linear[1], "attn_in"),
              "out_proj": (value, h, "linear_out")}  # fmt: skip
        off = ("q_proj", "k_proj", "v_proj", "o_proj")
        shapes |= {n: on[n] if linear else (0, 0, "") for n in on} | {n: (0, 0, "") for n in off if linear}
    if shape.moe:  # the routed experts' 3-D parameters (peft's target_parameters): rank r per expert, E x (in + out)
        e, ie = (shape.experts, shape.expert_intermediate) if moe else (0, 0)
        shapes |= {"experts.gate_up_proj": (e * h, e * 2 * ie, "experts"),
                   "experts.down_proj": (e * ie, e * h, "experts")}  # fmt: skip
    return {name: [(name, fin, fout, reads)] if fin and fout else [] for name, (fin, fout, reads) in shapes.items()}


def _lora_targets(
    shape: ModelShape, lora: LoraShape, moe: bool = False, linear: bool = False
) -> set[tuple[str, int, int, str]]:
    """The modules of one block (a MoE block with `moe`, a linear-attention one with `linear`) that `lora` adapts (a
    set: `c_proj` + `mlp.c_proj` count once); ConfigError naming the targets this family has when one is unknown."""
    table = _lora_modules(shape, moe, linear)
    unknown = [t for t in lora.targets if t not in table]
    if unknown or not lora.targets or lora.rank < 1:
        raise ConfigError(
            f"LoRA rank {lora.rank} with targets {list(lora.targets)}: rank must be >= 1 and targets "
            f"non-empty, from {', '.join(table)} for a {_family(shape).replace('phi3', 'Phi-3')} model"
        )
    return {m for t in lora.targets for m in table[t]}


def _per_layer(shape: ModelShape, value: Callable[[bool, bool], float]) -> float:
    """`value(moe, linear)` summed over the layers of each kind: dense or mixture of experts, softmax or linear
    attention."""
    return sum(count * value(*kind) for kind, count in shape.layer_kinds().items())


def trainable_params(shape: ModelShape, lora: LoraShape | None) -> int:
    """Trainable parameters: all of them, or sum over layers and target modules of r*(in+out)."""
    if lora is None:
        return shape.params
    return int(_per_layer(shape, lambda moe, linear: sum(lora.rank * (fin + fout) for _, fin, fout, _ in
                                                         _lora_targets(shape, lora, moe, linear))))  # fmt: skip


def _block_params(shape: ModelShape, layer: int) -> int:
    """Parameters of layer `layer`'s block (0-based; -1 the last), every one of its experts included (FSDP2 gathers a
    block whole)."""
    h, i = shape.hidden, shape.intermediate
    if shape.family == "gpt2":
        return 4 * h * h + 2 * h * i + 9 * h + i
    return shape.block_params_at(layer)


def _family(shape: ModelShape) -> str:
    """The block the activation coefficients were traced on: gpt2, phi3 (fused projections) or llama."""
    if shape.family == "gpt2":
        return "gpt2"
    return "phi3" if shape.fused_projections else "llama"
