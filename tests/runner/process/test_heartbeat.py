"""The gang's heartbeat (runner/process/heartbeat.py) on its own: members in this process beating into one real
c10d store (torch's HashStore; a gate in front of it stands for a frozen or ended host), and one member frozen for
real (SIGSTOP) in a child process over a TCPStore.

What must hold: members that beat are never lost; one that goes silent is, within the timeout and a few beats, on
the ranks that watch it and, through the announcement, on those that do not; one that leaves in agreement is not;
rank 0 keeps the store up until every rank has said goodbye; a store that stops answering or closes is rank 0's
loss; and a process frozen past the timeout writes nothing once it wakes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import yaml

from jobspec.errors import ConfigError
from jobspec.spec.loader import parse_spec
from jobspec.spec.models import SchedulingSpec
from runner.dist import DistEnv, collective_timeout_s
from runner.process import heartbeat
from runner.process.heartbeat import BYE, GangLost, Heartbeat, Loss, watched_ranks
from tests.runner.train_helpers import ROOT

TIMEOUT_S = 1.5  # beats every 0.25 s
SOON_S = TIMEOUT_S + 3.0  # a loss must be declared within this (the timeout, a beat or two, a loaded machine)


class Gate:
    """A real in-process store behind a gate: frozen, every call waits (on a frozen host TCPStore's client never
    times out); closed, every call raises (the host's process ended)."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.open = threading.Event()
        self.open.set()
        self.closed = False

    def __getattr__(self, name: str):
        op = getattr(self.store, name)

        def call(*args):
            self.open.wait()
            if self.closed:
                raise RuntimeError("Connection closed by peer")
            return op(*args)

        return call


class Gang:
    """`world` members in this process, each with its own heartbeat over the same store."""

    def __init__(self, world: int, timeout_s: float = TIMEOUT_S):
        self.gate = Gate()
        self.losses: dict[int, list[Loss]] = {r: [] for r in range(world)}
        self.members = [
            Heartbeat(DistEnv(rank=r, world_size=world), timeout_s, self.losses[r].append, lambda _: self.gate,
                      armed=lambda: True).start()
            for r in range(world)
        ]  # fmt: skip

    def wait_for_losses(self, ranks, seconds: float = SOON_S) -> None:
        deadline = time.monotonic() + seconds
        while not all(self.losses[r] for r in ranks):
            assert time.monotonic() < deadline, f"no loss declared on ranks {ranks} in {seconds:.1f} s: {self.losses}"
            time.sleep(0.02)

    def close(self) -> None:
        self.gate.open.set()
        for member in self.members:
            member.leave(bye=False)


@pytest.fixture
def gang():
    made: list[Gang] = []
    yield lambda world, **kw: made.append(Gang(world, **kw)) or made[-1]
    for g in made:
        g.close()


def test_watched_ranks_are_the_next_ones_on_the_ring():
    assert watched_ranks(0, 2) == [1] and watched_ranks(1, 2) == [0]
    assert watched_ranks(5, 7) == [6, 0, 1, 2]
    rings = [watched_ranks(r, 64) for r in range(64)]
    assert all(len(w) == heartbeat.WATCHED for w in rings)
    assert {r for w in rings for r in w} == set(range(64))  # every rank has a watcher


def test_members_that_beat_are_not_lost_and_a_silent_one_is(gang):
    g = gang(2)
    time.sleep(2 * TIMEOUT_S)
    assert g.losses == {0: [], 1: []}
    silent_at = time.monotonic()
    g.members[1].leave(bye=False)  # stops beating without a word: frozen, or crashed alone
    g.wait_for_losses([0])
    (loss,) = g.losses[0]
    assert (loss.kind, loss.member, loss.by) == ("silent", 1, 0)
    assert TIMEOUT_S < loss.silent_s < SOON_S and time.monotonic() - silent_at < SOON_S
    assert "rank 1 lost: silent for" in loss.describe() and not g.members[0].fresh()


def test_a_member_that_says_goodbye_is_not_lost_and_rank_0_waits_for_every_goodbye(gang):
    g = gang(3)
    time.sleep(0.5)
    g.members[1].leave(bye=True)
    time.sleep(2 * TIMEOUT_S)  # rank 1 is silent now, and rank 0 watches it
    assert g.losses == {0: [], 1: [], 2: []}
    left = threading.Event()
    t = threading.Thread(target=lambda: (g.members[0].leave(bye=True), left.set()))
    t.start()
    assert not left.wait(0.5)  # rank 2 has not said goodbye: rank 0 keeps its store up
    g.members[2].leave(bye=True)
    assert left.wait(1.0)
    t.join()
    assert all(m.store.add(f"beat/{m.env.rank}", 0) >= BYE for m in g.members)
    assert g.losses == {0: [], 1: [], 2: []}


@pytest.mark.parametrize("world", [2, 4])
def test_a_store_that_stops_answering_is_the_loss_of_rank_0_on_every_rank(gang, world):
    g = gang(world)
    time.sleep(0.5)
    g.gate.open.clear()  # rank 0's host froze: every call waits
    g.wait_for_losses(range(world))
    # rank 0 and no other: the counters of the ranks a member watches stop moving for it too (it cannot read them),
    # which is not their silence
    assert [(ls[0].kind, ls[0].member) for ls in g.losses.values()] == [("store", 0)] * world
    assert "the store it hosts has not answered" in g.losses[1][0].describe()


def test_a_store_that_closes_is_the_end_of_rank_0(gang):
    g = gang(2)
    time.sleep(0.5)
    g.gate.closed = True
    g.wait_for_losses([1], seconds=2.0)  # at the next beat, not after the timeout
    assert (g.losses[1][0].kind, g.losses[1][0].member) == ("ended", 0)


def test_a_loss_reaches_the_ranks_that_do_not_watch_the_lost_one(gang):
    g = gang(7)  # each rank watches the next 4: ranks 0 and 1 do not watch rank 6
    time.sleep(0.5)
    g.members[6].leave(bye=False)
    g.wait_for_losses(range(6))
    for rank in range(6):
        (loss,) = g.losses[rank]
        assert loss.member == 6 and loss.kind == "silent", (rank, loss)
    assert {g.losses[r][0].by for r in (0, 1)} <= {2, 3, 4, 5}  # told by a watcher of rank 6


def test_a_rank_that_found_a_loss_stops_writing(gang):
    g = gang(2)
    time.sleep(0.5)
    g.members[0].fence()  # a member in good standing: returns
    g.members[1].leave(bye=False)
    g.wait_for_losses([0])
    with pytest.raises(GangLost, match="rank 1 lost"):
        g.members[0].fence()


def test_a_woken_rank_whose_watchdog_moved_its_tick_first_still_reports_its_own_stall():
    """The race the lost-node test met (CI, 2026-11-29): the frozen process wakes, its watchdog thread takes the new
    tick but has not declared yet, and the main thread, whose collective just failed, fences: it must still say this
    rank stalled, not that rank 0's store went silent (the store's last answer is as old as the stall)."""
    losses: list[Loss] = []
    member = Heartbeat(DistEnv(rank=1, world_size=2), TIMEOUT_S, losses.append, lambda _: dist.HashStore(),
                       armed=lambda: True)  # not started: its threads' steps are taken by hand  # fmt: skip
    frozen_since = time.monotonic() - 4 * TIMEOUT_S
    member._armed_at = member._reply = member._tick = frozen_since
    now, stalled = member._wake()  # the watchdog's wake-up, before its check
    assert stalled > TIMEOUT_S and member._tick == now
    member._reply = now  # and the beat thread's round came back before the main thread's fence: still not fresh
    assert not member.fresh()
    with pytest.raises(GangLost, match="rank 1 stalled for"):
        member.fence()
    assert [(loss.kind, loss.member) for loss in losses] == [("self", 1)]


FROZEN_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from runner.dist import DistEnv
    from runner.process.heartbeat import GangLost, Heartbeat, tcp_store

    port, timeout_s, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    lost = lambda loss: (print("LOST", loss.describe(), flush=True), os._exit(3))
    beat = Heartbeat(DistEnv(rank=1, world_size=2), timeout_s, lost, tcp_store("127.0.0.1", port),
                     armed=lambda: True).start()
    with open(out, "a", buffering=1) as f:
        while True:  # a writer that checks the gang before every write
            beat.fence()
            f.write(f"{time.time()}\\n")
            time.sleep(0.2)
    """
)


def test_a_process_frozen_past_the_timeout_writes_nothing_when_it_wakes(tmp_path):
    """A real freeze: rank 1 in a child process (SIGSTOP), rank 0 here, one TCPStore (hosted here)."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    out = tmp_path / "writes"
    child = subprocess.Popen([sys.executable, "-c", FROZEN_CHILD, str(server.port), str(TIMEOUT_S), str(out)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    losses: list[Loss] = []
    rank0 = None
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text()):  # the child beats (its imports take seconds)
            assert child.poll() is None and time.monotonic() < deadline, child.stdout and child.stdout.read()
            time.sleep(0.05)
        rank0 = Heartbeat(DistEnv(rank=0, world_size=2), TIMEOUT_S, losses.append,
                          heartbeat.tcp_store("127.0.0.1", server.port), armed=lambda: True).start()  # fmt: skip
        time.sleep(2 * TIMEOUT_S)
        assert losses == [] and child.poll() is None
        child.send_signal(signal.SIGSTOP)
        while not losses:
            time.sleep(0.02)
        assert (losses[0].kind, losses[0].member) == ("silent", 1)
        written = out.read_text()  # the child is stopped: nothing moves
        child.send_signal(signal.SIGCONT)
        said, _ = child.communicate(timeout=10)
        assert child.returncode == 3, said
        # it learns that it is the one lost: from its own stall, or from rank 0's announcement when the freeze was a
        # little shorter than the timeout (rank 0 counts from the beat before the freeze); never as rank 0's loss
        assert "rank 1 stalled for" in said or "rank 1 lost: silent for" in said, said
        assert out.read_text() == written  # not one line after it woke up
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()
        if rank0 is not None:
            rank0.leave(bye=False)


def test_the_timeouts_come_from_the_spec_and_zero_turns_the_heartbeat_off(monkeypatch):
    defaults = SchedulingSpec()
    assert defaults.heartbeat_timeout_seconds == 30 and defaults.collective_timeout_seconds == 600
    env = DistEnv(rank=0, world_size=2)
    assert heartbeat.start(env, 0, lambda loss: None, addr="127.0.0.1", port=29500) is None
    assert heartbeat.start(DistEnv(), 30, lambda loss: None, addr="127.0.0.1", port=29500) is None  # one rank
    monkeypatch.delenv("JOBSPEC_DIST_TIMEOUT_S", raising=False)
    assert collective_timeout_s(600) == 600
    monkeypatch.setenv("JOBSPEC_DIST_TIMEOUT_S", "30")
    assert collective_timeout_s(600) == 30  # the debugging override wins
    for bad in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv("JOBSPEC_DIST_TIMEOUT_S", bad)
        with pytest.raises(ConfigError, match="JOBSPEC_DIST_TIMEOUT_S"):
            collective_timeout_s(600)


@pytest.mark.parametrize(("field", "value"), [("heartbeat_timeout_seconds", -1), ("heartbeat_timeout_seconds", 3601),
                                              ("collective_timeout_seconds", 5)])  # fmt: skip
def test_bad_timeouts_are_spec_errors_naming_the_field(field, value):
    spec = yaml.safe_load((ROOT / "examples" / "multinode.yaml").read_text())
    spec.setdefault("scheduling", {})[field] = value
    with pytest.raises(ConfigError, match=f"scheduling.{field}"):
        parse_spec(yaml.safe_dump(spec))


@pytest.mark.parametrize(
    "payload",
    [b"", b"{}", b"[" * 5000 + b"]" * 5000, b'{"kind": "silent"}', b"x" * 100_000, b"\xff\xfe",
     b'{"kind": "silent", "member": 1, "silent_s": 1e308, "detected_at": 1e300, "by": 0}',
     b'{"kind": "silent", "member": ' + b"9" * 5000 + b', "silent_s": 1, "detected_at": 1, "by": 0}',
     b'{"kind": "rm -rf", "member": 1, "silent_s": 1, "detected_at": 1, "by": 0}',
     b'{"kind": "silent", "member": true, "silent_s": NaN, "detected_at": 1, "by": 0}'],
)  # fmt: skip
def test_an_announcement_that_does_not_read_is_still_a_loss_never_an_exception(payload):
    """The store's `lost` key is written by another process: whatever it holds, reading it gives a Loss (something
    was announced), worded without a traceback."""
    loss = Loss.from_json(payload)
    assert loss.kind == "unreadable" and "does not read as one" in loss.describe()
    good = Loss("silent", 3, 12.5, 1.7e9, 0)
    assert Loss.from_json(good.to_json()) == good


def test_a_freeze_a_little_shorter_than_the_timeout_is_not_the_stores_silence():
    """The race CI met (2026-11-30): rank 1 froze for 1.4 s of a 1.5 s timeout, its last answer from the store 0.2 s
    before; rank 0 counted 1.6 s from its last beat and declared it lost. Woken, rank 1 must not blame rank 0's store
    for its own freeze: its watchdog waits for the store's next answer (which carries the announcement), and a writer
    fences meanwhile, as this rank's stall."""
    losses: list[Loss] = []
    member = Heartbeat(DistEnv(rank=1, world_size=2), TIMEOUT_S, losses.append, lambda _: dist.HashStore(),
                       armed=lambda: True)  # fmt: skip
    t0 = time.monotonic() - 1.65
    member._armed_at = member._reply = t0
    member._tick = t0 + 0.2  # the watchdog's last wake-up before the freeze
    now, stalled = member._wake()  # woken 1.45 s later: short of the timeout, so not a stall of its own
    assert stalled < TIMEOUT_S < now - member._reply
    assert member.check(now, stalled) is None  # not ("store", 0)
    announced = Loss("silent", 1, 1.6, time.time(), 0)
    member._announced = announced  # the beat thread's round: the store answers, with rank 0's announcement
    member._reply = time.monotonic()
    assert member.check(time.monotonic()) == announced
    member._announced, member._reply = None, t0  # had the store not answered yet, a writer still writes nothing
    with pytest.raises(GangLost, match="rank 1 stalled for"):
        member.fence()
    assert [(loss.kind, loss.member) for loss in losses] == [("self", 1)]


def test_a_store_closed_while_this_process_was_frozen_nearly_the_timeout_is_its_own_stall():
    """CI (2026-11-30): rank 1 frozen about 5 s of a 5 s timeout; rank 0 counted it silent from its last beat and
    ended; woken, rank 1's watchdog measured a stall a little short of the timeout and found the store closed. The
    gang moved on without it: its own stall (nothing shared written), not rank 0's end. A store that closes while
    this process ran is still rank 0's end."""
    member = Heartbeat(DistEnv(rank=1, world_size=2), TIMEOUT_S, lambda loss: None, lambda _: dist.HashStore(),
                       armed=lambda: True)  # fmt: skip
    t0 = time.monotonic() - TIMEOUT_S
    member._armed_at = member._reply = t0
    member._tick = t0 + 0.05  # the watchdog's last wake-up before the freeze
    member._ended = True  # the beat thread, woken first, found the store closed
    now, stalled = member._wake()
    assert stalled < TIMEOUT_S < stalled + member.interval
    loss = member.check(now, stalled)
    assert loss is not None and (loss.kind, loss.member) == ("self", 1)
    assert "rank 1 stalled for" in loss.describe()

    ran = Heartbeat(DistEnv(rank=1, world_size=2), TIMEOUT_S, lambda loss: None, lambda _: dist.HashStore(),
                    armed=lambda: True)  # fmt: skip
    ran._armed_at = ran._reply = ran._tick = time.monotonic() - 0.05
    ran._ended = True
    loss = ran.check(*ran._wake())
    assert loss is not None and (loss.kind, loss.member) == ("ended", 0)


def test_a_store_silent_while_this_process_ran_is_still_rank_0s_loss_after_a_short_pause():
    """The other side: the store stopped answering while this process ran, with a scheduling pause of 0.3 s inside
    that silence. The pause is not counted against the store; the loss is the store's once the rest passes the
    timeout."""
    member = Heartbeat(DistEnv(rank=1, world_size=2), TIMEOUT_S, lambda loss: None, lambda _: dist.HashStore(),
                       armed=lambda: True)  # fmt: skip
    t0 = time.monotonic() - 1.6
    member._armed_at = member._reply = t0
    member._pause = (t0 + 1.0, t0 + 1.3)
    assert member.check(t0 + 1.6, 0.05) is None  # 1.6 s unanswered, 0.3 s of it paused here
    loss = member.check(t0 + 1.9, 0.05)
    assert loss is not None and (loss.kind, loss.member) == ("store", 0) and loss.silent_s == pytest.approx(1.9)


def test_a_process_frozen_between_finding_a_loss_and_acting_on_it_acts_on_its_own_stall():
    """The race the lost-node test met (CI, 2026-11-30): rank 0 found rank 1 silent (rank 1 had ended long before),
    and was frozen before it acted; woken, it wrote rank 1's loss into the run's metrics after the gang had moved on.
    A loss found before a stall past the timeout becomes this rank's own stall ("self": nothing shared written), in
    `check` (frozen between the wake-up and the check) and in `_declare` (frozen between the check and acting); and
    `acting_late` tells `on_lost` when it was frozen inside it."""
    losses: list[Loss] = []
    member = Heartbeat(DistEnv(rank=0, world_size=2), TIMEOUT_S, losses.append, lambda _: dist.HashStore(),
                       armed=lambda: True)  # fmt: skip
    woke = time.monotonic() - 2 * TIMEOUT_S  # the watchdog's wake-up, read before the freeze
    member._armed_at = member._tick = woke
    member._reply, member._moved, member._seen = time.monotonic(), {1: woke - 5}, {1: 3}  # rank 1 silent for long
    loss = member.check(woke, 0.1)
    assert loss is not None and (loss.kind, loss.member) == ("self", 0)
    silent = Loss("silent", 1, 6.0, time.time(), 0)  # found before the freeze, acted on after it
    member._declare(silent, decided=woke)
    assert [(x.kind, x.member) for x in losses] == [("self", 0)]
    assert not member.acting_late()
    member._acting -= 2 * TIMEOUT_S  # frozen inside on_lost
    assert member.acting_late()


def test_the_worker_writes_no_record_of_a_loss_it_acted_on_late(tmp_path, monkeypatch):
    """worker.gang_lost: rank 0 records a member's loss in the metrics (the survivor's courtesy), but not when its
    heartbeat says it was frozen since it began to act (`acting_late`): the gang has moved on without it."""
    from runner.output.metrics import Metrics
    from runner.process import worker

    exits: list[int] = []
    monkeypatch.setattr(worker, "_exit", exits.append)

    class Late:
        def __init__(self, late: bool) -> None:
            self.late = late

        def acting_late(self) -> bool:
            return self.late

    class Run:
        step, saved_step, status = 5, 4, {}
        holds_lease = staticmethod(lambda: None)

    loss = Loss("silent", 1, 6.0, time.time(), 0)
    for late in (False, True):
        run = Run()
        run.metrics = Metrics(tmp_path / f"metrics-{late}.jsonl", enabled=True)
        worker.gang_lost(loss, run, DistEnv(rank=0, world_size=2), Late(late))
        run.metrics.close()
    assert "member_lost" in (tmp_path / "metrics-False.jsonl").read_text()
    assert (tmp_path / "metrics-True.jsonl").read_text() == ""
    assert exits == [1, 1]
