"""runner/process/lifeline.py, with real processes: a parent that is SIGKILLed, and a child bound to it that gets
SIGTERM (from the kernel, or from its own thread where prctl is unavailable or came too late) and, when it ignores
that, kills itself after the grace. No torch: each case takes about a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.process import lifeline
from tests.runner.train_helpers import ROOT

# The bound child: notes each SIGTERM in a file and otherwise ignores it (a worker stuck in a C call); `kernel`
# off: the prctl is taken away, leaving the polling thread. It has a child of its own that watches nothing (as the
# tokenizer pool's processes), its pid in the file's name + ".kid".
CHILD = """
import os, signal, subprocess, sys, time
from runner.process import lifeline
if sys.argv[2] == "poll":
    lifeline.parent_death_signal = lambda sig: False
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1] + ".kid", "w").write(str(kid.pid))
signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1], "a").write("TERM\\n"))
line = lifeline.bind()
print(os.getpid(), int(line.kernel), flush=True)
while True:
    time.sleep(0.05)
"""
# The parent: starts the child, passes its pid on, then waits to be killed.
PARENT = """
import os, subprocess, sys, time
env = {**os.environ, "JOBSPEC_SUPERVISOR_PID": sys.argv[3] if sys.argv[3] != "me" else str(os.getpid()),
       "JOBSPEC_STOP_GRACE_S": "1"}
subprocess.Popen([sys.executable, "-c", sys.argv[4], sys.argv[1], sys.argv[2]], env=env)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running: not gone and not a zombie (an orphan's new parent may be slow to reap it, or never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def gone_within(pid: int, seconds: float) -> float | None:
    """Seconds until `pid` stopped running, or None if it still ran after `seconds`."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not alive(pid):
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def kid(tmp_path: Path) -> int:
    """The pid of the bound child's own child."""
    return int((tmp_path / "terms.kid").read_text())


def start_pair(tmp_path: Path, mode: str, parent: str = "me") -> tuple[subprocess.Popen, int, bool]:
    parent_proc = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "terms"), mode, parent, CHILD],
                                   cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert parent_proc.stdout is not None
    pid, kernel = parent_proc.stdout.readline().split()
    return parent_proc, int(pid), kernel == "1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_prctl_is_available_here():
    """CI runs Linux: the kernel's path must be the one these tests and the pods take. (Asked by a new process: this
    one's own setting stays as it was, and a fork of a threaded test process could deadlock.)"""
    ask = "import signal, sys\nfrom runner.process import lifeline\n" \
          "sys.exit(not lifeline.parent_death_signal(signal.SIGTERM))"  # fmt: skip
    assert subprocess.run([sys.executable, "-c", ask], cwd=ROOT, timeout=60).returncode == 0


@pytest.mark.parametrize("mode", ["kernel", "poll"])
def test_a_killed_parent_stops_its_child_then_kills_it_after_the_grace(tmp_path, mode):
    parent, child, kernel = start_pair(tmp_path, mode)
    try:
        assert kernel == (mode == "kernel" and sys.platform.startswith("linux"))
        time.sleep(0.3)
        assert alive(child) and not (tmp_path / "terms").exists(), "the child stopped while its parent lived"
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        took = gone_within(child, 5)
        assert took is not None, "the child outlived its SIGKILLed parent by 5 s"
        # SIGTERM first (one, whoever sent it), and the kill only after the 1 s grace
        assert (tmp_path / "terms").read_text() == "TERM\n"
        assert took > 0.8, f"killed {took:.2f} s after its parent: before the grace"
        assert gone_within(kid(tmp_path), 2) is not None, "the child's own child outlived it"
    finally:
        for pid in (child, kid(tmp_path)):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_parent_gone_before_the_bind_still_stops_the_child(tmp_path):
    """The race prctl leaves: the supervisor died before the worker asked; its pid is then no longer the parent's."""
    parent, child, kernel = start_pair(tmp_path, "kernel", parent="1")  # the pid the worker expects: not its parent
    try:
        assert not kernel, "a parent that is not the expected one cannot be the kernel's to watch"
        assert gone_within(child, 5) is not None, "the child ran on although its expected parent was gone"
        assert (tmp_path / "terms").read_text() == "TERM\n"
    finally:
        parent.kill()
        parent.wait(5)
        for pid in (child, kid(tmp_path)):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_armed_child_still_importing_ends_at_once(tmp_path):
    """`arm`, a worker's first line: before its stop handler exists (its imports take seconds), the parent's death
    ends it at once, by the default action of the kernel's SIGTERM."""
    importing = "import os, time\nfrom runner.process import lifeline\nlifeline.arm()\nprint(os.getpid(), 1, " \
                "flush=True)\nwhile True:\n    time.sleep(0.05)\n"  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "terms"), "kernel", "me", importing],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert parent.stdout is not None
    child = int(parent.stdout.readline().split()[0])
    try:
        time.sleep(0.3)
        assert alive(child), "the armed child stopped while its parent lived"
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        took = gone_within(child, 5)
        assert took is not None and took < 2, f"the armed child outlived its parent ({took})"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_no_supervisor_no_lifeline(monkeypatch):
    """A worker started by hand (or in a test's process) has no supervisor to follow: nothing is bound."""
    monkeypatch.delenv(lifeline.ENV_PARENT, raising=False)
    assert lifeline.bind() is None
