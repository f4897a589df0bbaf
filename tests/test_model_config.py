"""A model's config.json is input: checked before anything is built, by `jobspec plan`, `validate` and the runner.

Each hostile config ends in exit 2 naming the file and the key, in well under a second, never a traceback;
a model whose numbers are sane but whose states fit no memory tier of the hardware is refused with them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from jobspec.catalog.model_config import BOUNDS, read_config, shape_from_config
from jobspec.errors import ConfigError
from jobspec.plan.planner import plan_spec
from jobspec.spec.loader import load_spec
from tests.cli_helpers import cli

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512, "n_positions": 256}


def spec_for(tmp_path: Path, model_dir: Path, **model: object) -> Path:
    spec = {
        "name": "cfg-check",
        "model": {"path": str(model_dir), **model},
        "data": {"path": str(tmp_path / "d.jsonl"), "max_seq_len": 128},
        "training": {"global_batch": 8, "learning_rate": 1e-4, "steps": 10},
        "hardware": {"vendor": "cuda", "gpus": {"count": 1, "memory": "24Gi"}},
    }
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def model_dir(tmp_path: Path, config: object | str) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


def plan(tmp_path: Path, model: Path) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    code, out = cli("plan", str(spec_for(tmp_path, model)))
    return code, out, time.perf_counter() - t0


HOSTILE = [
        ({"num_attention_heads": 0}, "num_attention_heads: 0 is not positive"),
        ({"hidden_size": 1e9}, "hidden_size: 1000000000.0 is not an integer"),
        ({"num_hidden_layers": 10**12}, "num_hidden_layers: 1000000000000 is above"),
        ({"hidden_size": -4096}, "hidden_size: -4096 is not positive"),
        ({"vocab_size": -(10**30)}, "vocab_size: a negative integer"),
        ({"intermediate_size": "11008"}, "intermediate_size: '11008' is not an integer"),
        ({"num_attention_heads": True}, "num_attention_heads: bool is not an integer"),
        ({"max_position_embeddings": [4096]}, "max_position_embeddings: list is not an integer"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
        ({"num_key_value_heads": 8}, "num_key_value_heads 8 does not divide num_attention_heads 4"),
        ({"num_attention_heads": 6}, "num_attention_heads 6 does not divide hidden_size 64"),
        ({"vocab_size": None}, "vocab_size: missing"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "named"), HOSTILE)
def test_hostile_llama_configs_exit_2_naming_the_key(tmp_path, change, named):
    cfg = {k: v for k, v in {**LLAMA, **change}.items() if v is not None}
    code, out, seconds = plan(tmp_path, model_dir(tmp_path, cfg))
    assert code == 2 and named in out and "config.json" in out, out
    assert "Traceback" not in out and seconds < 5


def test_hostile_gpt2_configs_too(tmp_path):
    for change, named in [
        ({"n_head": 0}, "n_head: 0"),
        ({"n_embd": 65}, "n_head 4 does not divide n_embd 65"),
        ({"n_layer": 2.0}, "n_layer: 2.0 is not an integer"),
    ]:
        code, out, _ = plan(tmp_path, model_dir(tmp_path, {**GPT2, **change}))
        assert code == 2 and named in out, out


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"num_hidden_layers": ' + "9" * 5000 + "}", "not valid JSON"),  # Python's int-digits limit
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),  # deeper than the parser's stack
        ("[1, 2]", "holds a JSON list"),
        ("not json", "not valid JSON"),
        ("{" + " " * (5 * 1024**2) + "}", "more than the"),  # over the size bound: never parsed
    ],
)
def test_config_files_that_are_not_a_config(tmp_path, text, named):
    code, out, seconds = plan(tmp_path, model_dir(tmp_path, text))
    assert code == 2 and named in out and "Traceback" not in out and seconds < 5, out[-500:]


def test_config_json_that_is_not_a_regular_file(tmp_path):
    """A link to /dev/zero, a FIFO or a directory: refused at once (reading them would never end or block)."""
    d = tmp_path / "model"
    d.mkdir()
    for make, kind in [
        (lambda p: p.symlink_to("/dev/zero"), "links to /dev/zero"),
        (os.mkfifo, "is a FIFO (named pipe), not a regular file"),
        (lambda p: p.mkdir(), "is a directory, not a regular file"),
    ]:
        target = d / "config.json"
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        elif target.exists() or target.is_symlink():
            target.unlink()
        make(target)
        code, out, seconds = plan(tmp_path, d)
        assert code == 2 and kind in out and "Traceback" not in out and seconds < 5, out


def test_config_json_linking_out_of_its_directory(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(LLAMA))
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").symlink_to(outside)
    code, out, _ = plan(tmp_path, d)
    assert code == 2 and "outside" in out and "link out of the directory" in out


def test_a_hub_cache_snapshot_may_link_into_its_blobs(tmp_path):
    """The Hugging Face cache's own layout: snapshots/<rev>/config.json -> ../../blobs/<sha>."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text(json.dumps(LLAMA))
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to("../../blobs/abc123")
    assert read_config(snap)["hidden_size"] == 64


