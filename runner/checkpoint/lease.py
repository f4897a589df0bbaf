"""One writer per run directory: a lease file that rank 0 holds while its job trains.

    <checkpoints.dir>/lease.json   {"holder", "job", "host", "pid", "pid_start", "boot_id", "pid_ns",
                                    "since", "heartbeat"}   (times: seconds since the epoch)

`acquire()` creates the file with O_CREAT|O_EXCL. The holder renews it (`beat()`: heartbeat time) at
most every `interval` seconds from the training loop and before every checkpoint, by writing a new file
and renaming it over the old one, after checking the lease is still its own; `release()` removes it at
exit. Both writes go through jobspec.shared_dir (a link planted at the name is never written through; the
temporary is created exclusively under a random name). The record is read back as untrusted: within MAX_BYTES,
nesting bounded, and every field checked for type and range (`_clean`): a pid past PID_MAX, a time that is not a
finite number of seconds within MAX_TIME, or text over MAX_TEXT is dropped as unreadable, never an OverflowError.
Another run finds the file and stops with exit 2 naming the holder, unless the lease is stale:

  - its heartbeat is older than JOBSPEC_LEASE_TIMEOUT_S (default 600 s): the holder stopped renewing;
  - the holder ran in this kernel and PID namespace (same boot id and pid namespace) and that process is
    gone (or the pid now belongs to a newer process): a worker that crashed or was SIGKILLed, before
    the supervisor's relaunch, or an earlier run in this very process;
  - this is a pod of a Kubernetes Indexed Job (JOB_COMPLETION_INDEX is set) with the holder's hostname
    and another PID namespace: hostnames are `<job>-<index>`, so that is the previous pod of this index,
    which the Job replaces only once it has ended (podReplacementPolicy: Failed).

A stale lease is taken over with a warning: a new file renamed over it, then read back (of two runs
that took over at once, the one whose record is not there stops). A holder whose lease was taken over
(it stalled past the timeout) finds out at its next renewal and stops (LeaseLost, exit 2).

The lease also fences the other ranks: each learns rank 0's holder when its attempt starts, and `check_holder`
before every shared write returns only while that holder still holds the directory; a rank of an attempt the
gang has restarted without (frozen, then woken) stops there (Superseded, the retryable code) and writes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jobspec import shared_dir
from jobspec.contract import EXIT_FAILED
from jobspec.errors import ConfigError, JobspecError
from runner.checkpoint import files

log = logging.getLogger("jobspec.runner")
LEASE_FILE = "lease.json"
TIMEOUT_ENV = "JOBSPEC_LEASE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
MAX_BYTES = 2**16  # a lease record is ~300 bytes
SETTLE_S = 1.0  # an unreadable lease this young may be one another run is writing right now
PID_MAX = 1 << 22  # Linux's pid_max ceiling (4,194,304)
MAX_TIME = 1e11  # seconds since the epoch: year 5138
MAX_TEXT = 512  # characters of a host, job, boot id or pid namespace
_TIMES, _PIDS = ("since", "heartbeat"), ("pid", "pid_start")
_TEXTS = ("holder", "job", "host", "boot_id", "pid_ns")


class LeaseHeld(ConfigError):
    """Another live run holds the run directory."""


class LeaseLost(ConfigError):
    """This run's lease was taken over by another run (it stalled past the timeout)."""


class Superseded(JobspecError):
    """A rank of an earlier attempt of this job (its gang has been restarted without it) was about to write into
    the run directory. The retryable code: a pod that ends this way is an old one, and must not fail the Job."""

    exit_code = EXIT_FAILED


def check_holder(root: str | Path, holder: str, job: str, file: LeaseFile | None = None) -> None:
    """For every rank, right before it writes what the run shares (a checkpoint shard, a metrics line, a sample
    record): returns while `holder`, the lease rank 0 of job `job` held when this attempt started, still holds
    `root`. Otherwise raises Superseded (a later attempt of this job holds it, or none: this rank's gang was
    restarted without it) or LeaseLost (another job's run took it over). A rank frozen (SIGSTOP, a hung machine)
    while the gang was restarted finds here that the new attempt's rank 0 took the lease over, and writes nothing,
    whichever rank it is. One small bounded read: about 20 µs on a local disk (`file`: the lease in an object store,
    runner/checkpoint/remote.py: one GET, a few ms)."""
    current = (file or LeaseFile(Path(root) / LEASE_FILE)).read()
    found = current.get("holder") if isinstance(current, dict) else None
    if found == holder:
        return
    if isinstance(current, dict) and current.get("job") != job:
        raise LeaseLost(f"the lease on {root} was taken over by {describe(current)}: stopping, since two writers "
                        "corrupt each other's checkpoints")  # fmt: skip
    raise Superseded(
        f"{root}: this rank belongs to an earlier attempt of the job (lease {holder[:8]}); the run directory is "
        f"now {describe(current) if isinstance(current, dict) else 'held by no run'}: writing nothing"
    )


def timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={text!r}: give the lease timeout in seconds, e.g. 600")
    return value


