"""`jobspec plan`'s memory output: the named terms, the spec's own micro-batch, and `--trace` against the model."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import yaml

from jobspec.errors import ConfigError
from jobspec.plan import traced
from tests.cli_helpers import cli, run_cli

ROOT = Path(__file__).resolve().parents[1]
SFT = str(ROOT / "examples" / "sft_fast.yaml")
TERMS = ["weights", "gradients", "optimizer", "buckets", "working_weights", "activations", "logits", "overhead"]


def plan_json(*args: str) -> dict:
    code, out = cli("plan", *args, "-o", "json")
    assert code == 0, out
    return json.loads(out)


def test_every_tier_has_named_terms_that_sum_to_its_bytes() -> None:
    for tier in plan_json(SFT)["tiers"]:
        assert list(tier["gpu_breakdown"]) == TERMS
        assert sum(tier["gpu_breakdown"].values()) == tier["gpu_bytes"]
        assert tier["gpu_breakdown"]["overhead"] >= 1024**3  # the fixed context share
        assert tier["margin_bytes"] == tier["budget_bytes"] - tier["gpu_bytes"]
        assert tier["micro_batch_fixed"] is False


def test_the_spec_micro_batch_is_reported_for_every_tier(tmp_path: Path) -> None:
    spec = yaml.safe_load(Path(SFT).read_text())
    spec["training"]["micro_batch"] = 16
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = plan_json(str(path))
    tiers = {t["tier"]: t for t in out["tiers"]}
    assert all(t["micro_batch"] == 16 and t["micro_batch_fixed"] for t in tiers.values())
    for t in tiers.values():  # fits exactly when the bytes at 16 are within the budget, and says by how much
        assert t["fits"] == (t["margin_bytes"] >= 0)
        assert t["grad_accum"] == 32 // 2 // 16
    short = [t for t in tiers.values() if not t["fits"]]
    assert short and all("micro-batch 16 (spec) needs" in t["note"] and "short" in t["note"] for t in short)
    assert out["tier"] == next(t["tier"] for t in out["tiers"] if t["fits"] and t["useful"])  # auto picks from it
    code, table = cli("plan", str(path))
    assert code == 0 and "micro-batch 16 from the spec (training.micro_batch)" in table


def test_trace_without_the_runner_packages_says_what_to_install() -> None:
    hide_torch = mock.patch.object(traced, "find_spec", side_effect=lambda name: None if name == "torch" else object())
    with hide_torch, pytest.raises(ConfigError, match=r"needs torch.*pip install 'jobspec-k8s\[trace\]'"):
        traced.trace_tiers(SFT, [], [], 2, "bf16")


def test_plan_trace_table_shows_traced_beside_model() -> None:
    def fake(spec_path, overrides, plans, world_size, precision):  # what runner.train.trace prints, per tier
        return {p.tier: {"tier": p.tier, "micro_batch": max(1, p.micro_batch), "peak": 2 * 1024**3, "host": 0,
                         "parts": {}, "seconds": 1.0} for p in plans}  # fmt: skip

    with mock.patch.object(traced, "trace_tiers", fake):
        code, table = cli("plan", SFT, "--trace")
    assert code == 0, table
    assert "traced (--trace)" in table and "traced    2.00" in table


@pytest.mark.slow
def test_plan_trace_puts_the_traced_step_beside_the_model(tmp_path: Path) -> None:
    """The runner's own step on fake tensors, tier by tier, in a subprocess: the model within 10 % of it."""
    spec = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    spec["model"] = {"preset": "gpt2-small"}
    spec["data"]["max_seq_len"] = 256
    spec["training"].update(global_batch=16, precision="bf16")
    spec["hardware"] = {"vendor": "cuda", "gpus": "A100-80GB:2"}
    spec["memory"] = {"tier": "auto"}
    path = tmp_path / "trace.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = run_cli("plan", str(path), "--trace", "-o", "json", "--set", "training.global_batch=32")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["global_batch"] == 32  # --set reached the plan (and the trace's own process)
    for tier in out["tiers"]:
        assert tier["traced_micro_batch"] == max(1, tier["micro_batch"])
        model = tier["gpu_bytes"] - tier["gpu_breakdown"]["overhead"]
        assert abs(model / tier["traced_gpu_bytes"] - 1) < 0.10, (tier["tier"], model, tier["traced_gpu_bytes"])
        assert tier["model_over_traced"] == pytest.approx(model / tier["traced_gpu_bytes"], abs=1e-4)
