"""Fencing by the run directory's lease: a rank of an attempt the gang left behind writes nothing.

Every rank learns at start which lease stands for its attempt (rank 0's holder, `Control.from_rank0`), and checks
before each shared write that the run directory still holds it (`lease.check_holder`), inside the checkpoint
protocol too: before each phase and right before the rename that publishes. A checkpoint's temp dir is named by
the attempt, so a rank that wakes mid-save writes into a directory no later attempt publishes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from jobspec.contract import EXIT_FAILED
from jobspec.errors import ConfigError
from runner.checkpoint import store
from runner.checkpoint.lease import LEASE_FILE, Lease, LeaseLost, Superseded, check_holder
from runner.dist import Control
from tests.runner.train_helpers import ROOT, Drained, runner_env


def test_the_attempt_that_holds_the_lease_writes_and_any_other_is_superseded(tmp_path):
    lease = Lease(tmp_path, "job-a")
    lease.acquire()
    check_holder(tmp_path, lease.holder, "job-a")  # still this attempt's
    with pytest.raises(Superseded, match="earlier attempt") as err:
        check_holder(tmp_path, "0" * 32, "job-a")  # the gang restarted: a new rank 0 took the lease over
    assert err.value.exit_code == EXIT_FAILED  # an old pod's exit must never fail the Job (exit 2 would)
    lease.release()
    with pytest.raises(Superseded):  # released by a later attempt that finished: held by none
        check_holder(tmp_path, lease.holder, "job-a")


def test_another_jobs_lease_is_a_lost_lease_and_a_broken_lease_file_never_hangs(tmp_path):
    record = {"holder": "f" * 32, "job": "job-b", "host": "h", "pid": 1, "since": 0, "heartbeat": 0}
    (tmp_path / LEASE_FILE).write_text(json.dumps(record))
    with pytest.raises(LeaseLost, match="taken over"):
        check_holder(tmp_path, "0" * 32, "job-a")
    for broken in ("fifo", "link", "garbage"):
        (tmp_path / LEASE_FILE).unlink()
        if broken == "fifo":
            os.mkfifo(tmp_path / LEASE_FILE)
        elif broken == "link":
            (tmp_path / LEASE_FILE).symlink_to("/dev/zero")
        else:
            (tmp_path / LEASE_FILE).write_bytes(b"\x00{" * 1000)
        with pytest.raises(Superseded):  # unreadable: not this attempt's, and no hang on a FIFO or /dev/zero
            check_holder(tmp_path, "0" * 32, "job-a")


def _model():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_fenced_rank_publishes_no_checkpoint_and_its_temp_dir_is_its_attempts(tmp_path):
    model, opt = _model()
    ctrl = Control(1)
    store.save(tmp_path, 1, model, opt, {"plan": {}}, rank=0, ctrl=ctrl, keep=3, attempt="a" * 32)
    tmp = tmp_path / f".tmp-step-2-{'b' * 12}"

    def fence():  # passes the phases, then the gang moves on once the manifest is written: the publish is fenced
        if (tmp / "manifest.json").exists():
            raise Superseded("moved on")

    with pytest.raises(Superseded):
        store.save(tmp_path, 2, model, opt, {"plan": {}}, rank=0, ctrl=ctrl, keep=3, fence=fence, attempt="b" * 32)
    assert [p.name for _, p in store.complete(tmp_path)] == ["step-1"] and not (tmp_path / "step-2").exists()
    assert (tmp_path / f".tmp-step-2-{'b' * 12}").is_dir()  # its own attempt's: no later attempt publishes it
    store.save(tmp_path, 3, model, opt, {"plan": {}}, rank=0, ctrl=ctrl, keep=3, attempt="c" * 32)
    assert not list(tmp_path.glob(".tmp-step-*"))  # the next publish prunes every attempt's leftovers
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-1", "step-3"]


def test_a_rank_told_to_stop_in_the_middle_of_its_shard_writes_no_further(tmp_path, monkeypatch):
    """A rank frozen while it writes its shard, woken after its gang moved on: the fence runs between the shard's
    writes (at most every GUARD_S; here every write), so it stops there instead of writing the rest."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    ctrl = Control(1)
    whole = store.save(tmp_path / "whole", 1, model, opt, {"plan": {}}, rank=0, ctrl=ctrl, keep=3) / "__0_0.distcp"
    monkeypatch.setattr(store, "GUARD_S", 0.0)
    root, calls = tmp_path / "cut", []
    shard = root / f".tmp-step-1-{'a' * 12}" / "__0_0.distcp"

    def fence():  # the gang moves on once a quarter of the shard is on disk
        calls.append(1)
        if shard.exists() and shard.stat().st_size > whole.stat().st_size // 4:
            raise Superseded("moved on")

    with pytest.raises(Superseded):
        store.save(root, 1, model, opt, {"plan": {}}, rank=0, ctrl=ctrl, keep=3, fence=fence, attempt="a" * 32)
    assert len(calls) > 10  # checked between writes, not only before the phases
    assert whole.stat().st_size // 4 < shard.stat().st_size < whole.stat().st_size // 2  # it stopped there
    assert not (root / "step-1").exists()