class Lease:
    """This process's claim on `root` (see the module docstring)."""

    def __init__(self, root: str | Path, job: str, *, timeout: float | None = None, file: LeaseFile | None = None):
        self.root, self.job = Path(root), job
        self.path = self.root / LEASE_FILE
        self.file = file or LeaseFile(self.path)  # or in an object store (runner/checkpoint/remote.py)
        self.timeout = timeout_s() if timeout is None else timeout
        self.interval = min(60.0, self.timeout / 4)  # several renewals fit in one timeout
        self.holder = uuid.uuid4().hex
        self.since = time.time()
        self.held = False
        self._renewed = 0.0  # time.monotonic() of the last renewal

    def acquire(self) -> None:
        """Take the lease, or a stale one over; LeaseHeld when a live run holds it."""
        self.file.prepare()
        for _ in range(3):  # a holder that releases between our two looks: look again
            if self._create():
                return self._took()
            current = self._read_settled()
            if current is None and not self.file.exists():
                continue
            now = time.time()
            why = "it is unreadable" if current is None else stale_reason(current, _identity(), now, self.timeout)
            if why is None:
                raise LeaseHeld(self._held_message(current))
            log.warning("taking over the lease %s of %s: %s", self.file, describe(current), why)
            seen = current.get("holder") if current is not None else None  # the stale record, as read
            after = self._read() if self._replace(seen) else None  # a changed lease is not written over
            if after is None or after.get("holder") != self.holder:
                raise LeaseHeld(f"{self._held_message(after)} (it took the stale lease over at the same time)")
            return self._took()
        raise LeaseHeld(f"{self.file} keeps appearing and disappearing: another run is starting in {self.root}")

    def beat(self, *, force: bool = False) -> None:
        """Renew the heartbeat (at most every `interval` s unless `force`); LeaseLost when it is not ours."""
        now = time.monotonic()
        if not self.held or (not force and now - self._renewed < self.interval):
            return
        current = self._read()
        if current is None or current.get("holder") != self.holder or not self._replace(self.holder):
            self.held = False
            raise LeaseLost(
                f"the lease on {self.root} was taken over by {describe(current)} (this run last renewed it "
                f"{now - self._renewed:.0f} s ago; {TIMEOUT_ENV}={self.timeout:.0f}): stopping, since two writers "
                "corrupt each other's checkpoints"
            )
        self._renewed = now

    def release(self) -> None:
        """Remove the lease if it is still ours (never raises: it runs while exiting)."""
        if not self.held:
            return
        self.held = False
        try:
            current = self._read()
            if current is not None and current.get("holder") == self.holder:
                self.file.remove()
        except OSError as err:
            log.warning("could not release the lease %s: %s", self.file, err)

    # --- the file -----------------------------------------------------------------------------------------

    def _record(self) -> bytes:
        record = {"holder": self.holder, "job": self.job, **_identity(), "since": self.since, "heartbeat": time.time()}
        return json.dumps(record, indent=1).encode()

    def _create(self) -> bool:
        return self.file.create(self._record())

    def _replace(self, seen: str | None) -> bool:
        """Write a new record over the lease; False when it changed since this run read it holding `seen` (None: an
        unreadable record), checked right before the rename (LeaseFile.replace), or refused by an object store's
        conditional write (runner/checkpoint/remote.py)."""
        return self.file.replace(self._record(), seen)

    def _read(self) -> dict[str, Any] | None:
        return self.file.read()

    def _read_settled(self) -> dict[str, Any] | None:
        """The holder's record; an unreadable one is read again after SETTLE_S (its writer may be mid-write)."""
        record = self._read()
        if record is None:
            time.sleep(SETTLE_S)
            record = self._read()
        return record

    def _took(self) -> None:
        self.held, self._renewed = True, time.monotonic()
        log.info("lease %s taken (holder %s, pid %d)", self.file, self.holder[:8], os.getpid())

    def _held_message(self, current: dict[str, Any] | None) -> str:
        age = time.time() - _float(current, "heartbeat")
        return (
            f"{self.root} is in use by another run: {describe(current)}. Two writers in one run directory corrupt "
            f"each other's checkpoints and metrics. Let that run finish or stop it, or give this run another "
            f"checkpoints.dir. If it is gone (its machine died), its lease expires in {max(self.timeout - age, 0):.0f} "
            f"s ({TIMEOUT_ENV}={self.timeout:.0f}); or delete {self.path} once you are sure"
        )


