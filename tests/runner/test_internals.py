"""runner/internals/: every private framework name in one package, checked before a tier is built.

An internal that a run needs and the installed version lacks is simulated by deleting it; the run must
stop with one message that names the package, its version, the internal and a fix (exit 2), never an
AttributeError in the middle of training. An internal with a fallback only logs what is lost.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.state import AcceleratorState, PartialState

from jobspec.catalog.tiers import TIERS
from jobspec.contract import EXIT_CONFIG
from jobspec.errors import ConfigError
from runner import internals
from runner.internals import versions
from tests.runner.train_helpers import tiny_spec_dict, worker_in_process, write_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_this_install_has_every_internal(tier: str, world_size: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        internals.check(tier, world_size, "cpu")
    assert "lacks" not in caplog.text
    assert "the versions jobspec's internals were checked on" not in caplog.text  # CI's torches are in CHECKED


def test_a_torch_without_reset_iter_state_gets_the_reset_by_hand(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch 2.11 (the H200's) and 2.12 have no FSDPModule.reset_iter_state: the start-up check takes the reset by
    hand instead of warning that an OOM restarts the workers (it did on 2.11, where every OOM became exit 75)."""
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "reset_iter_state", raising=False)
    monkeypatch.setattr(internals, "_warned", set())
    assert internals.fsdp_reset_way() == "by hand"
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        internals.check("zero2", 1, "cpu")
    assert "lacks" not in caplog.text


@pytest.mark.parametrize(
    ("now", "relation"),
    [("2.14.1+cu130", None), ("2.11.0", None), ("2.13.0+cpu", None), ("2.12.1", "between"),
     ("2.15.0", "newer than"), ("3.0.0.dev20270101", "newer than"), ("2.10.2", "older than")],
)  # fmt: skip
def test_a_version_is_placed_among_the_checked_ones(monkeypatch: pytest.MonkeyPatch, now: str, relation: str) -> None:
    monkeypatch.setitem(internals.CHECKED, "torch", "2.11, 2.13, 2.14")
    monkeypatch.setattr(versions, "installed", lambda dist: now)
    assert versions.unchecked("torch") == relation


