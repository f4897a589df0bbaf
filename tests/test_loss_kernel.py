"""`training.loss_kernel`: the spec, `jobspec plan` and the runner's preflight (no liger-kernel needed here;
the kernel itself: tests/runner/train/test_loss_liger.py)."""

from __future__ import annotations

import json
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest
import yaml

from jobspec.errors import ConfigError
from runner.process import preflight
from tests.cli_helpers import cli
from tests.runner.train_helpers import tiny_spec

ROOT = Path(__file__).resolve().parents[1]
SFT = ROOT / "examples" / "sft_fast.yaml"


def spec_file(tmp_path: Path, **training) -> str:
    spec = yaml.safe_load(SFT.read_text())
    spec["training"].update(training)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def plan(path: str) -> dict:
    code, out = cli("plan", path, "-o", "json")
    assert code == 0, out
    return json.loads(out)


def test_plan_counts_liger_s_chunk_at_the_compute_width(tmp_path):
    """gpt2-medium at vocab 50257, 1024 tokens a sample: the chunked loss holds 1.5 x 256 MiB of logits at the loss
    (fp32 and their 16-bit gradient), Liger's kernel 256 MiB of bf16 logits overwritten by their gradient."""
    chunked = plan(spec_file(tmp_path, loss_kernel="chunked"))["tiers"]
    liger = plan(spec_file(tmp_path, loss_kernel="liger"))["tiers"]
    assert plan(str(SFT))["tiers"] == chunked  # the default
    smaller = set()
    for a, b in zip(chunked, liger, strict=True):
        assert a["gpu_breakdown"]["weights"] == b["gpu_breakdown"]["weights"]
        assert sum(b["gpu_breakdown"].values()) == b["gpu_bytes"]
        # a tier whose step peaks elsewhere (at a block, at the end of backward) is not changed by the loss's chunk
        assert b["gpu_bytes"] <= a["gpu_bytes"], a["tier"]
        if b["gpu_breakdown"]["logits"] < a["gpu_breakdown"]["logits"]:
            smaller.add(a["tier"])
            saved = a["gpu_breakdown"]["logits"] - b["gpu_breakdown"]["logits"]
            assert saved == pytest.approx(128 * 2**20, rel=1e-3)  # 384 -> 256 MiB (whole tokens a chunk)
    assert "fast" in smaller


@pytest.mark.parametrize("value", ["triton", "LIGER", ""])
def test_an_unknown_kernel_names_the_field_and_the_choices(tmp_path, value):
    code, out = cli("validate", spec_file(tmp_path, loss_kernel=value))
    assert code == 2, out
    assert "training.loss_kernel" in out and "chunked" in out and "liger" in out
    assert "Traceback" not in out


def test_liger_on_a_cpu_vendor_is_refused_with_the_fix(tmp_path):
    spec = yaml.safe_load(SFT.read_text())
    spec["training"]["loss_kernel"] = "liger"
    spec["hardware"] = {"vendor": "cpu", "gpus": 1}
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(spec))
    code, out = cli("validate", str(path))
    assert code == 2, out
    assert "training.loss_kernel" in out and "loss_kernel: chunked" in out


GPU = {"hardware": {"vendor": "cuda", "gpus": 1}, "training": {"precision": "auto", "loss_kernel": "liger"}}


@pytest.mark.parametrize("missing", ["liger_kernel", "triton"])
def test_preflight_without_the_package_names_the_extra(tmp_path, monkeypatch, missing):
    real = preflight.find_spec
    monkeypatch.setattr(preflight, "find_spec", lambda name: None if name == missing else real(name))
    with pytest.raises(ConfigError, match=r"training.loss_kernel liger .*jobspec-k8s\[liger\].*loss_kernel: chunked"):
        preflight.check(tiny_spec(tmp_path, **GPU))


def test_preflight_passes_liger_with_the_packages(tmp_path, monkeypatch):
    real = preflight.find_spec
    present = {"liger_kernel", "triton"}
    monkeypatch.setattr(preflight, "find_spec", lambda name: ModuleSpec(name, None) if name in present else real(name))
    preflight.check(tiny_spec(tmp_path, **GPU))
