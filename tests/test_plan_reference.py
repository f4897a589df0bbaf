"""`jobspec plan` for preference objectives: a pair's step is two rows of tokens, and DPO's reference pass (one
forward of the starting model over every pair, before training) is timed by the step's own FLOPs model and printed
beside the training time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jobspec.catalog import gpus
from jobspec.plan import throughput
from jobspec.plan.output import plan_table
from jobspec.plan.planner import lora_shape, plan_spec
from jobspec.spec.loader import parse_spec
from tests.cli_helpers import cli

PAIRS = 3000


def spec_dict(tmp_path: Path, objective: str = "dpo", **data) -> dict:
    path = tmp_path / "pairs.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"prompt": f"p{i}", "chosen": "a", "rejected": "b"}) + "\n"
                                for i in range(PAIRS)))  # fmt: skip
    return {"name": "pref", "model": {"preset": "llama-1b"},
            "data": {"path": str(path), "max_seq_len": 1024, **data},
            "training": {"objective": objective, "global_batch": 32, "epochs": 1},
            "hardware": {"gpus": "H100:2"}, "checkpoints": {"pvc": "ck"}}  # fmt: skip


def spec(tmp_path: Path, objective: str = "dpo", **data):
    return parse_spec(yaml.safe_dump(spec_dict(tmp_path, objective, **data)))


def test_the_reference_pass_is_a_forward_over_every_pairs_two_rows(tmp_path):
    report = plan_spec(spec(tmp_path))
    s = 1024
    assert report.length.reference_tokens == PAIRS * 2 * s  # held-out pairs too: the pass scores the whole source
    full = throughput.flops_per_token(report.shape, s, lora=None, checkpointing=False).model
    forward = throughput.forward_flops(report.shape, s, lora=None)
    assert forward == pytest.approx(full / 3)
    peak = gpus.lookup("H100").tflops16 * 1e12
    assert report.reference and set(report.reference) == set(report.times)
    for tier, seconds in report.reference.items():
        assert seconds == pytest.approx(PAIRS * 2 * s * forward / (2 * peak * throughput.EFFICIENCY[tier]))
        # a third of the work of a training pass over as many tokens at the same tier, without recomputation
        step = report.times[tier]
        per_token = step.step_seconds / report.length.tokens_per_step
        recompute = throughput.flops_per_token(report.shape, s, lora=None, checkpointing=True).total / full
        ckpt = next(p for p in report.plans if p.tier == tier).estimate.checkpointing
        assert seconds == pytest.approx(per_token * PAIRS * 2 * s / 3 / (recompute if ckpt else 1.0))
    data = report.to_dict()
    assert data["reference_tokens"] == PAIRS * 2 * s and data["tiers"][0]["reference_seconds"] is not None


def test_a_pairs_step_is_two_rows_and_only_reference_objectives_have_a_reference_pass(tmp_path):
    """A pair is two rows, and so is a KTO record (its completion and its KL row); DPO, IPO and KTO score against the
    starting model, once before training, over every sample's two rows."""
    sft_dict = spec_dict(tmp_path, "sft")
    sft_dict["data"]["path"] = None
    sft = plan_spec(parse_spec(yaml.safe_dump(sft_dict)))
    for objective in ("dpo", "ipo", "simpo", "orpo", "kto"):
        pref = plan_spec(spec(tmp_path, objective))
        assert pref.length.tokens_per_step == 2 * sft.length.tokens_per_step == 2 * 32 * 1024
        tier = pref.chosen.tier
        if tier in sft.times:
            sft_tokens = sft.times[tier].step_seconds / sft.length.tokens_per_step
            assert pref.times[tier].step_seconds / pref.length.tokens_per_step == pytest.approx(sft_tokens)
        scored = objective in ("dpo", "ipo", "kto")
        assert bool(pref.reference) == scored
        assert pref.length.reference_tokens == (PAIRS * 2 * 1024 if scored else None)
        table = plan_table(pref)
        assert ("ref pass" in table) == scored
        what = "records x 2 rows (with the KL row)" if objective == "kto" else "pairs x 2 rows"
        assert f"tokens/step 32 {what} x 1024" in table
        if scored:
            assert f"ref pass ({objective.upper()}, once before training)" in table


def test_plan_prints_the_reference_pass_beside_the_training_time(tmp_path):
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(spec_dict(tmp_path, "dpo", eval_path=str(tmp_path / "pairs.jsonl"))))
    code, out = cli("plan", str(path))
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.startswith("tier "))
    assert header.split()[header.split().index("time") + 1 : header.split().index("time") + 3] == ["ref", "pass"]
    report = plan_spec(parse_spec(path.read_text()))
    row = next(line for line in out.splitlines() if line.startswith(report.chosen.tier + " "))
    assert throughput.format_duration(report.reference[report.chosen.tier]) in row
    assert f"over {2 * PAIRS:,} pairs x 2 rows x 1024 tokens = {4 * PAIRS * 1024:,} tokens" in out  # + eval_path's
    forward = throughput.forward_flops(report.shape, 1024, lora=lora_shape(report.spec))
    assert f"{forward / 1e9:,.2f} GFLOP/token (33% of a step's)" in out


def test_pairs_not_countable_here_ask_for_rows(tmp_path):
    d = spec_dict(tmp_path)
    d["data"]["path"] = "/nowhere/pairs.parquet"
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(d))
    code, out = cli("plan", str(path))
    assert code == 0 and "pairs unknown" in out and "pass --rows N" in out, out
    code, out = cli("plan", str(path), "--rows", "1000")
    assert code == 0 and "over 1,000 pairs x 2 rows x 1024 tokens" in out, out
