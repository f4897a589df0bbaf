"""The gang's heartbeat: a member of a multi-rank job that goes silent is declared lost within seconds.

Without it, a member that freezes (a machine that hangs or loses power, a process stopped by SIGSTOP: its sockets
stay open and nothing is reset) keeps every other rank waiting in a collective until the collective timeout. With
it, every rank beats from a thread of its own into the job's c10d store, and a watchdog thread ends the process
with the code the Job retries (the worker's `gang_lost`) once a member has been silent longer than
`scheduling.heartbeat_timeout_seconds`; the Job then restarts the pods, which resume from the newest complete
checkpoint.

Why the c10d store (`torch.distributed.TCPStore` at MASTER_ADDR:MASTER_PORT, which rank 0 already hosts for the
process group's rendezvous) and not torch.distributed.elastic's agent or a protocol of our own:
  - the elastic agent watches its own node's workers (their exit codes); the keep-alives of its dynamic c10d
    rendezvous only drop dead nodes from the next rendezvous round, and a running group restarts only when one of
    its own workers fails or a new node waits (torch 2.13, agent/server/api.py `_invoke_run`): there too a frozen
    peer is found by the collective timeout alone. And adopting the agent would replace what the supervisor owns
    (exit codes, OOM ladder, signals, termination message);
  - a socket protocol of our own needs a port, a server, its own framing and its own failure modes; the store is
    torch's public key-value service, already reached by every rank, and its atomic `add` is all a heartbeat
    needs.

The scheme. Counters, not timestamps (no clock is shared between nodes): each rank adds 1 to `beat/<rank>` every
interval and notes, on its own monotonic clock, when each counter it watches last moved. Each rank watches the
WATCHED ranks after it on the ring of ranks: any set of frozen ranks short of all has one whose predecessor is
alive, so some live rank sees the loss, and it announces it in the store (`lost`), where every other rank reads
it at its next beat; the store serves O(world) requests an interval, not O(world^2).

Rank 0's own loss. On a frozen host the store's operations never return (TCPStore's client waits for the reply
for ever, torch 2.13), so the beats run in one thread and the decisions in another: no reply for longer than the
timeout is the loss of rank 0. A store that closes the connection (rank 0's process ended) is a loss too, unless
this rank is leaving itself: rank 0, when it ends its run in agreement with the others, keeps the store up until
every rank has said goodbye (at most the timeout).

This process's own stall. When the watchdog itself did not run for longer than the timeout (the whole process was
frozen), the others have declared it lost meanwhile: it ends at once, and `fresh()` is False from then on, so a
writer that checks it writes nothing for a gang that has moved on. A freeze a little shorter than the timeout can
be a loss too (the others count from this rank's last beat, up to an interval before the freeze): then the store's
last answer is older than the timeout, but the silence is this process's own, not rank 0's; the watchdog waits for
the store's next answer (with the others' announcement if they declared this rank lost), and `fence` refuses
meanwhile.

Leaving. A rank that ends its run in agreement with the others (done, preempted, a shared error) adds BYE to its
counter first, so that nobody takes its silence for a loss; a rank that crashed alone says nothing, and the others
find it lost (or their collective fails first, its sockets closed).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import torch.distributed as dist

from jobspec.untrusted import json_loads
from runner.dist import DistEnv

log = logging.getLogger("jobspec.runner")
T = TypeVar("T")
PREFIX = "jobspec/gang"  # our keys in the process group's store are "jobspec/gang/<key>": apart from torch's
LOST_KEY = "lost"  # JSON of the first loss announced (a Loss)
BYE = 1 << 40  # added to a rank's counter when it leaves in agreement with the others; beats never reach it
WATCHED = 4  # ranks after this one on the ring that it watches
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 2.0
BEATS_PER_TIMEOUT = 6  # a live member beats about this often within one timeout (a late beat or two is no loss)
ANNOUNCE_S = 0.5  # how long the watchdog waits for its announcement to reach the store before it acts
ANNOUNCE_BYTES = 4096  # an announcement (a Loss as JSON) is ~120 bytes
KINDS = ("silent", "store", "ended", "self")
MAX_RANKS = 1 << 20
MAX_SECONDS = 1e11  # silent_s, detected_at (seconds since the epoch: year 5138)


class GangLost(RuntimeError):
    """This rank is no longer a member of the gang: it must write nothing (raised by `Heartbeat.fence`)."""


@dataclass(frozen=True)
class Loss:
    """A member declared lost, as this rank learnt it."""

    kind: str  # "silent": a watched rank stopped beating; "store": rank 0, the store's host, stopped answering;
    # "ended": rank 0's process ended (its store closed); "self": this process stalled past the timeout (the
    # others have declared it lost)
    member: int  # the rank lost (this rank itself for "self")
    silent_s: float  # how long it had been silent when declared
    detected_at: float  # unix time
    by: int  # the rank that declared it

    def describe(self) -> str:
        at = datetime.fromtimestamp(self.detected_at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        silent = f"{self.silent_s:.1f} s"
        what = {
            "silent": f"rank {self.member} lost: silent for {silent}",
            "store": f"rank {self.member} lost: the store it hosts has not answered for {silent}",
            "ended": f"rank {self.member} lost: its process ended without the others (its store closed)",
            "self": f"rank {self.member} stalled for {silent}: the gang has declared it lost and moved on",
            "unreadable": "a member was announced lost, in an announcement that does not read as one",
        }.get(self.kind, f"rank {self.member} lost")
        return f"gang: {what} (detected by rank {self.by} at {at})"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Loss:
        """The loss announced in the store. Another process wrote it: within ANNOUNCE_BYTES, every field of its type
        and range, or it is still a loss (something was announced) of kind "unreadable", never an exception."""
        try:
            record = json_loads(text, max_depth=2) if len(text) <= ANNOUNCE_BYTES else None
        except ValueError:
            record = None
        fields = record if isinstance(record, dict) else {}
        kind, member, by = fields.get("kind"), fields.get("member"), fields.get("by")
        silent, at = fields.get("silent_s"), fields.get("detected_at")
        if (kind in KINDS and all(type(v) is int and -1 <= v < MAX_RANKS for v in (member, by))
                and all(type(v) in (int, float) and math.isfinite(v) and 0 <= v <= MAX_SECONDS for v in (silent, at))):
            return cls(kind, member, float(silent), float(at), by)  # type: ignore[arg-type]
        return cls("unreadable", -1, 0.0, time.time(), -1)


def watched_ranks(rank: int, world_size: int) -> list[int]:
    """The ranks after `rank` on the ring that it watches (all the others in a small world)."""
    return [(rank + k) % world_size for k in range(1, min(world_size, WATCHED + 1))]


def interval_s(timeout_s: float) -> float:
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, timeout_s / BEATS_PER_TIMEOUT))


def bounded(fn: Callable[[], T], seconds: float) -> T:
    """`fn()` on a daemon thread, waited for at most `seconds` (TimeoutError after): a store operation on a frozen
    host never returns, and the thread that asked must not hang with it."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # handed to the caller
            out.append((False, exc))

    thread = threading.Thread(target=run, name="jobspec-store-op", daemon=True)
    thread.start()
    thread.join(seconds)
    if not out:
        raise TimeoutError(f"no answer from the store in {seconds:.1f} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value


class Heartbeat:
    """This rank's beats and watchdog (see the module docstring). `on_lost(loss)` runs on the watchdog thread, once;
    the worker's ends the process. `connect(timeout_s)` returns this rank's client of the store (tests pass
    their own)."""

    def __init__(
        self,
        env: DistEnv,
        timeout_s: float,
        on_lost: Callable[[Loss], None],
        connect: Callable[[float], dist.Store],
        *,
        armed: Callable[[], bool] = dist.is_initialized,
    ):
        self.env, self.timeout = env, float(timeout_s)
        self.interval = interval_s(self.timeout)
        self.watched = watched_ranks(env.rank, env.world_size)
        self.on_lost, self.connect, self.armed = on_lost, connect, armed
        self.store: dist.Store | None = None
        self.lost: Loss | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._armed_at: float | None = None  # monotonic time the process group was first seen: watching starts
        self._reply = 0.0  # monotonic time of the last complete round with the store
        self._seen: dict[int, int] = {}  # watched rank -> its counter
        self._moved: dict[int, float] = {}  # watched rank -> monotonic time its counter last moved, as seen here
        self._announced: Loss | None = None
        self._declaring = threading.Lock()
        self._declared = threading.Event()  # on_lost has returned (in the worker it never does: the process ends)
        self._ended = False  # the store closed the connection: rank 0's process ended
        self._tick = time.monotonic()  # the watchdog's last wake-up
        self._stalled = 0.0  # the longest stall past the timeout the watchdog measured (this process was frozen)
        self._acting: float | None = None  # monotonic time `_declare` began to act on the loss
        self._pause = (0.0, 0.0)  # monotonic (start, end) of the watchdog's last gap longer than a beat
        self._threads = [
            threading.Thread(target=self._beat_loop, name="jobspec-heartbeat", daemon=True),
            threading.Thread(target=self._watch_loop, name="jobspec-watchdog", daemon=True),
        ]

    def start(self) -> Heartbeat:
        for thread in self._threads:
            thread.start()
        return self

    # --- the beats (the only thread that waits on the store) ------------------------------------------------

    def _beat_loop(self) -> None:
        while not self.armed():  # the store is up once this rank's process group exists
            if self._stop.wait(0.05):
                return
        with self._lock:
            now = time.monotonic()
            self._armed_at = self._reply = now
            self._moved = dict.fromkeys(self.watched, now)
        try:
            self.store = self.connect(self.timeout)
            while not self._stop.is_set():
                self._round()
                self._stop.wait(self.interval)
        except Exception as exc:  # DistNetworkError and kin: the store closed the connection
            if not self._stop.is_set():
                first = (str(exc).splitlines() or [""])[0]
                log.info("gang: the store at rank 0 closed (%s: %s)", type(exc).__name__, first)
                with self._lock:
                    self._ended = True

    def _round(self) -> None:
        store = self.store
        assert store is not None
        store.add(f"beat/{self.env.rank}", 1)
        announced = None
        if store.check([LOST_KEY]):  # check never waits for a key; get would
            announced = Loss.from_json(store.get(LOST_KEY))  # by another rank, or by this one
        counters = {r: store.add(f"beat/{r}", 0) for r in self.watched}  # add 0: read without waiting
        with self._lock:
            now = time.monotonic()
            self._reply = now
            self._announced = self._announced or announced
            for r, value in counters.items():
                if value != self._seen.get(r):
                    self._seen[r], self._moved[r] = value, now

    # --- the decisions --------------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.interval / 2):
            now, stalled = self._wake()
            loss = self.check(now, stalled)
            if loss is not None:
                self._declare(loss, decided=now)
                return

    def _wake(self) -> tuple[float, float]:
        """The watchdog's wake-up: (now, seconds since the last one). A stall past the timeout is published before
        the tick moves, so a writer's `fence` that already reads the new tick (the main thread, whose collective
        failed the moment this frozen process woke) still reports this rank's own stall, not the store's silence."""
        now = time.monotonic()
        stalled = now - self._tick
        if stalled > self.timeout:
            self._stalled = max(self._stalled, stalled)
        if stalled > self.interval:
            self._pause = (self._tick, now)
        self._tick = now
        return now, stalled

    def _paused_since_reply(self, now: float, stalled: float) -> float:
        """Seconds of the time since the store's last answer during which this process itself was not running: the
        gap the caller is in (`stalled` up to `now`) and the watchdog's last long gap, counted once where they meet."""
        spans = [(max(self._reply, now - stalled), now), (max(self._reply, self._pause[0]), min(now, self._pause[1]))]
        (a0, a1), (b0, b1) = spans
        return max(0.0, a1 - a0) + max(0.0, b1 - b0) - max(0.0, min(a1, b1) - max(a0, b0))

    def check(self, now: float, stalled: float = 0.0) -> Loss | None:
        """The loss this rank knows of at monotonic time `now`, if any; `stalled`: seconds since the watchdog last
        ran (longer than the timeout: this process was frozen)."""
        with self._lock:
            if self._armed_at is None or self._stop.is_set():
                return None
            rank, wall = self.env.rank, time.time()
            # frozen after `now` was read (between the watchdog's wake-up and this check): the counters read since
            # are as stale as this process, and a member silent meanwhile is not the loss to report
            stalled = max(stalled, self._stalled, time.monotonic() - now)
            if stalled > self.timeout:
                return Loss("self", rank, stalled, wall, rank)
            if self._announced is not None:
                return self._announced
            if self._ended:
                # rank 0's process ended while this one was frozen for nearly the timeout: the gang counted this rank
                # silent (from its last beat, up to a beat before the freeze) and moved on, the end of rank 0's
                # process being that (CI, 2026-11-30: rank 1 frozen ~5 s of a 5 s timeout reported rank 0 "ended")
                paused = self._paused_since_reply(now, stalled)
                if paused + self.interval > self.timeout:
                    return Loss("self", rank, paused, wall, rank)
                return Loss("ended", 0, now - self._reply, wall, rank)
            unanswered = now - self._reply
            if unanswered > self.timeout:
                # not the store's silence while this process itself was frozen (a freeze a little shorter than the
                # timeout): the store has not been asked since; its next answer (the others' announcement, if they
                # count this rank lost) or its silence decides. A writer's fence meanwhile refuses
                if unanswered - self._paused_since_reply(now, stalled) <= self.timeout:
                    return None
                return Loss("store", 0, unanswered, wall, rank)
            # silent as of the store's last answer, not as of now: while the store itself is slow to answer, the
            # counters were not read, and a watched rank is not to blame for that (the store check above is)
            silent = [(self._reply - self._moved[r], r) for r in self.watched if self._seen.get(r, 0) < BYE]
            longest, member = max(silent, default=(0.0, -1))
            return Loss("silent", member, longest, wall, rank) if longest > self.timeout else None

    def _declare(self, loss: Loss, decided: float | None = None) -> None:
        """Announce `loss` (when this rank found it) and hand it to `on_lost`, once: a second caller (the watchdog
        and a writer's `fence` at the same time) waits for the first, which ends the process. `decided`: the monotonic
        time the loss was found; a process frozen past the timeout since then acts on its own stall instead (the gang
        has moved on without it: it writes nothing shared)."""
        now = time.monotonic()
        if decided is not None and now - decided > self.timeout and loss.kind != "self":
            loss = Loss("self", self.env.rank, now - decided, time.time(), self.env.rank)
        with self._declaring:
            first, self.lost = self.lost is None, self.lost or loss
            self._acting = now
        if not first:
            self._declared.wait(ANNOUNCE_S + 5.0)
            return
        self._stop.set()
        if loss.by == self.env.rank and loss.kind in ("silent", "store") and self.store is not None:  # tell the others
            store = self.store
            try:
                bounded(lambda: store.compare_set(LOST_KEY, "", loss.to_json()), ANNOUNCE_S)  # the first one stays
            except Exception as exc:
                log.info("gang: could not announce the loss (%s)", type(exc).__name__)
        try:
            self.on_lost(loss)
        finally:
            self._declared.set()

    # --- for writers and for the end ------------------------------------------------------------------------

    def acting_late(self) -> bool:
        """Whether this process stalled past the timeout since it began to act on its loss (frozen inside `on_lost`,
        before its record of the loss: the gang has moved on, that record is not to be written)."""
        return self._acting is not None and time.monotonic() - self._acting > self.timeout

    def fresh(self) -> bool:
        """Whether this rank is still a member in good standing: no loss known, and both its watchdog and the
        store heard from within the timeout. False: the gang has moved on (or will): write nothing."""
        if self.lost is not None:
            return False
        if self._armed_at is None or self._stop.is_set():  # not watching yet, or left in agreement
            return True
        now = time.monotonic()
        if self._stalled > self.timeout or self._ended:  # the watchdog found this process frozen (and will declare)
            return False
        return now - self._tick <= self.timeout and now - self._reply <= self.timeout

    def fence(self) -> None:
        """For a rank about to write something the gang shares (a checkpoint, a metrics line, the lease): returns
        while it is a member in good standing; otherwise declares the loss now (the worker's `on_lost` ends the
        process) and raises GangLost, so the write never happens. A process frozen until just now finds out here,
        before its watchdog has run: its last tick is older than the timeout."""
        if self.fresh():
            return
        now = time.monotonic()
        loss = self.lost or self.check(now, now - self._tick)
        loss = loss or Loss("self", self.env.rank, now - min(self._tick, self._reply), time.time(), self.env.rank)
        self._declare(loss, decided=now)
        raise GangLost(loss.describe())

    def leave(self, *, bye: bool) -> None:
        """Stop beating. `bye`: this rank ends in agreement with the others; say so, and on rank 0 keep the store
        up until every rank has said it too (at most the timeout)."""
        if self._stop.is_set() and self.lost is not None:
            return  # declared lost: nothing to say
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(self.interval + 0.5)  # a beat in flight; one stuck on a frozen store is left behind
        store = self.store
        if not bye or store is None or self._ended:
            return
        try:
            bounded(lambda: store.add(f"beat/{self.env.rank}", BYE), self.timeout)
            if self.env.rank == 0:
                self._linger(store)
        except Exception as exc:  # the gang is ending anyway
            log.info("gang: leaving without a goodbye (%s)", type(exc).__name__)

    def _linger(self, store: dist.Store) -> None:
        others = range(1, self.env.world_size)
        deadline = time.monotonic() + self.timeout
        while (left_s := deadline - time.monotonic()) > 0:
            left = bounded(lambda: [store.add(f"beat/{r}", 0) >= BYE for r in others], left_s)
            if all(left):
                return
            time.sleep(0.05)
        log.warning("gang: not every rank said goodbye within %.0f s; closing the store", self.timeout)


def tcp_store(addr: str, port: int) -> Callable[[float], dist.Store]:
    """A client of the job's TCPStore (its own connection, so a beat never waits behind the process group's use)."""

    def connect(timeout_s: float) -> dist.Store:
        client = dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False)
        return dist.PrefixStore(PREFIX, client)

    return connect


def start(env: DistEnv, timeout_s: float, on_lost: Callable[[Loss], None], *, addr: str | None,
          port: int | None) -> Heartbeat | None:  # fmt: skip
    """This rank's heartbeat, or None: one rank, no store address, or `timeout_s` 0 (turned off)."""
    if env.world_size < 2 or not timeout_s or not addr or not port:
        return None
    beat = Heartbeat(env, timeout_s, on_lost, tcp_store(addr, port)).start()
    log.info("gang: heartbeat every %.1f s, a member silent for %.0f s is lost", beat.interval, timeout_s)
    return beat
