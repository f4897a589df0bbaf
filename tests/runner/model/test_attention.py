"""`model.attention: flash_attention_2` runs as asked or stops with exit 2 and the fix; never a quiet sdpa."""

from __future__ import annotations

from importlib.machinery import ModuleSpec

import pytest
import torch

from jobspec.errors import ConfigError
from runner.model import build
from runner.process import preflight
from tests.runner.train_helpers import tiny_spec

GPU = {"hardware": {"vendor": "cuda", "gpus": 1}, "training": {"precision": "auto"}}


def with_attention(spec, attention: str):
    """The spec with `model.attention` set past validation (the field's values are the spec's to widen)."""
    return spec.model_copy(update={"model": spec.model.model_copy(update={"attention": attention})})


def fake_flash_attn(monkeypatch, module, installed: bool) -> None:
    real = module.find_spec
    monkeypatch.setattr(module, "find_spec", lambda name: (ModuleSpec(name, None) if installed else None)
                        if name == "flash_attn" else real(name))  # fmt: skip


def test_preflight_without_flash_attn_names_the_field_and_the_fix(tmp_path, monkeypatch):
    fake_flash_attn(monkeypatch, preflight, installed=False)
    spec = with_attention(tiny_spec(tmp_path, **GPU), "flash_attention_2")
    with pytest.raises(ConfigError) as err:
        preflight.check(spec)
    message = str(err.value)
    assert "model.attention flash_attention_2" in message and "flash_attn" in message
    assert "pip install flash-attn" in message and "model.attention: sdpa" in message


@pytest.mark.parametrize(
    ("sections", "needle"),
    [
        ({"hardware": {"vendor": "cpu", "gpus": 1}}, "hardware.vendor is cpu"),
        ({**GPU, "training": {"precision": "fp32"}}, "training.precision is fp32"),
    ],
    ids=["cpu", "fp32"],
)
def test_preflight_rejects_flash_attention_where_it_cannot_run_even_when_installed(
    tmp_path, monkeypatch, sections, needle
):
    fake_flash_attn(monkeypatch, preflight, installed=True)
    with pytest.raises(ConfigError, match=needle):
        preflight.check(with_attention(tiny_spec(tmp_path, **sections), "flash_attention_2"))


def test_preflight_passes_flash_attention_with_the_package_and_sdpa_without_it(tmp_path, monkeypatch):
    fake_flash_attn(monkeypatch, preflight, installed=True)
    preflight.check(with_attention(tiny_spec(tmp_path, **GPU), "flash_attention_2"))
    fake_flash_attn(monkeypatch, preflight, installed=False)
    preflight.check(tiny_spec(tmp_path, **GPU))  # sdpa, the default: flash_attn not asked for


@pytest.mark.parametrize(
    ("installed", "gpu", "needle"),
    [(False, True, "pip install flash-attn"), (True, False, "needs a GPU and this machine has none")],
    ids=["no-package", "no-gpu"],
)
def test_building_the_model_says_why_flash_attention_cannot_run(tmp_path, monkeypatch, installed, gpu, needle):
    """transformers itself raises ImportError / ValueError (a traceback, exit 1) after building the model."""
    fake_flash_attn(monkeypatch, build, installed=installed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    spec = with_attention(tiny_spec(tmp_path, **GPU), "flash_attention_2")
    with pytest.raises(ConfigError, match=needle) as err:
        build.build_model(spec, bos=1, eos=2, vocab=262)
    assert "model.attention: sdpa" in str(err.value)
    build.check_attention("sdpa")  # every other kernel is transformers' to check


def test_what_transformers_does_without_flash_attn_is_an_import_error_after_building():
    """Why the checks above exist: asked for flash_attention_2 without the package, transformers raises late."""
    if build.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises((ImportError, ValueError), match=r"(?i)flash"):
        AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attention_2")
