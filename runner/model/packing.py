"""Packed rows without cross-contamination: what the model is given, and the startup check that it holds.

A packed row joins several records (runner/data/tokens.py); each record must see only itself, numbered from 0,
so that its logits are those it has alone. transformers does this from position ids alone when it gets no
attention mask and no cache (a training forward): masking_utils' `find_packed_sequence_indices` (transformers
>= 4.56) reads the restarts and builds a block-diagonal causal mask for sdpa, eager and flex attention, and the
flash-attention path runs its varlen kernel, but only for a batch of one row (`_is_packed_sequence`). So for a
flash kernel the micro-batch is flattened to one row of B x T positions (`packed_inputs`, what transformers'
`DataCollatorWithFlattening` does): the summed token loss does not depend on the shape, and padding, counted on
from its row's last record, stays a tail that no real token attends to.

That a model does this is a property of its class, its attention kernel and the installed transformers, not
something to assume (a model whose code ignores position ids, an older release, a kernel without the masks):
`check_packing` runs a small model of the same architecture (the real config shrunk to 2 layers 64 wide, same
`model_type` and attention implementation, on the training device) on two short records packed in two rows
and alone, through the same `packed_inputs`, and `confine_packing` turns `data.packing` off for the run when the
logits differ, with a log line saying why (records are then one per row). It costs a few milliseconds.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from jobspec.catalog.presets import PRESETS
from jobspec.plan.planner import model_attention
from jobspec.spec.models import JobSpec
from runner import internals
from runner.model.build import checked_config, preset_config

log = logging.getLogger("jobspec.runner")

# The small model of the check: enough to hold every architectural feature (GQA ratio, layer types), no more.
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}
SMALL_IF_PRESENT = {"intermediate_size": 128, "n_inner": 128, "head_dim": 16, "moe_intermediate_size": 32,
                    "intermediate_size_mlp": 128, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")  # ids of the full vocabulary: dropped where the small one
# has no such row (Llama 4's pad 200018 made nn.Embedding refuse its padding_idx, and packing went off for every run)
INIT_STD = 0.5  # large weights: a record that sees its neighbour changes its logits by ~1, not ~1e-3
RECORDS = (5, 7)  # tokens of the two records of the check
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}  # of |logits|' largest value
CONCLUSIVE = 100  # the unconfined difference must exceed the tolerance this many times, else the check proves nothing


def flattens(attention: str) -> bool:
    """Whether this attention implementation confines packed records only in a batch of one row (flash kernels)."""
    return "flash" in attention


def packed_inputs(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(input_ids, labels, position_ids) as the model must get them for a packed batch: (B, T) as they are, or
    (1, B x T) for a flash kernel (see the module docstring). Row-major: row r's positions stay contiguous."""
    if not flattens(internals.attention_kernel(model)):
        return input_ids, labels, position_ids
    flat = None if labels is None else labels.reshape(1, -1)
    return input_ids.reshape(1, -1), flat, position_ids.reshape(1, -1)


def model_config(spec: JobSpec) -> Any:
    """The transformers config the run builds its model from (runner/model/build.py), without weights."""
    m = spec.model
    if m.preset:
        return preset_config(PRESETS[m.preset], bos=0, eos=1)  # token ids do not change attention
    return checked_config(m.path)


