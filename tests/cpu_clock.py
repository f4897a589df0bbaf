"""How a test bounds the cost of one computation: CPU seconds of this process, the garbage collector held off.

A hostile input must be refused in a bounded time, and a test that says so must not fail for reasons that have
nothing to do with the input. Two such reasons were measured in CI on a 2-core machine:

- wall time stretches under load (xdist workers, background builds): hence CPU time, `time.process_time`;
- a full collection of a pytest worker's heap, late in the suite, costs that process 1-2 s of CPU time, and it
  lands in whichever small computation happens to allocate the object that triggers it (1.26 s inside a 2 ms
  refusal of a deep --set value, CI of 2026-11-29).

`cpu_seconds()` times its block with the collector off, so the figure is the block's own work. A block that builds
a great many objects still pays for allocating them; only the heap-walk is left out. It does not collect first: with
a large heap that walk is the very cost left out, and as many times as the suite times a block (896 collections took
247 s of a 280 s run of the hostile-input files beside three built models).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class CpuSpent:
    seconds: float = 0.0


@contextmanager
def cpu_seconds() -> Iterator[CpuSpent]:
    """`with cpu_seconds() as spent: ...`, then `spent.seconds`: the block's CPU time, no collection inside it."""
    spent = CpuSpent()
    was_enabled = gc.isenabled()
    gc.disable()
    start = time.process_time()
    try:
        yield spent
    finally:
        spent.seconds = time.process_time() - start
        if was_enabled:
            gc.enable()
