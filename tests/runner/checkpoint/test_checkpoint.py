"""Checkpoints: round trip, DONE marker, pruning, existing targets, and crashes while writing.

Damage, verification and resume from the newest intact one: tests/runner/checkpoint/test_integrity.py."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from runner.checkpoint import store
from runner.checkpoint.storage import StorageError
from runner.dist import Control
from tests.runner.train_helpers import ROOT, runner_env

CTRL = Control(1)


def small_model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A two-layer net with one Adam step taken, so the optimizer has moments to save."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def save(root, step, model, opt, keep=3):
    return store.save(root, step, model, opt, {"plan": {}}, rank=0, ctrl=CTRL, keep=keep)


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    model, opt = small_model()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    path = save(tmp_path, 7, model, opt)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    fresh, fresh_opt = small_model(seed=99)
    meta = store.load(path, fresh, fresh_opt, rank=0, ctrl=CTRL)
    assert meta["step"] == 7 and (path / "DONE").is_file()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))
    for p, q in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_only_marked_checkpoints_count_and_keep_prunes(tmp_path):
    model, opt = small_model()
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model, opt, keep=2)
    assert [s for s, _ in store.complete(tmp_path)] == [3, 4]
    (tmp_path / "step-9").mkdir()  # renamed but never marked: a writer died between rename and DONE
    (tmp_path / ".tmp-step-10").mkdir()
    assert store.latest(tmp_path) == tmp_path / "step-4"
    save(tmp_path, 12, model, opt, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-12", "step-4"]  # the unmarked older dir and the stale temp dir are gone


def test_an_existing_target_is_tolerated(tmp_path):
    model, opt = small_model()
    first = save(tmp_path, 5, model, opt)
    stamp = (first / "meta.json").stat().st_mtime_ns
    save(tmp_path, 5, model, opt)  # the same step again (e.g. SIGTERM right after a periodic save): kept
    assert (first / "meta.json").stat().st_mtime_ns == stamp and not list(tmp_path.glob(".tmp-*"))
    (first / "DONE").unlink()  # an incomplete step-5 from an older attempt: replaced
    save(tmp_path, 5, model, opt)
    assert (first / "DONE").is_file() and store.latest(tmp_path) == first


def test_an_error_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = small_model()
    good = save(tmp_path, 1, model, opt)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_publish", disk_full)
    with pytest.raises(StorageError, match=f"no space left at {tmp_path}"):
        save(tmp_path, 2, model, opt)
    assert store.latest(tmp_path) == good and store.verify(good) is None
    assert not (tmp_path / ".tmp-step-2").exists()  # the partial checkpoint is cleaned up
    monkeypatch.undo()
    assert save(tmp_path, 2, model, opt) == tmp_path / "step-2"
    assert not (tmp_path / ".tmp-step-2").exists()


def test_an_unrelated_error_while_writing_is_not_a_storage_error(tmp_path, monkeypatch):
    model, opt = small_model()

    def bug(*args, **kwargs):
        raise RuntimeError("a bug, not the disk")

    monkeypatch.setattr(store, "_publish", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        save(tmp_path, 1, model, opt)


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from runner.checkpoint import store
    from tests.runner.checkpoint.test_checkpoint import CTRL, small_model

    root, where = sys.argv[1], sys.argv[2]
    model, opt = small_model()
    store.save(root, 1, model, opt, {{}}, rank=0, ctrl=CTRL, keep=3)
    real = getattr(store, where)

    def pause(*args, **kwargs):
        if where == "rng_state" or str(args[0]).endswith("DONE"):
            print("PAUSED", flush=True)
            time.sleep(120)
        return real(*args, **kwargs)

    setattr(store, where, pause)
    model[0].weight.data += 1.0
    store.save(root, 2, model, opt, {{}}, rank=0, ctrl=CTRL, keep=3)
""")


@pytest.mark.parametrize("where", ["rng_state", "_write_durable"])
def test_sigkill_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, where):
    """Killed inside the temp dir (rng_state) or after the rename, before DONE (_write_durable)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER.format(), str(tmp_path), where],
        cwd=ROOT,
        env=runner_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "PAUSED"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    leftover = tmp_path / (".tmp-step-2" if where == "rng_state" else "step-2")
    assert leftover.is_dir() and not (leftover / "DONE").exists()
    assert store.latest(tmp_path) == tmp_path / "step-1"
    model, opt = small_model(seed=5)
    assert store.load(tmp_path / "step-1", model, opt, rank=0, ctrl=CTRL)["step"] == 1
    expected, _ = small_model()
    assert torch.equal(model[0].weight, expected[0].weight)  # step 1's weights, not the +1 of step 2
    save(tmp_path, 3, model, opt)
    assert not leftover.exists() and store.latest(tmp_path) == tmp_path / "step-3"
