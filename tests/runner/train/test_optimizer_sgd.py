"""`training.optimizer: sgd`: torch's fused SGD without momentum through the runner (runner/train/engine.py,
update.py, runner/checkpoint/store.py and lineage.py) and in the memory model (jobspec/plan/memory.py)."""

from __future__ import annotations

import pytest
import torch

from jobspec.catalog.presets import PRESETS
from jobspec.contract import EXIT_CONFIG
from jobspec.errors import ConfigError
from jobspec.plan import memory
from runner.train.update import Update, prime
from tests.runner.train_helpers import records, tiny_spec, train_and_resume, train_in_process

SGD = {"training": {"micro_batch": 4, "steps": 8, "optimizer": "sgd", "learning_rate": 0.5},
       "checkpoints": {"every_steps": 4}}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("sgd")
    full, part = train_and_resume(base, SGD)
    return base, full, part


def test_the_run_steps_with_plain_sgd_and_keeps_no_state(runs):
    _, full, _ = runs
    inner = full.optimizer.optimizer
    assert type(inner) is torch.optim.SGD and all(g["momentum"] == 0 and g["fused"] for g in inner.param_groups)
    assert not any(inner.state.values())  # no momentum buffer, no step counter


def test_it_learns(runs):
    base, _, _ = runs
    loss = {r["step"]: r["loss"] for r in records(base / "full")}
    assert loss[8] < loss[1] - 0.5, loss


def test_a_resumed_sgd_run_matches_an_uninterrupted_one_bit_for_bit(runs):
    base, full, part = runs
    a = {r["step"]: r["loss"] for r in records(base / "full")}
    b = {r["step"]: r["loss"] for r in records(base / "part")}
    assert sorted(b) == [5, 6, 7, 8] and all(b[s] == a[s] for s in b), (a, b)
    for (k, v), (_, w) in zip(full.model.state_dict().items(), part.model.state_dict().items(), strict=True):
        assert torch.equal(v, w), k


def test_one_step_is_the_clipped_gradient_times_the_learning_rate():
    """The runner's transaction (runner/train/update.py) steps SGD as torch does: p - lr * clip(g); nothing primed."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 8))
    before = p.detach().clone()
    opt = torch.optim.SGD([{"params": [p], "weight_decay": 0.0}], lr=0.1, momentum=0.0, fused=True)
    assert prime(opt, [p]) is False
    grad = torch.randn(8, 8) * 10
    p.grad = grad.clone()
    update = Update(opt, [p], world_size=1, manual_sync=False, max_grad_norm=1.0)
    prepared = update.prepare([torch.zeros(())], torch.device("cpu"))
    update.apply(prepared, 0.1)
    expected = before - 0.1 * grad * (1.0 / (grad.norm() + 1e-6))
    assert torch.allclose(p.detach(), expected, atol=1e-6) and not opt.state


def test_the_memory_model_counts_no_state_and_no_host_copies_where_only_the_optimizer_is_offloaded():
    shape = PRESETS["llama-1b"]
    kw = {"seq_len": 2048, "micro_batch": 1, "world_size": 4}
    for tier in ("fast", "zero2", "zero3"):
        adam, sgd = (memory.estimate(shape, tier=tier, optimizer=o, **kw) for o in ("adamw", "sgd"))
        assert sgd.optimizer == 0 and adam.gpu_bytes - sgd.gpu_bytes >= adam.optimizer > 0  # and its overhead share
    adam, sgd = (memory.estimate(shape, tier="zero2_offload", optimizer=o, **kw) for o in ("adamw", "sgd"))
    assert sgd.host == 0 and adam.host == 16 * adam.trainable_params // 4 and sgd.gpu_bytes == adam.gpu_bytes
    adam, sgd = (memory.estimate(shape, tier="minimal", optimizer=o, **kw) for o in ("adamw", "sgd"))
    assert adam.host - sgd.host == 8 * adam.trainable_params // 4  # fp32 shard and gradient stay on the host


def test_the_plan_says_sgd_and_a_resume_across_an_optimizer_change_is_refused(tmp_path, capsys):
    from jobspec.cli import main
    from tests.runner.train_helpers import tiny_spec_dict, write_spec

    path = write_spec(tmp_path / "spec.yaml", tiny_spec_dict(tmp_path / "run", training={"optimizer": "sgd"}))
    assert main(["plan", str(path), "--gpu-memory", "24Gi"]) == 0
    assert "optimizer: sgd (training.optimizer): plain SGD" in capsys.readouterr().out
    run = tmp_path / "adam"
    code, _ = train_in_process(tiny_spec(run, training={"micro_batch": 4, "steps": 4}, checkpoints={"every_steps": 4}))
    assert code == 0
    sgd = {"training": {"micro_batch": 4, "steps": 8, "optimizer": "sgd"}, "checkpoints": {"every_steps": 4}}
    with pytest.raises(ConfigError, match=r"training\.optimizer: checkpoint None, spec now 'sgd'") as err:
        train_in_process(tiny_spec(run, **sgd))
    assert err.value.exit_code == EXIT_CONFIG
    code, _ = train_in_process(tiny_spec(run, **{**sgd, "checkpoints": {"every_steps": 4, "resume": "force"}}))
    assert code == 0  # forced: the weights resumed, AdamW's moments left behind
    assert [r["step"] for r in records(run)][-1] == 8


def test_two_ranks_step_sgd_on_fsdp2s_shards_as_one_process_steps_it_whole(tmp_path, runs):
    """zero3 on two gloo ranks: the foreach step on DTensor shards (torch's fused SGD kernel has no sharding rule)
    trains as the one-process fused run of the module fixture does, loss for loss."""
    import subprocess
    import sys

    from tests.runner.train_helpers import ROOT, runner_env, timeout_s, tiny_spec_dict, write_spec

    base, _, _ = runs
    spec = {**tiny_spec_dict(tmp_path / "run", **{**SGD, "memory": {"tier": "zero3"}}),
            "hardware": {"vendor": "cpu", "gpus": 2}}  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "runner", str(write_spec(tmp_path / "spec.yaml", spec))], cwd=ROOT,
                            env=runner_env(), capture_output=True, text=True, timeout=timeout_s(300))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "SGD without momentum" in result.stderr
    (plan,) = records(tmp_path / "run", "plan")
    assert (plan["tier"], plan["world_size"]) == ("zero3", 2)
    one = {r["step"]: r["loss"] for r in records(base / "full")}
    two = {r["step"]: r["loss"] for r in records(tmp_path / "run")}
    assert sorted(two) == sorted(one) and all(two[s] == pytest.approx(one[s], rel=1e-4) for s in one), (one, two)
