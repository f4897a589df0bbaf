"""A full, read-only or forbidden checkpoint volume: found before the write when possible, else at the
write; either way exit 74 (FailJob) with the directory and the room needed, the previous checkpoint
kept and the partial one removed."""

from __future__ import annotations

import errno
import re
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from jobspec.contract import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, EXIT_STORAGE
from runner.checkpoint import storage, store
from runner.process.supervisor import combine
from tests.runner.train_helpers import records, tiny_spec_dict, worker_in_process, write_spec

Usage = namedtuple("Usage", "total used free")
MIB = 2**20
SPEC = {"training": {"steps": 8}, "checkpoints": {"every_steps": 4}, "output": {"export": False}}


def _run(tmp_path: Path, run: Path, **sections: dict) -> tuple[int, dict]:
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run, **{**SPEC, **sections}))
    return worker_in_process(spec, tmp_path / "status.json")


def _free(monkeypatch, free_of: callable) -> None:
    """shutil.disk_usage reports `free_of()` bytes free (the pre-check's view of the volume)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 0, free_of()))


def test_no_room_at_start_exits_74_before_training(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _free(monkeypatch, lambda: MIB)
    code, status = _run(tmp_path, run)
    assert code == EXIT_STORAGE
    # The tiny model: 0.53M fp32 parameters + AdamW's two moments = about 6 MiB.
    assert status["reason"].startswith(f"no space left at {run}: needs about 6.")
    assert "MiB, has 1.00 MiB" in status["reason"] and "lower checkpoints.keep" in status["reason"]
    assert not records(run) and not list(run.glob("*step-*")) and not (run / "lease.json").exists()


def test_no_room_for_a_later_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _free(monkeypatch, lambda: MIB if (run / "step-4").exists() else 10**12)
    code, status = _run(tmp_path, run)
    assert code == EXIT_STORAGE
    need = storage.directory_bytes(run / "step-4")  # the previous checkpoint's size is the estimate
    assert status["reason"].startswith(f"no space left at {run}: needs about {storage.gib(need)}, has 1.00 MiB")
    assert store.latest(run) == run / "step-4" and store.verify(run / "step-4") is None
    assert not list(run.glob(".tmp-*")) and status["step"] == 8


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (errno.ENOSPC, "no space left at {run}: needs about"),
        (errno.EDQUOT, "no space left at {run}: needs about"),
        (errno.EROFS, "{run} is on a read-only filesystem (writing {run}/.tmp-step-8-{attempt}/__0_0.distcp)"),
        (errno.EACCES, "cannot write to {run}: Permission denied (writing {run}/.tmp-step-8-{attempt}/__0_0.distcp)"),
    ],
)
def test_an_os_error_while_writing_exits_74_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, code, says):
    """At the boundary: DCP's save raises as it would on the volume (root ignores permissions, so EACCES
    cannot be had for real here). Wrapped the way DCP reports a rank's failure."""
    run, real = tmp_path / "run", store.dcp.save

    def failing_save(state, *, storage_writer, **kwargs):
        if "step-8" not in str(storage_writer.path):
            return real(state, storage_writer=storage_writer, **kwargs)
        err = OSError(code, errno.errorcode[code] if code != errno.EACCES else "Permission denied",
                      str(storage_writer.path / "__0_0.distcp"))  # fmt: skip
        raise CheckpointException("write_data", {0: (err, None)})

    monkeypatch.setattr(store.dcp, "save", failing_save)
    exit_code, status = _run(tmp_path, run)
    attempt = re.search(r"\.tmp-step-8-(\w+)/", status["reason"])  # the temp dir is named by the attempt (its lease)
    says = says.format(run=run, attempt=attempt[1] if attempt else "?")
    assert exit_code == EXIT_STORAGE and status["reason"].startswith(says), status["reason"]
    assert store.latest(run) == run / "step-4" and store.verify(run / "step-4") is None
    assert not list(run.glob(".tmp-*")) and not (run / "lease.json").exists()