def test_sane_configs_still_read(tmp_path):
    """Real shapes near the bounds: a 405B-like Llama, a Gemma-like config whose head_dim * heads != hidden."""
    big = {
        **LLAMA,
        "num_hidden_layers": 126,
        "hidden_size": 16384,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "intermediate_size": 53248,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
    }
    assert shape_from_config(big).params > 400e9
    gemma = {
        **LLAMA,
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 256000,
    }
    assert shape_from_config(gemma).hidden == 2304
    for name, bound in BOUNDS.items():
        assert bound >= 1024, name


def test_a_model_that_fits_no_tier_is_refused_with_its_numbers(tmp_path):
    """Every number within its bound, yet 1024 layers of width 65536 (~63 T parameters) fit no tier of the largest
    GPU jobspec knows: exit 2 before anything is built, with the parameter count, the least a tier needs and what
    there is. (A model only this GPU is too small for stays "nothing fits", exit 4: tests/test_errors_help.py.)"""
    huge = {
        **LLAMA,
        "num_hidden_layers": 1024,
        "hidden_size": 65536,
        "num_attention_heads": 512,
        "num_key_value_heads": 64,
        "intermediate_size": 262144,
    }
    code, out, seconds = plan(tmp_path, model_dir(tmp_path, huge))
    assert code == 2 and "62.7T parameters fit no memory tier" in out and "even on" in out, out
    assert seconds < 5
    report = plan_spec(load_spec(spec_for(tmp_path, model_dir(tmp_path, LLAMA))))  # a small one still plans
    assert report.chosen is not None and report.chosen.fits


def test_the_spec_architecture_gets_the_same_checks(tmp_path):
    arch = {"family": "llama", "layers": 2, "hidden": 64, "heads": 6, "vocab": 512, "intermediate": 128}
    code, out = cli("validate", str(spec_for(tmp_path, tmp_path / "nowhere", architecture=arch)))
    assert code == 2 and "heads 6 does not divide hidden 64" in out
    code, out = cli(
        "validate", str(spec_for(tmp_path, tmp_path / "nowhere", architecture={**arch, "heads": 4, "layers": 10**6}))
    )
    assert code == 2 and "model.architecture.layers" in out
    with pytest.raises(ConfigError, match="kv_heads"):
        load_spec(spec_for(tmp_path, tmp_path / "nowhere", architecture={**arch, "heads": 4, "kv_heads": 3}))


