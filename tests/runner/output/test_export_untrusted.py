"""`jobspec export` of a checkpoint others could write: a forged pickle, a link or a FIFO in place of a file is a
damaged checkpoint, exit 2 naming the file, no code run, nothing written, never a hang.

Before: a forged .metadata ran its code (exit 2 after it ran); a shard, .metadata, meta.json or spec.yaml linked to
/dev/zero or replaced by a FIFO hung the export. The attacks: tests/runner/checkpoint/forge.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from runner.output import export
from tests.runner.checkpoint.forge import (
    evil_pickles,
    evil_torch_file,
    forge_bytes_item,
    replace,
    rewrite_manifest,
    unblock_fifos,
    within,
)
from tests.runner.train_helpers import ROOT, runner_env, timeout_s, tiny_spec, train_in_process

HANG_S = 60.0  # an export of the tiny model takes a few seconds


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real run with checkpoints at steps 2 and 4 (no export of its own)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    sections = {"training": {"micro_batch": 4, "steps": 4}, "checkpoints": {"every_steps": 2, "keep": 10},
                "output": {"export": False}}  # fmt: skip
    assert train_in_process(tiny_spec(run, **sections))[0] == EXIT_OK
    return run


@pytest.fixture
def run(tmp_path, trained) -> Path:
    copy = tmp_path / "run"
    copy.mkdir()
    for step in (2, 4):
        shutil.copytree(trained / f"step-{step}", copy / f"step-{step}")
    yield copy
    unblock_fifos(tmp_path)


# attack -> (what it does to step-4, the file and damage the error names)
ATTACKS = {
    "metadata-pickle": (lambda c, m: (c / ".metadata").write_bytes(evil_pickles(m)["os.system"]),
                        ".metadata is not DCP metadata (it names posix.system"),
    "metadata-exec": (lambda c, m: (c / ".metadata").write_bytes(evil_pickles(m)["exec"]),
                      ".metadata is not DCP metadata (it names builtins.exec"),
    "byte-item-pickle": (forge_bytes_item, "__0_0.distcp: the stored value of optim.param_groups.0.lr"),
    "rng-pickle": (lambda c, m: (c / "rng-0.pt").write_bytes(evil_torch_file(m)), "rng-0.pt is not an RNG state"),
    "shard-devzero": (lambda c, m: replace(c / "__0_0.distcp", "devzero"), "__0_0.distcp is a symbolic link"),
    "shard-fifo": (lambda c, m: replace(c / "__0_0.distcp", "fifo"), "__0_0.distcp is a FIFO"),
    "shard-dir": (lambda c, m: replace(c / "__0_0.distcp", "dir"), "__0_0.distcp is a directory"),
    "shard-link-out": (lambda c, m: replace(c / "__0_0.distcp", "link-out", m.with_name("copy.distcp")),
                       "__0_0.distcp is a symbolic link"),
    "metadata-devzero": (lambda c, m: replace(c / ".metadata", "devzero"), ".metadata is a symbolic link"),
    "metadata-fifo": (lambda c, m: replace(c / ".metadata", "fifo"), ".metadata is a FIFO"),
    "meta-json-fifo": (lambda c, m: replace(c / "meta.json", "fifo"), "meta.json is a FIFO"),
    "spec-yaml-fifo": (lambda c, m: replace(c / "spec.yaml", "fifo"), "spec.yaml is a FIFO"),
    "spec-yaml-devzero": (lambda c, m: replace(c / "spec.yaml", "devzero"), "spec.yaml is a symbolic link"),
}  # fmt: skip


@pytest.mark.parametrize("attack", ATTACKS)
def test_export_refuses_a_forged_linked_or_piped_checkpoint_naming_the_file(tmp_path, run, capsys, attack):
    marker, ckpt, out = tmp_path / "PWNED", run / "step-4", tmp_path / "out"
    forge, expected = ATTACKS[attack]
    forge(ckpt, marker)
    rewrite_manifest(ckpt)  # the forger can write the volume: the CRC manifest matches the forged files
    code = within(HANG_S, lambda: export.main([str(ckpt), "--out", str(out)]), "export")
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG, err
    assert f"error: {ckpt}: damaged checkpoint ({expected}" in err, err
    assert "Traceback" not in err and "weights_only` set to `False`" not in err  # torch's unsafe advice left out
    assert not marker.exists() and not out.exists()
    assert f"e.g. {run / 'step-2'}" in err  # an intact one is named
    assert within(HANG_S, lambda: export.main([str(run / "step-2"), "--out", str(out)]), "export") == EXIT_OK


@pytest.mark.parametrize("attack", ["metadata-pickle", "shard-fifo"])
def test_jobspec_export_exits_2_in_its_own_process_within_its_time(tmp_path, run, attack):
    """The command as `jobspec export` runs it, killed with its process group if it hangs."""
    marker, ckpt = tmp_path / "PWNED", run / "step-4"
    ATTACKS[attack][0](ckpt, marker)
    rewrite_manifest(ckpt)
    cmd = [sys.executable, "-m", "runner.output.export", str(ckpt), "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=runner_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    limit = timeout_s(120)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"export hung (killed after {limit:g} s)") from None
    assert proc.returncode == EXIT_CONFIG, err[-2000:]
    assert ATTACKS[attack][1] in err and not marker.exists()


def test_export_of_a_run_directory_whose_newest_checkpoint_is_forged_names_it(tmp_path, run, capsys):
    marker = tmp_path / "PWNED"
    ATTACKS["metadata-pickle"][0](run / "step-4", marker)
    rewrite_manifest(run / "step-4")
    assert export.main([str(run), "--out", str(tmp_path / "out")]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"{run / 'step-4'}: damaged checkpoint (.metadata is not DCP metadata" in err and not marker.exists()


def test_a_provenance_file_that_is_a_fifo_reads_as_none(tmp_path):
    os.mkfifo(tmp_path / export.PROVENANCE)
    assert within(HANG_S, lambda: export.read_provenance(tmp_path), "read_provenance") is None
    unblock_fifos(tmp_path)
