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

from jobspec.catalog.families import ExpertKeys, Family, family
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
    "experts": 4096,
    "top_k": 4096,
    "expert_width": 1024**2,
    "rank": 65_536,
    "conv": 1024,
}
_GPT2_KEYS = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "vocab": "vocab_size",
              "max_positions": "n_positions", "intermediate": "n_inner"}  # fmt: skip
_LLAMA_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "vocab": "vocab_size", "max_positions": "max_position_embeddings",
               "intermediate": "intermediate_size", "head_dim": "head_dim"}  # fmt: skip


class ConfigProblems(ConfigError):
    """A config.json's numbers that no model can be built from: `problems` holds (key, what is wrong with it), so a
    config written inline in a spec (`model.architecture`) can name each of its fields."""

    def __init__(self, message: str, problems: list[tuple[str, str]]):
        super().__init__(message)
        self.problems = problems


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The config.json of a local model directory: a regular file inside it (a Hugging Face cache snapshot's
    link into its repository's blobs included), bounded, a JSON object."""
    return read_config_file(Path(model_dir) / "config.json", root=_repo_root(Path(model_dir)))


def read_config_file(path: Path, root: Path | None = None) -> dict[str, Any]:
    """A config.json file (any name: `jobspec init --config FILE`), bounded, a JSON object; it may link only inside
    `root` (default: its own folder)."""
    text = read_bounded(path, CONFIG_MAX_BYTES, what="model config", root=root or path.resolve().parent)
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
    """A transformers config as a checked ModelShape of its family (jobspec/catalog/families.py); ConfigError naming
    `where`, the key and the fix otherwise: a `model_type` outside the table among them. A dict without a
    `model_type` (this project's tests and benches) is read as GPT-2 or Llama keys, whichever it has."""
    gpt2 = "n_embd" in cfg
    fam = family(cfg.get("model_type", "gpt2" if gpt2 else "llama"), where)
    if fam.text_model:
        cfg = text_config(cfg, where)
        fam = family(cfg["model_type"], f"{where} text_config")
    keys = _GPT2_KEYS if fam.block == "gpt2" else {**_LLAMA_KEYS, "intermediate": fam.dense_width}
    v: dict[str, Any] = _checked(
        cfg, keys, ("layers", "hidden", "heads", "vocab", *(() if fam.block == "gpt2" else ("intermediate",))), where
    )
    if fam.block == "gpt2":
        return ModelShape("gpt2", layers=v["layers"], hidden=v["hidden"], heads=v["heads"], vocab=v["vocab"],
                          max_positions=v["max_positions"] or 1024,
                          intermediate=v["intermediate"] or 4 * v["hidden"],
                          residual_dropout=_dropout(cfg, "resid_pdrop", 0.1), model_type="gpt2")  # fmt: skip
    tie = cfg.get("tie_word_embeddings", fam.tie_default)
    if tie is not None and not isinstance(tie, bool):  # YAML's `yes` is a boolean already; 1 or "true" is not one
        why = f"must be true or false, not {_shown(tie)}"
        raise ConfigProblems(f"{where}: tie_word_embeddings {why}: fix the file", [("tie_word_embeddings", why)])
    mla = _mla(cfg, where) if fam.mla else None
    head_dim = None if mla else v.get("head_dim")
    window = _window(cfg, where, fam.window_key) if fam.window_mask else None
    return ModelShape("llama", layers=v["layers"], hidden=v["hidden"], heads=v["heads"], kv_heads=v["kv_heads"],
                      vocab=v["vocab"], max_positions=v["max_positions"] or 2048, intermediate=v["intermediate"],
                      tie_embeddings=tie if isinstance(tie, bool) else fam.tie_default,
                      head_dim=head_dim if head_dim != v["hidden"] // v["heads"] else None,
                      qk_norm=fam.qk_norm or (fam.qk_norm_key is not None and cfg.get(fam.qk_norm_key) is True),
                      fused_projections=fam.block == "phi3",
                      residual_dropout=_dropout(cfg, "resid_pdrop", 0.0), model_type=fam.name, mla=mla,
                      extra_norms=fam.extra_norms, sliding_window=window, gated_attention=fam.gated_attention,
                      **_linear(cfg, v["layers"], where) if fam.linear else {},
                      **_experts(cfg, fam, v["layers"], v["intermediate"], where))  # fmt: skip


def text_config(cfg: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint whose family trains its text model alone (Gemma 3 4B+:
    `text_config`, of model_type gemma3_text), the keys it leaves out at the text config class's defaults; `cfg`
    itself for any other family. ConfigError when the text config is missing or of another model_type."""
    fam = family(cfg.get("model_type"), where)
    if not fam.text_model:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict) or text.get("model_type", fam.text_model) != fam.text_model:
        shown = "missing" if text is None else _shown(text.get("model_type") if isinstance(text, dict) else text)
        why = f"must be the {fam.text_model} config of the text model, not {shown}"
        raise ConfigProblems(f"{where}: text_config {why}: fix the file", [("text_config", why)])
    return {**dict(fam.text_defaults), **text, "model_type": fam.text_model}


def _window(cfg: dict[str, Any], where: str, key: str = "sliding_window") -> int | None:
    """The config's sliding window (Llama 4: attention chunk) in tokens, or None (absent, null or 0: every token
    attends to all before it). Anything else is refused, naming the key: `sliding_window: yes` (a boolean), "4096"
    or -1 was dropped without a word, and the model planned and trained with full attention instead of its window."""
    value = cfg.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value or None
    why = f"must be a number of tokens (or null for none), not {_shown(value)}"
    raise ConfigProblems(f"{where}: {key} {why}: fix the file", [(key, why)])


def _shown(value: Any) -> str:
    """A config value as a message may show it: its type and, for a short scalar, itself."""
    if isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= 20):
        return f"{type(value).__name__} {value!r}"
    return f"a {type(value).__name__}"


def _experts(cfg: dict[str, Any], fam: Family, layers: int, intermediate: int, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelShape from the family's keys (none for a dense family)."""
    keys = fam.experts
    if keys is None:
        return {}
    count = next((k for k in keys.count if cfg.get(k) is not None), keys.count[0])
    names = {"experts": count, "top_k": keys.top_k, "expert_width": keys.width}
    v = _checked(cfg, names, tuple(names), where)
    if v["top_k"] > v["experts"]:
        raise ConfigProblems(f"{where}: {keys.top_k} {v['top_k']} is above {count} {v['experts']}: fix the file",
                             [(keys.top_k, f"{v['top_k']} is above {count} {v['experts']}")])
    shared = 0
    if keys.shared:
        raw = cfg.get(keys.shared) or 0
        if (why := _bad_int(raw, BOUNDS["expert_width"])) and raw != 0:
            raise ConfigProblems(f"{where}: {keys.shared}: {why}: fix the file", [(keys.shared, why)])
        shared = raw * v["expert_width"] if keys.shared_is_count else raw
    return {"experts": v["experts"], "experts_per_token": v["top_k"], "expert_intermediate": v["expert_width"],
            "shared_intermediate": shared, "shared_gate": keys.shared_gate and shared > 0, "expert_bias": keys.bias,
            "every_expert": keys.every_expert, "dense_at": _dense_at(cfg, keys, layers)}  # fmt: skip


def _dense_at(cfg: dict[str, Any], keys: ExpertKeys, layers: int) -> tuple[int, ...]:
    """The layers that keep a dense MLP, as transformers builds them: DeepSeek's first k; those a list of the MoE
    layers leaves out (Llama 4's moe_layers); those between an interval's MoE layers (layer i is MoE when
    (i + 1) % step == 0: Qwen's decoder_sparse_step, Llama 4's interleave_moe_layer_step) and those Qwen's
    mlp_only_layers names."""
    if keys.dense_first:
        k = cfg.get(keys.dense_first) or 0
        return tuple(range(min(layers, k))) if isinstance(k, int) and not isinstance(k, bool) and k > 0 else ()
    listed = cfg.get(keys.moe_list) if keys.moe_list else None
    if isinstance(listed, list):
        moe = {i for i in listed if isinstance(i, int) and not isinstance(i, bool)}
        return tuple(i for i in range(layers) if i not in moe)
    if not keys.sparse_step:
        return ()
    step = cfg.get(keys.sparse_step, 1)
    step = step if isinstance(step, int) and not isinstance(step, bool) and step > 0 else 1
    only = cfg.get(keys.dense_list) if keys.dense_list else None
    only = {i for i in only if isinstance(i, int)} if isinstance(only, list) else set()
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


LINEAR_KEYS = {"linear_num_key_heads": "heads", "linear_num_value_heads": "heads", "linear_key_head_dim": "head_dim",
               "linear_value_head_dim": "head_dim", "linear_conv_kernel_dim": "conv"}  # fmt: skip
LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4}  # fmt: skip
# Qwen3NextConfig's defaults in transformers 5.24, for the keys a config.json leaves out