@pytest.mark.parametrize(
    ("model_type", "hidden", "heads", "kv_heads", "head_dim"),
    [
        ("llama", 640, 8, 4, 128),  # queries wider than the model (Qwen3-4B, Gemma: heads x head_dim != hidden)
        ("mistral", 512, 8, 2, 32),  # and narrower
        ("qwen2", 512, 8, 2, None),  # derived: hidden / heads
        ("llama", 512, 8, 8, 64),  # named, and the same as derived
    ],
)
def test_the_parameter_count_follows_a_configs_head_dim(model_type, hidden, heads, kv_heads, head_dim):
    """`head_dim` decides the attention's widths: the shape counts what transformers builds (qwen2 adds biases to
    q, k and v: q + 2 kv a layer, which the memory model leaves out)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "intermediate_size": 1024, "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": False,
           **({"head_dim": head_dim} if head_dim else {})}  # fmt: skip
    shape = shape_from_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    built = sum(p.numel() for p in model.parameters())
    biases = 2 * (shape.q_width + 2 * shape.kv_width) if model_type == "qwen2" else 0
    assert shape.params + biases == built


@pytest.mark.parametrize(("change", "named"), HOSTILE)
def test_a_config_written_inline_as_the_architecture_gets_the_same_checks(tmp_path, change, named):
    """A hub model's config.json written into the spec (`model.architecture: {model_type: ..., ...}`): `jobspec
    validate` refuses what `plan` refuses in a local config.json, naming the spec file and model.architecture.KEY."""
    cfg = {k: v for k, v in {**LLAMA, **change}.items() if v is not None}
    spec = spec_for(tmp_path, "Org/Model", architecture=cfg)
    code, out = cli("validate", str(spec))
    key, _, why = named.replace(" ", ": ", 1).partition(": ") if ":" not in named else named.partition(": ")
    assert code == 2 and f"{spec}:" in out and f"model.architecture.{key}: " in out and "Traceback" not in out, out
    # the YAML reader refuses a number beyond 64 bits before the config is read
    assert (why in out and "config.json on the hub" in out) or "integer out of range" in out, out


def test_an_inline_config_of_every_family_plans_as_its_local_config_json(tmp_path):
    """Each family's config.json at its published shape (bench/families.json), inline or in a local model directory:
    the same shape, so the same plan."""
    from jobspec.plan.planner import model_shape

    families = json.loads((Path(__file__).parent.parent / "bench" / "families.json").read_text())
    for name, cfg in families.items():
        inline = load_spec(spec_for(tmp_path, "Org/Model", architecture=cfg))
        local = load_spec(spec_for(tmp_path, model_dir(tmp_path, cfg)))
        assert model_shape(inline) == model_shape(local), name


def test_an_inline_config_outside_the_families_or_with_bad_experts_is_refused(tmp_path):
    code, out = cli("validate", str(spec_for(tmp_path, "Org/Model", architecture={**LLAMA, "model_type": "falcon"})))
    assert code == 2 and "model.architecture.model_type" in out and "'qwen3_moe'" in out, out  # the supported list
    moe = {**LLAMA, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 4}
    code, out = cli("validate", str(spec_for(tmp_path, "Org/Model", architecture=moe)))
    assert code == 2 and "model.architecture.num_experts_per_tok: 4 is above num_local_experts 2" in out, out
    # the short form is for dense gpt2/llama blocks: another family is pointed at the config.json form
    short = {"family": "mixtral", "layers": 2, "hidden": 64, "heads": 4, "vocab": 512, "intermediate": 128}
    code, out = cli("validate", str(spec_for(tmp_path, "Org/Model", architecture=short)))
    assert code == 2 and "model.architecture.family" in out and "model_type: mixtral" in out, out


@pytest.mark.parametrize(("change", "named"), [
    ({"model_type": "gemma3_text", "sliding_window": True}, "sliding_window: must be a number of tokens"),
    ({"model_type": "gemma3_text", "sliding_window": "4096"}, "sliding_window: must be a number of tokens"),
    ({"model_type": "gemma3_text", "sliding_window": -1}, "sliding_window: must be a number of tokens"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings: must be true or false"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings: must be true or false"),
])  # fmt: skip
def test_a_window_or_a_tie_that_is_no_such_value_is_refused_not_dropped(tmp_path, change, named):
    """`sliding_window: yes` (YAML's boolean) was read as no window at all, and the model planned and trained with full
    attention; a tie of 1 fell back to the family's default. Both are refused, inline and in a local config.json."""
    cfg = {**LLAMA, "head_dim": 16, **change}
    code, out = cli("validate", str(spec_for(tmp_path, "Org/Model", architecture=cfg)))
    assert code == 2 and f"model.architecture.{named}" in out and "Traceback" not in out, out
    code, out, _ = plan(tmp_path, model_dir(tmp_path, cfg))
    assert code == 2 and named.split(":")[0] in out, out
    good = {**LLAMA, "head_dim": 16, "model_type": "gemma3_text", "sliding_window": 512}
    assert shape_from_config(good).sliding_window == 512
    assert shape_from_config({**good, "sliding_window": None}).sliding_window is None


def test_an_architecture_that_would_be_ignored_is_refused(tmp_path):
    """Beside a preset (built from its own shape) or a local model directory with its own config.json (which the plan
    and the runner read), `model.architecture` was ignored without a word."""
    spec = tmp_path / "preset.yaml"
    spec.write_text(yaml.safe_dump({"name": "p", "model": {"preset": "tiny", "architecture": LLAMA},
                                    "training": {"global_batch": 8, "steps": 2}, "hardware": {"vendor": "cpu"}}))
    code, out = cli("validate", str(spec))
    assert code == 2 and "model.architecture" in out and "model.preset" in out, out
    local = model_dir(tmp_path, LLAMA)
    code, out = cli("validate", str(spec_for(tmp_path, local, architecture={**LLAMA, "num_hidden_layers": 4})))
    assert code == 2 and "model.architecture" in out and "its own config.json" in out, out
    assert cli("validate", str(spec_for(tmp_path, local)))[0] == 0
