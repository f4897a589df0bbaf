"""A long action of the runner, logged when it starts and when it ends with its duration: never silent.

    with phase("building the model"):          # INFO "building the model ..."
        model = build_model(...)               # INFO "building the model: done in 4.37 s (CPU 4.10 s)"

A user reading the log (or `jobspec run`'s output) can tell a slow step from a hang: every phase of start-up (data,
plan and trace, model build, probe steps, checkpoint load) and of an OOM's recovery (the shrink's release, a tier
step-down's checkpoint, hand-over, teardown, plan and build) says it began, and its end says how long it took. A
phase that raises says so too ("...: failed after 2.10 s (RuntimeError)"), and the exception goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("jobspec.runner")


@dataclass
class Timed:
    """What a phase took: wall and CPU seconds (this process's), filled in when it ends."""

    wall_s: float = 0.0
    cpu_s: float = 0.0


@contextmanager
def phase(what: str, *args: object, level: int = logging.INFO) -> Iterator[Timed]:
    """Log `what % args` + " ..." now and "...: done in W s (CPU C s)" at the end; yields its `Timed`."""
    text = what % args if args else what
    timed = Timed()
    log.log(level, "%s ...", text)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield timed
    except BaseException as exc:
        timed.wall_s, timed.cpu_s = time.perf_counter() - wall, time.process_time() - cpu
        log.log(level, "%s: failed after %.2f s (%s)", text, timed.wall_s, type(exc).__name__)
        raise
    timed.wall_s, timed.cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    log.log(level, "%s: done in %.2f s (CPU %.2f s)", text, timed.wall_s, timed.cpu_s)
