"""The terminal progress bar: the current loss on every step, log lines printed above it, not through it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.runner.train_helpers import ROOT, timeout_s

SCRIPT = r"""
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from runner.output.metrics import Progress
bar = Progress(4, 0, enabled=True)
for i in range(4):
    logging.getLogger("jobspec.runner").info("log line %d", i)
    bar.update(1.0 / (i + 1))
    time.sleep(0.15)
bar.close()
logging.getLogger("jobspec.runner").info("after the bar")
"""


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_the_bar_shows_the_loss_and_log_lines_do_not_break_it():
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column terminal
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=follower, stdout=follower, stderr=follower, cwd=ROOT)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=timeout_s(120)) == 0
    text = out.decode()
    assert "loss=0.5000" in text and "loss=0.2500" in text  # the loss of each step reaches the bar
    lines = [line.rstrip("\r").split("\r")[-1] for line in text.replace("\x1b[A", "").split("\n")]
    for i in range(4):  # every log line is whole, on its own line (not glued to a bar)
        assert any(line.strip() == f"log line {i}" for line in lines), text
    assert any(line.strip() == "after the bar" for line in lines)