@pytest.mark.parametrize(("checked", "relation"), [("1.0", "newer than"), ("99.0", "older than")])
def test_a_torch_not_checked_is_tried_and_said_once_with_what_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, checked: str, relation: str
) -> None:
    monkeypatch.setitem(internals.CHECKED, "torch", checked)
    monkeypatch.setattr(internals, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        internals.check("zero3", 2, "cpu")  # goes on: nothing required is missing
        internals.check("zero2", 2, "cpu")
    # torch's line only: the floors leg (transformers 4.56) logs one for transformers as well
    lines = [r.getMessage() for r in caplog.records if "checked on" in r.getMessage()]
    lines = [line for line in lines if line.startswith("torch ")]
    assert len(lines) == 1, lines
    assert f"torch {internals.installed('torch')} is {relation} the versions" in lines[0]
    assert f"({checked})" in lines[0] and "trying them anyway" in lines[0]
    assert "an OOM shrink restarts the workers" in lines[0] and "a rank-local OOM restarts all ranks" in lines[0]
    assert "FSDP2's OOM reset is done by " in lines[0]


def test_a_missing_required_internal_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(AcceleratorState, "_reset_state")
    with pytest.raises(ConfigError) as err:
        internals.check("fast", 1, "cpu")
    msg = str(err.value)
    assert "accelerate" in msg and "AcceleratorState._reset_state" in msg
    assert internals.installed("accelerate") in msg  # the installed version
    assert "checked on accelerate" in msg and "pip install" in msg


def test_an_internal_only_some_tiers_need_is_checked_for_those(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(PartialState, "_shared_state")
    internals.check("fast", 1, "cpu")  # DDP/one process: not needed
    with pytest.raises(ConfigError, match=r"PartialState\._shared_state"):
        internals.check("zero3", 1, "cpu")


def test_a_missing_internal_with_a_fallback_only_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(internals, "fsdp_comm_bases", lambda: None)
    monkeypatch.setattr(internals, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        internals.check("zero3", 2, "cpu")
        internals.check("zero3", 2, "cpu")
    lines = [r.getMessage() for r in caplog.records if "AllGather" in r.getMessage()]
    assert len(lines) == 1 and "a rank-local OOM restarts all ranks" in lines[0]


def test_torchao_without_the_parts_hostadamw_reads() -> None:
    partial = SimpleNamespace(optim_dict={}, param_d2h_map={}, queue={})  # no stream, no device
    with pytest.raises(ConfigError, match=r"torchao .* lacks CPUOffloadOptimizer.stream/device.*zero2_offload"):
        internals.offload_parts(partial)


def test_torchaos_8bit_adamw_has_what_the_runner_reads_of_it() -> None:
    """`training.optimizer: adamw_8bit` (runner/internals/lowbit.py) on this torch and torchao: the state its first
    step makes, made before it (8-bit for a tensor of 4096 values or more, fp32 below), read out as fp32 values and
    written back into the same codes and scales; without `_new_buffer` one clear error."""
    import torch

    pytest.importorskip("torchao.optim")
    big, small = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(128))
    optimizer = internals.adamw_8bit([{"params": [big, small]}], 1e-3, (0.9, 0.999))
    assert internals.is_low_bit(optimizer) and not internals.is_low_bit(torch.optim.AdamW([small]))
    state, plain = internals.new_state(optimizer, big), internals.new_state(optimizer, small)
    assert internals.is_quantized(state["exp_avg"]) and not internals.is_quantized(plain["exp_avg"])
    state["exp_avg"].copy_(torch.randn(64, 128))
    back = internals.new_state(optimizer, big)["exp_avg"]
    internals.requantize_into(back, internals.dequantized(state["exp_avg"]))
    assert torch.equal(back.codes, state["exp_avg"].codes) and torch.equal(back.scale, state["exp_avg"].scale)
    internals.set_lr(optimizer, 0.5)
    assert torch.is_tensor(optimizer.param_groups[0]["lr"]) and float(optimizer.param_groups[0]["lr"]) == 0.5
    with pytest.raises(ConfigError, match=r"torchao .* lacks _AdamBase._new_buffer.*adamw_8bit"):
        internals.new_state(SimpleNamespace(), big)


def test_a_run_without_the_internal_stops_at_start_with_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(AcceleratorState, "_reset_state")
    spec = write_spec(tmp_path / "spec.yaml", tiny_spec_dict(tmp_path / "run"))
    code, status = worker_in_process(spec, tmp_path / "status.json")
    assert code == EXIT_CONFIG
    assert "AcceleratorState._reset_state" in status.get("message", str(status))
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or "train" not in (
        tmp_path / "run" / "metrics.jsonl"
    ).read_text()


def test_only_the_adapter_names_private_framework_internals() -> None:
    """The same rule lint-imports enforces in CI (tests/import_contracts.py), so a plain pytest sees it too."""
    out = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "private framework names only through runner.internals KEPT" in " ".join(out.stdout.split())


def test_transformers_builds_a_model_without_importing_torchao_when_told_so(tmp_path) -> None:
    """The worker answers transformers' torchao check "absent" (runner/internals/imports.py): where torchao is
    installed (the GPU images, CI's dev install), a model class no longer imports it (about 2.6 s of CPU a start).
    Too late once transformers' modeling modules are imported: nothing is changed then."""
    import subprocess
    import sys

    code = """
import sys
from runner import internals
assert internals.keep_torchao_out_of_transformers()
from transformers import AutoModelForCausalLM, GPT2Config
AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
assert not internals.keep_torchao_out_of_transformers()  # modeling imported: too late, nothing changed
print("torchao" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


def test_a_torchao_quantized_checkpoint_keeps_transformers_integration(tmp_path) -> None:
    import json

    from runner.process.worker import torchao_quantized

    assert not torchao_quantized(None) and not torchao_quantized(str(tmp_path / "none"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not torchao_quantized(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "torchao"}}))
    assert torchao_quantized(str(tmp_path))
    (tmp_path / "config.json").write_text("{")
    assert torchao_quantized(str(tmp_path))  # unreadable: left as it is


def test_torch_says_when_it_compiles_and_the_callbacks_come_off() -> None:
    """dynamo's callback handler (runner/internals/compiling.py) on this torch: a compilation calls start then end
    with what and its id; after `remove` nothing is called, and `remove` after `torch.compiler.reset()` (which clears
    the handler) does not fail."""
    import torch

    assert internals.compile_handler() is not None
    seen: list[tuple[str, str, str]] = []
    remove = internals.on_compilations(lambda what, cid: seen.append(("start", what, cid)),
                                       lambda what, cid: seen.append(("end", what, cid)))  # fmt: skip
    assert remove is not None
    try:
        torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
        assert seen[0][:2] == ("start", "a graph") and seen[-1][0] == "end" and seen[0][2] == seen[-1][2]
        remove()
        seen.clear()
        torch.compile(lambda x: x * 3 - 1, backend="eager")(torch.ones(3))
        assert seen == []
        again = internals.on_compilations(lambda *a: None, lambda *a: None)
        torch.compiler.reset()
        again()
    finally:
        remove()
        torch.compiler.reset()
