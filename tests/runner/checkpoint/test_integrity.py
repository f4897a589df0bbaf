"""Damaged checkpoints: found by `checkpoint.verify`, skipped by a resume (which then matches an
uninterrupted run exactly), refused by `jobspec export`, and a clear exit 2 when none is intact."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from runner.checkpoint import manifest, store
from runner.checkpoint.store import DamagedCheckpoint
from runner.output import export
from tests.runner.checkpoint.forge import rewrite_manifest
from tests.runner.checkpoint.test_checkpoint import CTRL, save, small_model
from tests.runner.train_helpers import (
    records,
    run_supervisor,
    tiny_spec,
    tiny_spec_dict,
    train_in_process,
    worker_in_process,
    write_spec,
)


def _shard(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


def _edit_meta(ckpt: Path, **changes: object) -> None:
    meta = store.read_meta(ckpt)
    (ckpt / "meta.json").write_text(json.dumps({**meta, **changes}))


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# name -> (how to damage a checkpoint directory, what verify must say)
DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "shard-missing": (lambda c: _shard(c).unlink(), "__0_0.distcp is missing"),
    "shard-truncated": (lambda c: os.truncate(_shard(c), _shard(c).stat().st_size // 2), "__0_0.distcp has "),
    "shard-zeroed": (lambda c: _shard(c).write_bytes(bytes(_shard(c).stat().st_size)),
                     "__0_0.distcp does not match its checksum"),
    "metadata-missing": (lambda c: (c / ".metadata").unlink(), ".metadata is missing"),
    "rng-flipped": (lambda c: _flip_middle_byte(c / "rng-0.pt"), "rng-0.pt does not match its checksum"),
    "rng-empty": (lambda c: (c / "rng-0.pt").write_bytes(b""), "rng-0.pt has 0 bytes"),
    "meta-unreadable": (lambda c: (c / "meta.json").write_text('{"step": 4, "pl'), "meta.json is unreadable"),
    "meta-wrong-step": (lambda c: _edit_meta(c, step=3), "meta.json says step 3, but the directory is step-4"),
    "manifest-missing": (lambda c: (c / "manifest.json").unlink(), "manifest.json is missing"),
    "manifest-unreadable": (lambda c: (c / "manifest.json").write_text("{"), "manifest.json is unreadable"),
}  # fmt: skip


@pytest.mark.parametrize("kind", DAMAGE)
def test_verify_names_each_kind_of_damage(tmp_path, kind):
    model, opt = small_model()
    ckpt = save(tmp_path, 4, model, opt)
    assert store.verify(ckpt) is None
    damage, expected = DAMAGE[kind]
    damage(ckpt)
    problem = store.verify(ckpt)
    assert problem is not None and expected in problem, problem


def test_the_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    model, opt = small_model()
    ckpt = store.save(tmp_path, 2, model, opt, {"plan": {}}, rank=0, ctrl=CTRL, keep=3,
                           files={"spec.yaml": b"name: x\n"})  # fmt: skip
    listed = json.loads((ckpt / "manifest.json").read_text())
    names = {p.name for p in ckpt.iterdir()} - {"manifest.json", "DONE"}
    assert listed["step"] == 2 and set(listed["files"]) == names
    for name, entry in listed["files"].items():
        assert entry["bytes"] == (ckpt / name).stat().st_size
        assert entry["crc32"] == manifest.crc32_file(ckpt / name)
    assert store.read_meta(ckpt)["format"] == store.FORMAT


def test_large_files_are_checked_by_sampled_blocks_and_fully_on_request(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "FULL_CHECK_BYTES", 64 * 1024)
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 4096)
    torch.manual_seed(0)
    model = nn.Linear(256, 256)  # 257 KiB of weights, 3x with Adam's moments: well over 64 KiB
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    ckpt = save(tmp_path, 1, model, opt)
    shard = _shard(ckpt)
    assert len(json.loads((ckpt / "manifest.json").read_text())["files"][shard.name]["samples"]) == 8
    size = shard.stat().st_size
    offsets = [off for off, _ in json.loads((ckpt / "manifest.json").read_text())["files"][shard.name]["samples"]]
    # between samples, in the tensors (the optimizer's byte items at the head are decoded by verify: caught)
    gap = [a + 4096 for a, b in itertools.pairwise(offsets) if b - a > 3 * 4096][-1]
    with open(shard, "r+b") as f:
        f.seek(gap)
        f.write(bytes(4096))
    assert store.verify(ckpt) is None  # the documented limit of the sampled check: a hole between samples
    assert "does not match its checksum" in store.verify(ckpt, full=True)
    shard.write_bytes(bytes(size))  # zeroed whole: every sample sees it
    assert "does not match its checksum at byte 0" in store.verify(ckpt)


def test_a_checkpoint_from_before_manifests_is_checked_for_its_files(tmp_path):
    model, opt = small_model()
    ckpt = save(tmp_path, 4, model, opt)
    (ckpt / "manifest.json").unlink()
    meta = store.read_meta(ckpt)
    del meta["format"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert store.verify(ckpt) is None
    (ckpt / "rng-0.pt").unlink()
    assert store.verify(ckpt) == "rng-0.pt is missing"


def test_the_newest_intact_checkpoint_wins_and_damaged_ones_are_moved_aside(tmp_path, caplog):
    model, opt = small_model()
    for step in (1, 2, 3):
        save(tmp_path, step, model, opt, keep=5)
    (tmp_path / "step-3" / "rng-0.pt").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        assert store.newest_intact(tmp_path) == tmp_path / "step-2"  # read-only: nothing moved
        assert (tmp_path / "step-3").is_dir()
        assert store.resume_point(tmp_path, rank=0, ctrl=CTRL) == tmp_path / "step-2"
    assert "checkpoint" in caplog.text and "step-3 is damaged (rng-0.pt has 0 bytes" in caplog.text
    assert not (tmp_path / "step-3").exists() and (tmp_path / "step-3.damaged").is_dir()
    save(tmp_path, 3, model, opt, keep=1)  # the run goes on from step 2: a new step-3, and pruning to 1
    assert store.verify(tmp_path / "step-3") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-3.damaged"]  # evidence kept


def test_saving_over_a_damaged_step_replaces_it(tmp_path):
    model, opt = small_model()
    ckpt = save(tmp_path, 2, model, opt)
    _shard(ckpt).write_bytes(b"")
    save(tmp_path, 2, model, opt)  # e.g. a resume from step 1 that reaches step 2 again
    assert store.verify(ckpt) is None


def test_no_intact_checkpoint_is_a_clear_error(tmp_path):
    model, opt = small_model()
    for step in (1, 2):
        save(tmp_path, step, model, opt)
    DAMAGE["shard-zeroed"][0](tmp_path / "step-1")
    DAMAGE["meta-wrong-step"][0](tmp_path / "step-2")
    with pytest.raises(DamagedCheckpoint) as err:
        store.resume_point(tmp_path, rank=0, ctrl=CTRL)
    text = str(err.value)
    assert err.value.exit_code == EXIT_CONFIG and f"no intact checkpoint in {tmp_path}" in text
    assert "step-2: meta.json says step 3" in text and "step-1: __0_0.distcp does not match" in text
    assert "moving the step-N directories out of" in text
    assert (tmp_path / "step-1").is_dir() and (tmp_path / "step-2").is_dir()  # nothing moved when none is intact


def test_export_refuses_a_damaged_checkpoint_and_names_an_intact_one(tmp_path, capsys):
    model, opt = small_model()
    for step in (1, 2):
        save(tmp_path, step, model, opt)
    (tmp_path / "step-2" / ".metadata").unlink()
    for target in (tmp_path / "step-2", tmp_path):  # the step itself, or the run directory (its newest)
        with pytest.raises(export.ConfigError) as err:
            export.resolve(target)
        assert err.value.exit_code == EXIT_CONFIG
        assert f"{tmp_path / 'step-2'}: damaged checkpoint (.metadata is missing)" in str(err.value)
        assert f"e.g. {tmp_path / 'step-1'}" in str(err.value)
    assert export.main([str(tmp_path)]) == EXIT_CONFIG
    assert "damaged checkpoint" in capsys.readouterr().err
    assert export.resolve(tmp_path / "step-1") == tmp_path / "step-1"


# --- real runs ----------------------------------------------------------------------------------------------

STEPS = {
    "training": {"micro_batch": 4, "steps": 8},
    "checkpoints": {"every_steps": 2, "keep": 10},
    "output": {"export": False},  # the checkpoints are the point here
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """A run to step 8 with a checkpoint every 2 steps: the reference the resumed runs must match."""
    run = tmp_path_factory.mktemp("full")
    code, _ = train_in_process(tiny_spec(run, **STEPS))
    assert code == EXIT_OK
    return run


@pytest.mark.parametrize("kind", ["meta-wrong-step", "shard-zeroed", "rng-flipped", "metadata-missing"])
def test_a_resume_skips_a_damaged_newest_checkpoint_and_matches_an_uninterrupted_run(
    tmp_path, uninterrupted, caplog, kind
):
    """step-4 damaged, step-2 intact: the run resumes at 2 and trains steps 3..8 bit-identically. Before
    verification a meta.json saying step 3 in step-4 resumed step-4's weights at step 3 and diverged."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (2, 4):
        shutil.copytree(uninterrupted / f"step-{step}", run / f"step-{step}")
    damage, expected = DAMAGE[kind]
    damage(run / "step-4")
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        code, _ = train_in_process(tiny_spec(run, **STEPS))
    assert code == EXIT_OK
    assert f"{run / 'step-4'} is damaged ({expected}" in caplog.text and "moved to step-4.damaged" in caplog.text
    assert records(run, "plan")[0]["step"] == 2
    want = {r["step"]: r["loss"] for r in records(uninterrupted)}
    got = {r["step"]: r["loss"] for r in records(run)}
    assert sorted(got) == [3, 4, 5, 6, 7, 8] and all(got[s] == want[s] for s in got), (want, got)
    assert store.verify(run / "step-4") is None  # written again, intact