def _linear(cfg: dict[str, Any], layers: int, where: str) -> dict[str, Any]:
    """Linear attention's widths and the layers that hold it, as transformers builds them: `layer_types` where the
    config lists them ("linear_attention" or "full_attention" each), else every layer but each
    `full_attention_interval`-th. Every width an integer in bounds; the value heads a multiple of the key heads
    (each key head serves a group of them)."""
    values = {key: cfg.get(key, LINEAR_DEFAULTS[key]) for key in LINEAR_KEYS}
    problems = [(key, why) for key, bound in LINEAR_KEYS.items() if (why := _bad_int(values[key], BOUNDS[bound]))]
    k_heads, v_heads = values["linear_num_key_heads"], values["linear_num_value_heads"]
    if not problems and v_heads % k_heads:
        problems.append(("linear_num_value_heads", f"{v_heads} is not a multiple of linear_num_key_heads {k_heads}"))
    types = cfg.get("layer_types")
    if types is not None:
        kinds = ("linear_attention", "full_attention")
        if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
            problems.append(("layer_types", f"must list {layers} entries, each linear_attention or full_attention"))
        else:
            linear_at = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    else:
        interval = cfg.get("full_attention_interval", LINEAR_DEFAULTS["full_attention_interval"])
        if why := _bad_int(interval, BOUNDS["layers"]):
            problems.append(("full_attention_interval", why))
        else:
            linear_at = tuple(i for i in range(layers) if (i + 1) % interval)
    if problems:
        shown = "; ".join(f"{key}: {why}" for key, why in problems)
        raise ConfigProblems(f"{where}: the model config cannot be built ({shown}): fix the file", problems)
    return {"linear": tuple(values[key] for key in LINEAR_KEYS), "linear_at": linear_at}