class LeaseFile:
    """Where the lease record lives: this class, a file on the run directory's volume; runner/checkpoint/remote.py's
    subclass, an object in a bucket written with conditional requests."""

    def __init__(self, path: Path):
        self.path = path

    def __str__(self) -> str:
        return str(self.path)

    def prepare(self) -> None:
        """Make the place the record goes (the run directory). ConfigError (exit 2: the next attempt would meet the
        same) when the run directory is not a directory, or the lease's name holds what a record can never replace
        (a directory: a rename cannot land on it), instead of an OSError traceback and exit 1, which the Job retried
        for ever."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"the run directory {self.path.parent} is a file, not a directory: move it away, or "
                              "give the job another checkpoints.dir") from None  # fmt: skip
        except NotADirectoryError:
            raise ConfigError(f"the run directory {self.path.parent} lies under a file, not a directory: give the "
                              "job another checkpoints.dir") from None  # fmt: skip
        if self.path.is_dir() and not self.path.is_symlink():
            raise ConfigError(f"{self.path} is a directory, where the run's lease record goes: remove it (rm -r "
                              f"{self.path}) or give the job another checkpoints.dir")  # fmt: skip

    def create(self, data: bytes) -> bool:
        """Write the record if there is none (exclusively); False when one is there."""
        return shared_dir.create_exclusive(self.path, data)

    def replace(self, data: bytes, seen: str | None) -> bool:
        """Write the record over the one there (a reader sees the old record or the new one), only while the record
        there is still the one read, held by `seen` (None: unreadable, and still there), checked right before the
        rename (False: not written). A process frozen between its own check and its write (SIGSTOP, a hung node)
        would otherwise bring back, on waking, a lease that a later attempt took over or released."""

        def unchanged() -> bool:
            record = read_record(self.path)
            return record.get("holder") == seen if record is not None else seen is None and self.path.exists()

        return shared_dir.write_atomic(self.path, data, ready=unchanged)

    def read(self) -> dict[str, Any] | None:
        return read_record(self.path)

    def exists(self) -> bool:
        return self.path.exists()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def read_record(path: Path) -> dict[str, Any] | None:
    """The lease record in `path`, its fields checked (`_clean`); None when there is none or it is unreadable: bounded,
    regular files only (a FIFO or a link to /dev/zero in its place is unreadable, not a hang)."""
    try:
        record = files.read_json(path, MAX_BYTES, "lease file")
    except (OSError, ValueError):
        return None
    return _clean(record)


def _clean(record: object) -> dict[str, Any] | None:
    """A lease record whose every known field has its type and range (module docstring), else None."""
    if not isinstance(record, dict):
        return None
    for key in _TIMES:
        value = record.get(key)
        if value is not None and not (isinstance(value, int | float) and not isinstance(value, bool)
                                      and 0 <= value <= MAX_TIME):  # NaN, infinities fail it  # fmt: skip
            return None
    for key in _PIDS:
        value = record.get(key)
        if value is not None and not (type(value) is int and 0 < value <= (PID_MAX if key == "pid" else 1 << 62)):
            return None
    if any(record.get(key) is not None and not (isinstance(record[key], str) and len(record[key]) <= MAX_TEXT)
           for key in _TEXTS):  # fmt: skip
        return None
    return {key: record.get(key) for key in (*_TEXTS, *_TIMES, *_PIDS)}


def stale_reason(holder: dict[str, Any], me: dict[str, Any], now: float, timeout: float) -> str | None:
    """Why the lease `holder` wrote may be taken over by the process `me` (see the module docstring), or None."""
    age = now - _float(holder, "heartbeat")
    if age > timeout:
        return f"its last heartbeat was {age:.0f} s ago ({TIMEOUT_ENV}={timeout:.0f})"
    same_ns = bool(me.get("boot_id")) and (holder.get("boot_id"), holder.get("pid_ns")) == (me["boot_id"], me["pid_ns"])
    pid = holder.get("pid")
    if same_ns and isinstance(pid, int):
        if pid == me["pid"]:
            return "it was left by an earlier run in this process"
        if not _alive(pid, holder.get("pid_start")):
            return f"its process {pid} on this host has exited"
    if os.environ.get("JOB_COMPLETION_INDEX") is not None and holder.get("host") == me["host"] and not same_ns:
        return f"it was held by the previous pod of this Job index ({me['host']}), which has ended"
    return None


def describe(record: dict[str, Any] | None) -> str:
    if record is None:
        return "an unknown holder (unreadable lease file)"
    since = datetime.fromtimestamp(_float(record, "since"), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    beat = time.time() - _float(record, "heartbeat")
    return (f"job {record.get('job')!r} on host {record.get('host')}, pid {record.get('pid')}, since {since}, "
            f"last heartbeat {beat:.0f} s ago")  # fmt: skip


def _float(record: dict[str, Any] | None, key: str) -> float:
    value = (record or {}).get(key)
    return float(value) if isinstance(value, int | float) else 0.0


def _identity() -> dict[str, Any]:
    pid = os.getpid()
    stat = _proc_stat(pid)
    return {"host": socket.gethostname(), "pid": pid, "pid_start": stat[1] if stat else None,
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": _pid_ns()}  # fmt: skip


def _alive(pid: int, start: Any) -> bool:
    """Whether process `pid` (started at `start` clock ticks after boot, when known) still runs here."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc: the signal test is all there is
    state, started = stat
    return state not in ("Z", "X") and (start is None or started == start)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of `pid` from /proc, or None."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # after "pid (comm)": state is field 3, starttime field 22
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _pid_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None
