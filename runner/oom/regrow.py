"""Growing back after a shrink: an OOM spike (fragmentation, an eval pass, a long batch) should not cost
the rest of the run its throughput.

After `memory.regrow_after` steps without an OOM at the smaller micro-batch, the next step is tried at the
micro-batch the run had before its first shrink. A try that runs out is absorbed like any OOM (one shrink,
about a step) and the wait doubles; after `TRIES` failed tries the smaller micro-batch stays. Every try is
logged with its numbers and recorded as an `oom_regrow` event in metrics.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass

TRIES = 3


@dataclass
class Regrow:
    wait: int | None  # steps at the smaller micro-batch before a try; None: never
    target: int | None = None  # the micro-batch before the first shrink
    since: int = 0  # steps completed since the last shrink
    failed: int = 0  # tries that ran out
    trying: int | None = None  # the micro-batch of the try in flight

    def shrunk(self, from_mbs: int) -> None:
        """An OOM shrink happened (a try that failed counts as one)."""
        if self.target is None:
            self.target = from_mbs
        if self.trying is not None:
            self.failed += 1
            self.wait = None if self.wait is None else self.wait * 2
            self.trying = None
        self.since = 0

    def stepped(self, micro_batch: int) -> None:
        """A step completed at `micro_batch`."""
        if self.trying is not None and micro_batch == self.trying:
            self.target = None if micro_batch >= (self.target or 0) else self.target  # back where it was: done
            self.trying, self.failed = None, 0
        self.since += 1

    def proposal(self, micro_batch: int) -> int | None:
        """The micro-batch to try on the next step, or None to stay."""
        if self.wait is None or self.target is None or micro_batch >= self.target:
            return None
        if self.failed >= TRIES or self.since < self.wait:
            return None
        self.trying = self.target
        return self.target