def _mla(cfg: dict[str, Any], where: str) -> tuple[int, int, int, int, int]:
    """Multi-head latent attention's ranks and head widths (DeepSeek-V2): q_lora_rank may be null (no low-rank q)."""
    names = {"kv_rank": "kv_lora_rank", "nope": "qk_nope_head_dim", "rope": "qk_rope_head_dim", "v": "v_head_dim"}
    bounds = {"kv_rank": BOUNDS["rank"], "nope": BOUNDS["head_dim"], "rope": BOUNDS["head_dim"],
              "v": BOUNDS["head_dim"]}  # fmt: skip
    problems = [(key, why) for name, key in names.items()
                if (why := _bad_int(cfg.get(key), bounds[name]) if cfg.get(key) is not None else "missing")]
    q_rank = cfg.get("q_lora_rank") or 0
    if q_rank and (why := _bad_int(q_rank, BOUNDS["rank"])):
        problems.append(("q_lora_rank", why))
    if problems:
        shown = "; ".join(f"{key}: {why}" for key, why in problems)
        raise ConfigProblems(f"{where}: the model config cannot be built ({shown}): fix the file", problems)
    return (q_rank, *(cfg[names[k]] for k in ("kv_rank", "nope", "rope", "v")))  # type: ignore[return-value]


def _dropout(cfg: dict[str, Any], key: str, default: float) -> bool:
    """Whether the config trains with dropout at `key` (transformers' default for the family when absent)."""
    value = cfg.get(key, default)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_config(cfg: dict[str, Any], where: str) -> None:
    """A config the runner is about to build, checked as `jobspec plan` reads it: its family (the table), every size
    key and the family's own (experts, latent attention)."""
    shape_from_config(cfg, where)


def _checked(cfg: dict[str, Any], keys: dict[str, str], required: tuple[str, ...], where: str) -> dict[str, int | None]:
    """The values of `keys` in `cfg` (None where absent), every present one an integer in bounds."""
    values: dict[str, int | None] = {}
    problems: list[tuple[str, str]] = []  # (key, what is wrong)
    for name, key in keys.items():
        raw = cfg.get(key)
        if raw is None:
            if name in required:
                problems.append((key, "missing"))
            values[name] = None
            continue
        why = _bad_int(raw, BOUNDS[name])
        if why:
            problems.append((key, why))
        values[name] = raw if not why else None
    shown = [f"{key}: {why}" for key, why in problems]
    if not problems:
        for key, why in _consistency(values, keys):
            problems.append((key, why))
            shown.append(f"{key} {why}")
    if problems:
        raise ConfigProblems(
            f"{where}: the model config cannot be built ({'; '.join(shown)}): fix the file, or point "
            "model.path at a model directory whose config.json transformers wrote",
            problems,
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


def _consistency(v: dict[str, int | None], keys: dict[str, str]) -> list[tuple[str, str]]:
    """Head counts that split the width and each other (what the attention reshapes need): (key, why)."""
    out = []
    hidden, heads, kv = v.get("hidden"), v.get("heads"), v.get("kv_heads")
    if v.get("head_dim") is None and hidden and heads and hidden % heads:
        out.append((keys["heads"], f"{heads} does not divide {keys['hidden']} {hidden} (and there is no head_dim)"))
    if kv and heads and (kv > heads or heads % kv):
        out.append((keys["kv_heads"], f"{kv} does not divide {keys['heads']} {heads}"))
    return out