def small_config(config: Any) -> Any:
    """`config` shrunk (SMALL): same model_type, layer kinds and query/key-value head ratio, random init large."""
    cfg = copy.deepcopy(config)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(cfg, "num_key_value_heads", 0) or heads or 1)
    ratio = max(1, heads // kv) if heads else 1
    for key, value in SMALL.items():
        setattr(cfg, key, value)  # through the config's attribute_map (GPT-2: n_layer, n_embd, n_head)
    for key, value in SMALL_IF_PRESENT.items():
        if getattr(cfg, key, None) is not None:
            setattr(cfg, key, value)
    if getattr(cfg, "kv_lora_rank", None):  # multi-head latent attention (DeepSeek): its widths shrunk together, the
        # rotary part as head_dim (what DeepSeek's configs set); SMALL's head_dim of 16 against a 64-wide rotary
        # part made the check fail to run and packing go off for every DeepSeek-V3 run
        cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim = 16, 8, 8, 16
        if getattr(cfg, "q_lora_rank", None):
            cfg.q_lora_rank = 32
        if hasattr(cfg, "qk_head_dim"):
            cfg.qk_head_dim = cfg.qk_rope_head_dim + cfg.qk_nope_head_dim
        if getattr(cfg, "head_dim", None) is not None:
            cfg.head_dim = cfg.qk_rope_head_dim
    for key in TOKEN_IDS:  # the check's records are random ids below SMALL's vocabulary: special ids play no part
        value = getattr(cfg, key, None)
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, int) and i >= SMALL["vocab_size"] for i in ids):
            setattr(cfg, key, None)
    if hasattr(cfg, "num_key_value_heads"):
        cfg.num_key_value_heads = SMALL["num_attention_heads"] // ratio if ratio in (1, 2, 4) else 1
    if getattr(cfg, "linear_num_key_heads", None):  # linear attention (Qwen3-Next): its value heads per key head kept
        group = max(1, cfg.linear_num_value_heads // cfg.linear_num_key_heads)
        cfg.linear_num_key_heads, cfg.linear_num_value_heads = 2, 2 * group
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(getattr(cfg, key, None), list):
            setattr(cfg, key, getattr(cfg, key)[: SMALL["num_hidden_layers"]])
    for key, cap in (("num_experts", 4), ("num_local_experts", 4), ("num_experts_per_tok", 2)):
        if isinstance(getattr(cfg, key, None), int):
            setattr(cfg, key, min(getattr(cfg, key), cap))
    cfg.initializer_range = INIT_STD
    cfg.use_cache = False
    return cfg


@dataclass(frozen=True)
class PackingCheck:
    """Largest |logit| difference of a record packed vs alone (`leak`), and without per-record positions
    (`unconfined`: plain causal attention over the row, what packing cost before), against `tolerance`."""

    attention: str
    leak: float
    unconfined: float
    tolerance: float
    recurrent: bool = False  # the model has linear-attention layers (Qwen3-Next), whose state runs along the row

    @property
    def problem(self) -> str | None:
        """Why packing does not hold, or None."""
        if self.leak > self.tolerance:
            why = (
                "its linear-attention layers carry their state from one record into the next (transformers' "
                "PyTorch delta rule takes no record boundaries)" if self.recurrent else
                "this model or transformers release does not confine attention by position ids"
            )  # fmt: skip
            return (
                f"with attention {self.attention} a record packed with another gets other logits than alone "
                f"(differ by {self.leak:.2g}, tolerance {self.tolerance:.2g}): {why}"
            )
        if self.unconfined <= CONCLUSIVE * self.tolerance:
            return (
                f"the packing check is inconclusive with attention {self.attention}: even unconfined attention "
                f"changes the logits by only {self.unconfined:.2g}"
            )
        return None


def check_packing(config: Any, attention: str, device: torch.device) -> PackingCheck:
    """Two records run alone and packed (two rows: A+B and B+A), through `packed_inputs`, on a small model of
    `config`'s architecture with `attention`; fp32, or bf16 for a flash kernel (which has no fp32)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if flattens(attention) else torch.float32
    cfg = small_config(config)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention)
        model = model.to(device=device, dtype=dtype).eval()
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randint(0, SMALL["vocab_size"], (1, n), generator=g).to(device) for n in RECORDS)
        with torch.no_grad():
            alone = [_logits(model, r) for r in (a, b)]
            rows = torch.cat([torch.cat([a, b], 1), torch.cat([b, a], 1)])  # (2, A + B)
            pos = torch.cat([torch.arange(n) for n in RECORDS]).to(device)
            positions = torch.stack([pos, torch.cat([pos[RECORDS[0] :], pos[: RECORDS[0]]])])
            packed = _logits(model, rows, positions)
            unconfined = _logits(model, rows)
    n = RECORDS[0]
    pieces = [(packed[0, :n], alone[0]), (packed[0, n:], alone[1]), (packed[1, -n:], alone[0])]
    pieces_unconfined = [(unconfined[0, n:], alone[1]), (unconfined[1, -n:], alone[0])]
    scale = max(float(x.abs().max()) for x in alone)
    return PackingCheck(
        attention,
        leak=max(float((p - q).abs().max()) for p, q in pieces),
        unconfined=max(float((p - q).abs().max()) for p, q in pieces_unconfined),
        tolerance=TOLERANCE[dtype] * max(scale, 1.0),
        recurrent="linear_attention" in (getattr(cfg, "layer_types", None) or ()),
    )


def _logits(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, V) fp32 logits, the packed way when `positions` are given (shaped back from a flattened batch)."""
    if positions is None:
        with internals.packed_search(False):  # as the runner's forwards answer transformers' search
            return model(input_ids=ids).logits.float()
    x, _, p = packed_inputs(model, ids, None, positions)
    with internals.packed_search(True):
        return model(input_ids=x, position_ids=p, use_cache=False).logits.float().reshape(*ids.shape, -1)


def confine_packing(spec: JobSpec, device: torch.device, any_rank: Callable[[bool], bool] = bool) -> JobSpec:
    """`spec`, with `data.packing` turned off (and a warning saying why) when `check_packing` fails for its model
    and attention on `device`. `any_rank`: whether any rank failed (every rank must pack alike)."""
    if not spec.data.packing:
        return spec
    attention = model_attention(spec)
    try:
        result: PackingCheck | None = check_packing(model_config(spec), attention, device)
        why = result.problem if result else None
    except Exception as err:  # any failure of the small model means packing is unproven here
        result, why = None, f"the packing check could not run ({type(err).__name__}: {str(err)[:200]})"
    if any_rank(why is not None):
        why = why or "the packing check failed on another rank"
        log.warning("data.packing turned off for this run: %s; records go one per row", why)
        return spec.model_copy(update={"data": spec.data.model_copy(update={"packing": False})})
    assert result is not None
    log.info(
        "data.packing: each record of a packed row sees only itself (attention %s: its logits as alone within %.1g, "
        "%.2g without per-record positions)", attention, result.leak, result.unconfined,
    )  # fmt: skip
    return spec
