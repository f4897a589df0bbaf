"""Paper cuts a new user met in the first hour (issue 43, item 9), each refused or said where it happens."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jobspec.plan.planner import plan_spec
from jobspec.spec.loader import load_spec
from tests.cli_helpers import cli

FAMILIES = Path(__file__).resolve().parents[1] / "examples" / "families"
BASE = {"name": "demo", "model": {"preset": "tiny"}, "training": {"global_batch": 24, "steps": 10}}


def _spec(tmp_path: Path, text: str) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("gpus", "says"), [("4090:2", "did you mean RTX4090"), ("RTX4090:2", None)])
def test_a_type_count_pair_is_never_read_as_a_base_60_number(tmp_path, gpus, says):
    """YAML 1.1 reads `4090:2` as 4090 * 60 + 2 = 245402: 'count at most 64' hid the real mistake (the type)."""
    path = _spec(tmp_path, yaml.safe_dump(BASE) + f"hardware:\n  vendor: cuda\n  gpus: {gpus}\n")
    code, out = cli("validate", path)
    if says is None:
        assert code == 0, out
        assert load_spec(path).hardware.gpus.count == 2
    else:
        said = out.replace(path, "<spec>")  # the message, not the temporary path (pytest-264 holds a 64)
        assert code == 2 and says in said and "at most 64" not in said and "64" not in said, out


def test_steps_over_an_epochs_spec_says_how_to_drop_the_epochs(tmp_path):
    path = _spec(tmp_path, yaml.safe_dump({**BASE, "training": {"global_batch": 8, "epochs": 2}}))
    code, out = cli("validate", path, "--set", "training.steps=5")
    assert code == 2 and "--set training.epochs=null" in out, out
    assert cli("validate", path, "--set", "training.steps=5", "--set", "training.epochs=null")[0] == 0


@pytest.mark.parametrize(("gpus", "nodes", "ok"), [("A100:9", 1, False), ("H100:16", 1, False), ("A100:8", 2, True),
                                                   ("V100:16", 1, True), ("L4:10", 1, True)])  # fmt: skip
def test_more_gpus_on_one_node_than_any_server_holds_is_refused_with_the_split(tmp_path, gpus, nodes, ok):
    hw = f"hardware:\n  vendor: cuda\n  gpus: {gpus}\n  nodes: {nodes}\n"
    total = int(gpus.split(":")[1]) * nodes
    spec = {**BASE, "training": {"global_batch": 48 * total, "steps": 10}}
    code, out = cli("validate", _spec(tmp_path, yaml.safe_dump(spec) + hw))
    assert (code == 0) == ok, out
    if not ok:
        assert "hardware.gpus.count" in out and "no server holds more than 8" in out and "hardware.nodes" in out


def test_a_tier_that_needs_more_host_memory_than_the_pod_has_does_not_fit(tmp_path):
    """A Mixtral full fine-tune on one L4 'fit' at minimal with 695.9 GiB of host memory beside hardware.memory 64Gi."""
    sets = ["model.lora=null", "hardware.gpus=L4:1", "hardware.nodes=1", "training.global_batch=8"]
    spec = load_spec(FAMILIES / "mixtral-8x7b-lora.yaml", [*sets, "hardware.memory=64Gi"])
    minimal = next(p for p in plan_spec(spec).plans if p.tier == "minimal")
    assert not minimal.fits and "host memory" in minimal.reason and "hardware.memory 64 GiB" in minimal.reason
    unknown = next(p for p in plan_spec(load_spec(FAMILIES / "mixtral-8x7b-lora.yaml", sets)).plans
                   if p.tier == "minimal")  # fmt: skip
    assert unknown.fits and "set hardware.memory" in unknown.note  # the pod's memory is unknown: said, not assumed
    roomy = load_spec(FAMILIES / "mixtral-8x7b-lora.yaml", [*sets, "hardware.memory=1Ti"])
    assert next(p for p in plan_spec(roomy).plans if p.tier == "minimal").fits