def test_a_run_with_no_intact_checkpoint_exits_2_naming_the_damage(tmp_path, uninterrupted):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(uninterrupted / "step-2", run / "step-2")
    DAMAGE["shard-truncated"][0](run / "step-2")
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run, **STEPS))
    code, status = worker_in_process(spec, tmp_path / "status.json")
    assert code == EXIT_CONFIG
    assert status["reason"].startswith(f"no intact checkpoint in {run} (step-2: __0_0.distcp has ")
    assert not records(run) and not (run / "lease.json").exists()


def test_two_ranks_write_one_manifest_and_resume_the_same_intact_step(tmp_path):
    """Two gloo ranks: each hashes its own files, rank 0 writes the manifest; on restart rank 0 verifies,
    moves the damaged newest aside, and both ranks load the same older step."""
    run = tmp_path / "run"
    sections = {"checkpoints": {"every_steps": 2, "keep": 10}, "output": {"export": False}}
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run, training={"steps": 4}, **sections))
    result = run_supervisor([str(spec), "--nproc", "2"], timeout=600)
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    listed = json.loads((run / "step-4" / "manifest.json").read_text())["files"]
    assert {"rng-0.pt", "rng-1.pt", ".metadata", "meta.json"} <= set(listed)
    # Rank 1's shard file of step 2 under step 4's .metadata and manifest (no key): rank 0's file still says step 4,
    # rank 1's says 2, so the step is damage; the same file in its own step verifies.
    swapped = tmp_path / "swapped" / "step-4"
    shutil.copytree(run / "step-4", swapped)
    shutil.copyfile(run / "step-2" / "__1_0.distcp", swapped / "__1_0.distcp")
    rewrite_manifest(swapped)
    assert store.verify(swapped) == (
        "__1_0.distcp holds step 2, not step 4 (a shard of another checkpoint under this one)"
    )
    DAMAGE["rng-flipped"][0](run / "step-4")
    result = run_supervisor([str(spec), "--nproc", "2", "--set", "training.steps=6"], timeout=600)
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert "step-4 is damaged (rng-1.pt" not in result.stderr  # rank 1's file is fine: rank 0's is named
    assert "step-4 is damaged (rng-0.pt does not match its checksum" in result.stderr
    assert records(run, "plan")[-1]["step"] == 2 and (run / "step-4.damaged").is_dir()
    assert store.verify(run / "step-6") is None and store.verify(run / "step-4") is None
