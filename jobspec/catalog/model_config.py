"""A model's shape from its `config.json` (or the spec's `model.architecture`), checked before anything is built.

A config.json comes with a model directory someone else wrote. transformers builds whatever it says:
`num_attention_heads: 0` ends in a ZeroDivisionError, `hidden_size: 1e9` in an allocation error,
`num_hidden_layers: 1e12` in minutes of building until the host kills the process, and a negative width
spins in a C loop that no signal interrupts. So every number the model is built from is checked here
first: an integer (not a float, not a bool), positive, within a bound no real model comes near, and
consistent (heads divide the width unless the config names its `head_dim`; key/value heads divide the
heads). Pure Python: `jobspec plan` and the runner read the same shape.

Whether the parameters fit any memory tier of the hardware is the next check (jobspec.plan.capacity).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobspec.catalog.presets import ModelShape
from jobspec.errors import ConfigError
from jobspec.untrusted import json_loads, read_bounded

CONFIG_MAX_BYTES = 4 * 1024**2  # a config.json is a few KB; one with a large label map, some hundred KB
# Upper bounds with ample room over the largest open models (126-layer, 16k-wide Llama 3.1 405B; 262k-token
# vocabularies; 10M-position contexts): a value beyond one is a typo or an attack, not a model.
BOUNDS = {
    "layers": 1024,
    "hidden": 131_072,
    "heads": 2048,
    "kv_heads": 2048,
    "vocab": 4 * 1024**2,
    "intermediate": 1024**2,
    "max_positions": 64 * 1024**2,
    "head_dim": 4096,
}
_GPT2_KEYS = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "vocab": "vocab_size",
              "max_positions": "n_positions", "intermediate": "n_inner"}  # fmt: skip
_LLAMA_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "vocab": "vocab_size", "max_positions": "max_position_embeddings",
               "intermediate": "intermediate_size", "head_dim": "head_dim"}  # fmt: skip


# Model types whose attention normalises the queries and keys (q_norm, k_norm): their activations hold more
QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2"})
# Model types with one projection for q, k and v and one for the MLP's gate and up (qkv_proj, gate_up_proj)
FUSED_TYPES = frozenset({"phi3"})


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The config.json of a local model directory: a regular file inside it (a Hugging Face cache snapshot's
    link into its repository's blobs included), bounded, a JSON object."""
    path = Path(model_dir) / "config.json"
    text = read_bounded(path, CONFIG_MAX_BYTES, what="model config", root=_repo_root(Path(model_dir)))
    try:
        cfg = json_loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: nesting deeper than the parser's stack
        raise ConfigError(f"model config {path} is not valid JSON ({str(err)[:200]})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"model config {path} holds a JSON {type(cfg).__name__}, not an object")
    return cfg


def _repo_root(model_dir: Path) -> Path:
    """Where the files of `model_dir` may link to: itself, or for a Hugging Face cache snapshot
    (`models--org--name/snapshots/<rev>`) the repository folder that holds its `blobs/`."""
    real = model_dir.resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def shape_from_config(cfg: dict[str, Any], where: str = "config.json") -> ModelShape:
    """A transformers config (GPT-2 or Llama-style keys) as a checked ModelShape; ConfigError naming
    `where`, the key and the fix otherwise."""
    gpt2 = "n_embd" in cfg
    keys = _GPT2_KEYS if gpt2 else _LLAMA_KEYS
    v: dict[str, Any] = _checked(
        cfg, keys, ("layers", "hidden", "heads", "vocab", *(() if gpt2 else ("intermediate",))), where
    )
    if gpt2:
        return ModelShape("gpt2", layers=v["layers"], hidden=v["hidden"], heads=v["heads"], vocab=v["vocab"],
                          max_positions=v["max_positions"] or 1024,
                          intermediate=v["intermediate"] or 4 * v["hidden"],
                          residual_dropout=_dropout(cfg, "resid_pdrop", 0.1))  # fmt: skip
    tie = cfg.get("tie_word_embeddings", False)  # transformers' Llama default
    return ModelShape("llama", layers=v["layers"], hidden=v["hidden"], heads=v["heads"], kv_heads=v["kv_heads"],
                      vocab=v["vocab"], max_positions=v["max_positions"] or 2048, intermediate=v["intermediate"],
                      tie_embeddings=tie if isinstance(tie, bool) else False,
                      head_dim=v.get("head_dim") if v.get("head_dim") != v["hidden"] // v["heads"] else None,
                      qk_norm=cfg.get("model_type") in QK_NORM_TYPES,
                      fused_projections=cfg.get("model_type") in FUSED_TYPES,
                      residual_dropout=_dropout(cfg, "resid_pdrop", 0.0))  # fmt: skip


def _dropout(cfg: dict[str, Any], key: str, default: float) -> bool:
    """Whether the config trains with dropout at `key` (transformers' default for the family when absent)."""
    value = cfg.get(key, default)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_config(cfg: dict[str, Any], where: str) -> None:
    """Every size key `cfg` has, under either naming, checked; none required (a family with other key names,
    sized by the spec's `model.architecture`, builds as long as the keys it shares are sane)."""
    _checked(cfg, _GPT2_KEYS if "n_embd" in cfg else _LLAMA_KEYS, (), where)


def _checked(cfg: dict[str, Any], keys: dict[str, str], required: tuple[str, ...], where: str) -> dict[str, int | None]:
    """The values of `keys` in `cfg` (None where absent), every present one an integer in bounds."""
    values: dict[str, int | None] = {}
    problems: list[str] = []
    for name, key in keys.items():
        raw = cfg.get(key)
        if raw is None:
            if name in required:
                problems.append(f"{key}: missing")
            values[name] = None
            continue
        why = _bad_int(raw, BOUNDS[name])
        if why:
            problems.append(f"{key}: {why}")
        values[name] = raw if not why else None
    if not problems:
        problems += _consistency(values, keys)
    if problems:
        raise ConfigError(
            f"{where}: the model config cannot be built ({'; '.join(problems)}): fix the file, or point "
            "model.path at a model directory whose config.json transformers wrote"
        )
    return values


def _bad_int(value: Any, bound: int) -> str | None:
    """Why `value` is not an integer in [1, bound], or None. Never converts a huge value (no str(10**5000))."""
    if isinstance(value, bool) or not isinstance(value, int):
        shown = repr(value)[:40] if isinstance(value, (float, str)) else type(value).__name__
        return f"{shown} is not an integer"
    if value < 1:
        return f"{value} is not positive" if value.bit_length() < 64 else "a negative integer"
    if value > bound:
        return f"{value} is above {bound:,} (no real model comes near)" if value.bit_length() < 64 else "too large"
    return None


def _consistency(v: dict[str, int | None], keys: dict[str, str]) -> list[str]:
    """Head counts that split the width and each other (what the attention reshapes need)."""
    out = []
    hidden, heads, kv = v["hidden"], v["heads"], v.get("kv_heads")
    if v.get("head_dim") is None and hidden and heads and hidden % heads:
        out.append(f"{keys['heads']} {heads} does not divide {keys['hidden']} {hidden} (and there is no head_dim)")
    if kv and heads and (kv > heads or heads % kv):
        out.append(f"{keys['kv_heads']} {kv} does not divide {keys['heads']} {heads}")
    return out