def test_rank_0s_text_reaches_every_rank_exactly(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        import torch.distributed as dist
        sys.path.insert(0, {str(ROOT)!r})
        from runner.dist import Control
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=rank, world_size=2)
        ctrl = Control(2)
        for text in ("ffffffff" * 4, "0123456789abcdef" * 2, "00000001", "abc", "", "f" * 64):
            got = ctrl.from_rank0(text if rank == 0 else "")
            assert got == text, (rank, text, got)
        print("ok", rank, flush=True)
        os._exit(0)  # gloo's teardown at interpreter exit can abort (see tests/runner/oom)
    """)
    procs = [Drained([sys.executable, "-c", script, str(r)], cwd=ROOT, env=runner_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip() for o, _ in outs] == ["ok 0", "ok 1"]


def test_superseded_is_no_config_error():
    assert not issubclass(Superseded, ConfigError)


def test_every_metrics_line_is_fenced_after_it_is_built(tmp_path):
    """A rank frozen anywhere before the write (building a train record, an OOM event) finds out at the write: the
    fence is the last thing before the line lands, and a superseded rank's line never does."""
    from runner.output.metrics import Metrics

    lease = Lease(tmp_path, "job-a")
    lease.acquire()
    holder = lease.holder
    metrics = Metrics(tmp_path / "metrics.jsonl", enabled=True, fence=lambda: check_holder(tmp_path, holder, "job-a"))
    metrics.write({"kind": "event", "event": "oom_recovered", "step": 3})
    lease.release()
    Lease(tmp_path, "job-a").acquire()  # the gang restarted without this rank: a new attempt holds the directory
    for record in (
        {"kind": "event", "event": "oom_recovered", "step": 4},
        {"kind": "eval", "step": 4, "eval_loss": 1.0, "eval_tokens": 8},
    ):
        with pytest.raises(Superseded):
            metrics.write(record)
    metrics.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3]


def test_a_rank_woken_after_writing_its_rng_file_renames_nothing(tmp_path):
    """CI, 2026-11-30: a rank frozen while writing its RNG state (the fsync takes milliseconds) renamed it into its
    attempt's temp dir on waking, after its gang had gone. Each small file of a checkpoint is fenced right before its
    rename: refused there, the temporary goes and the name is never made."""
    calls = []

    def fence() -> None:
        calls.append(1)
        if len(calls) > 1:  # the check before the write passed; the one before the rename, on waking, does not
            raise Superseded("the gang moved on")

    fence()
    with pytest.raises(Superseded):
        store._write_durable(tmp_path / "rng-1.pt", b"x" * 14_000, fence)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary
    store._write_durable(tmp_path / "rng-1.pt", b"y", None)  # unfenced writes (DONE after the publish) still land
    assert (tmp_path / "rng-1.pt").read_bytes() == b"y"