def test_a_failed_save_on_sigterm_does_not_claim_a_checkpoint(tmp_path, monkeypatch):
    """Preempted at step 3, and the checkpoint it writes then fails: 74 and the disk's reason, not 143."""
    from runner.train.recipe import Recipe

    run, real_step = tmp_path / "run", Recipe.train_step

    def stop_after_step_3(self, step):
        result = real_step(self, step)
        if step == 2:
            self.stop.signum = 15
        return result

    monkeypatch.setattr(Recipe, "train_step", stop_after_step_3)
    _free(monkeypatch, lambda: MIB if records(run) and records(run)[-1]["step"] >= 3 else 10**12)
    code, status = _run(tmp_path, run, training={"steps": 100})
    assert code == EXIT_STORAGE and status["reason"].startswith(f"no space left at {run}")
    assert "written" not in status["reason"] and store.latest(run) is None


def test_a_full_metrics_volume_is_a_storage_exit_too(tmp_path, monkeypatch):
    from runner.output.metrics import Metrics

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))

    monkeypatch.setattr(Metrics, "write", full)
    code, status = _run(tmp_path, tmp_path / "run")
    assert code == EXIT_STORAGE and status["reason"].startswith(f"no space left at {tmp_path / 'run'}: ")


def test_volume_errors_are_told_apart_from_other_errors(tmp_path):
    root = tmp_path / "run"
    inside = OSError(errno.EACCES, "Permission denied", str(root / "x"))
    assert storage.volume_error(inside, root) is inside
    assert storage.volume_error(OSError(errno.EACCES, "Permission denied", "/data/train.jsonl"), root) is None
    assert storage.volume_error(OSError(errno.ENOENT, "No such file", str(root / "x")), root) is None
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as err:
            raise RuntimeError("torch wrapped it") from err
    except RuntimeError as wrapped:
        assert storage.volume_error(wrapped, root) is full
    assert storage.volume_error(CheckpointException("save", {1: (full, None)}), root) is full
    assert storage.volume_error(RuntimeError("no disk involved"), root) is None


def test_the_supervisor_keeps_74_and_the_job_fails_at_once():
    from jobspec.render.objects import pod_failure_policy

    assert combine([EXIT_STORAGE, EXIT_FAILED])[0] == EXIT_STORAGE  # not a generic failure: FailJob
    assert combine([EXIT_OK, EXIT_STORAGE, EXIT_PREEMPTED])[0] == EXIT_STORAGE
    fail = next(r for r in pod_failure_policy()["rules"] if r["action"] == "FailJob")
    assert EXIT_STORAGE in fail["onExitCodes"]["values"]


# --- a real full filesystem ---------------------------------------------------------------------------------


@pytest.fixture
def small_volume(tmp_path):
    """A 4 MiB tmpfs (the tiny model's checkpoint needs about 6.5 MiB); skipped where mounting is not allowed."""
    volume = tmp_path / "vol"
    volume.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(volume)], capture_output=True,
                             timeout=60, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield volume
    finally:
        subprocess.run(["umount", str(volume)], timeout=60, check=False)


def test_a_real_full_volume_is_caught_by_the_check_at_start(tmp_path, small_volume):
    # the data cache elsewhere (it would take 0.3 MiB of the volume: the figures below are the checkpoint's alone)
    code, status = _run(tmp_path, small_volume / "run", data={"max_seq_len": 64, "cache_dir": str(tmp_path / "c")})
    assert code == EXIT_STORAGE
    assert status["reason"].startswith(f"no space left at {small_volume / 'run'}: needs about 6.")
    assert ", has 4.00 MiB" in status["reason"] or ", has 3.9" in status["reason"]


def test_a_real_enospc_while_writing_exits_74_and_cleans_up(tmp_path, small_volume, monkeypatch):
    monkeypatch.setattr(storage, "check_space", lambda root, need: None)  # let the write itself hit the wall
    run = small_volume / "run"
    code, status = _run(tmp_path, run, data={"max_seq_len": 64, "cache_dir": str(tmp_path / "c")})
    assert code == EXIT_STORAGE and status["reason"].startswith(f"no space left at {run}: needs about 6."), status
    assert re.search(r", has (3\.9\d|4\.00) MiB", status["reason"])  # measured after the partial write was removed
    assert store.latest(run) is None and not list(run.glob(".tmp-*"))  # the partial checkpoint is gone
    assert shutil.disk_usage(small_volume).free > 3.5 * MIB
