"""A process's lifeline to its parent: a worker ends when its supervisor ends, however the supervisor ended.

The supervisor forwards the stop signals it can catch (runner/process/supervisor.py). What it cannot catch, a
SIGKILL (`kill -9`, the kernel's OOM killer, a runtime killing only the top process), would leave its workers
training and holding their GPUs, with nobody left to stop them (the first H200 record, issue 41). So each worker
binds itself to its supervisor as it starts:

- Linux: `prctl(PR_SET_PDEATHSIG, SIGTERM)`: the kernel sends SIGTERM when the parent *thread* that forked the
  worker exits. The supervisor starts its workers from its main thread (it installs signal handlers around the
  start, which Python allows only there), so that thread's exit is the supervisor's.
- The race: a supervisor that died before the prctl gets no signal sent for it; the worker then finds its parent
  pid is no longer the one the supervisor passed in $JOBSPEC_SUPERVISOR_PID and stops itself.
- As early as possible: the worker calls `arm` before its heavy imports (until its stop handler is installed a
  SIGTERM simply ends it: nothing to save), then `bind` once the handler is in place.
- Everywhere (and where prctl is unavailable, the only mechanism): a daemon thread polls the parent pid every
  POLL_S and stops the worker itself when it changed.

Which signal. SIGTERM, not SIGKILL: a worker that loses its supervisor takes the path of a forwarded stop, it
checkpoints the steps trained and exits 143, so a `jobspec run` killed by the OOM killer or `kill -9` resumes where
it was. But nobody is left to enforce the stop's deadline, and a worker stuck in a C call (a hung collective, a
huge allocation) never reads its stop flag; so the thread enforces it: `grace_s` after the parent died (the grace the
supervisor itself would have given, $JOBSPEC_STOP_GRACE_S) it SIGKILLs its own process, which frees the GPU whatever
the process was doing (its own child processes first). torchrun's elastic agent stops its workers the same way
(SIGTERM, then SIGKILL after a timeout, 30 s by default) but only while the agent lives; a SIGKILLed torchrun leaves
its workers running. The thread can run while the main thread is stuck: torch releases the GIL in its operators and
collectives.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("jobspec.runner")

ENV_PARENT = "JOBSPEC_SUPERVISOR_PID"  # the supervisor's pid, set by it for each worker
ENV_GRACE = "JOBSPEC_STOP_GRACE_S"  # seconds from the supervisor's death to the worker's own SIGKILL
DEFAULT_GRACE_S = 30.0
POLL_S = 0.2  # how often the thread reads the parent pid: the portable path's delay
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux prctl). False where the
    platform has no such call or it failed; the caller then relies on polling."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own symbols: libc's prctl among them
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):  # a static or unusual libc
        return False


@dataclass
class Lifeline:
    parent: int  # the supervisor's pid
    grace_s: float  # from its death to this process's SIGKILL
    kernel: bool  # the kernel sends SIGTERM on the parent's death (prctl set while the parent lived)

    def watch(self) -> None:
        """The watching thread: waits for the parent to go, stops this process, and kills it `grace_s` later."""
        while os.getppid() == self.parent:
            time.sleep(POLL_S)
        if not self.kernel:  # the kernel sent nothing: do what its SIGTERM does
            os.kill(os.getpid(), signal.SIGTERM)
        # The deadline first, on a thread that takes no lock: a log line can block (a full pipe, a handler's lock
        # held by the stuck main thread) and must not hold the kill back.
        threading.Thread(target=_kill_after, args=(self.grace_s,), name="jobspec-lifeline-kill", daemon=True).start()
        log.warning("the supervisor (pid %d) is gone: this worker checkpoints and stops; it kills itself in %.0f s "
                    "if it has not stopped by then (the steps since the last checkpoint lost)",
                    self.parent, self.grace_s)  # fmt: skip


def _kill_after(seconds: float) -> None:
    """SIGKILL this process `seconds` from now, and its child processes first: DataLoader workers would notice within
    seconds, but the tokenizer pool's (runner/data/prepare.py) block on a queue whose writer they hold themselves."""
    time.sleep(seconds)
    for pid in _children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _children() -> list[int]:
    """This process's child processes, from /proc (none where there is no /proc/PID/task/TID/children)."""
    found = []
    for listing in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(pid) for pid in listing.read_text().split()]
    return found


def arm() -> None:
    """The first line of a worker, before its imports (torch and transformers: seconds): the kernel's SIGTERM is
    asked for already, and while the stop handler is not installed yet its default action ends the process at once,
    which is right, as there is nothing to save. A supervisor already gone ends it now. `bind` follows."""
    raw = os.environ.get(ENV_PARENT, "")
    if raw.isdigit():
        parent_death_signal(signal.SIGTERM)
        if os.getppid() != int(raw):
            os.kill(os.getpid(), signal.SIGTERM)


def bind() -> Lifeline | None:
    """Bind this worker to the supervisor named by $JOBSPEC_SUPERVISOR_PID (None when it is unset: a worker started
    by hand or a test's in-process run, which have no supervisor to follow). Call it once the SIGTERM handler is in
    place (the worker's StopFlag), as early as that (`arm` covers the time before)."""
    raw = os.environ.get(ENV_PARENT, "")
    if not raw.isdigit():
        return None
    try:
        grace = float(os.environ.get(ENV_GRACE, DEFAULT_GRACE_S))
    except ValueError:
        grace = DEFAULT_GRACE_S
    parent = int(raw)
    kernel = parent_death_signal(signal.SIGTERM)
    # The supervisor may have died before the prctl: then no signal comes and the parent pid is already another's
    # (init's, or a subreaper's), which the thread sees at its first look.
    line = Lifeline(parent, max(grace, 0.0), kernel and os.getppid() == parent)
    threading.Thread(target=line.watch, name="jobspec-lifeline", daemon=True).start()
    return line
