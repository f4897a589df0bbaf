"""Bounded summaries of a long run's records: what `jobspec report` plots and `plan --from` takes medians of.

A run that logs every step for weeks writes millions of records; the summaries here keep a fixed number of
values whatever the count, exact while the run fits in them:
- StepSeries: one series of records (train or eval) by step, in at most `cap` buckets of consecutive records
  (sums for the means, the record with the peak memory and the one with the best eval loss);
- BoundedSample: a systematic sample of values for a median.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jobspec.report.metrics import Record

MAX_POINTS = 2000  # per series: more than a plot's width in pixels
MEANS = ("loss", "lr", "tokens_per_s", "mem_total_bytes", "eval_loss",  # plotted as the mean of a bucket
         "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "router_aux_loss",
         "reward", "reward_std", "completions/mean_length")  # the last three: GRPO's
PEAK, BEST = "mem_used_bytes", "eval_loss"  # the largest and the smallest are kept with their record


@dataclass
class Bucket:
    """Consecutive records of one series folded into one point: the latest record, sums for the means, and the
    records with the peak memory and the best eval loss."""

    rec: Record  # the latest record folded in: the point's step, and what the summary shows for it
    n: int = 0  # records folded in
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    peak: Record | None = None
    best: Record | None = None

    @classmethod
    def of(cls, rec: Record) -> Bucket:
        bucket = cls(rec)
        bucket.add(rec)
        return bucket

    def add(self, rec: Record) -> None:
        """Take in the record that follows the bucket's last."""
        self.rec, self.n = rec, self.n + 1
        for key in MEANS:
            if key in rec:
                self.sums[key] = self.sums.get(key, 0.0) + rec[key]
                self.counts[key] = self.counts.get(key, 0) + 1
        if PEAK in rec and (self.peak is None or rec[PEAK] > self.peak[PEAK]):
            self.peak = rec
        if BEST in rec and (self.best is None or rec[BEST] <= self.best[BEST]):
            self.best = rec

    def fold(self, other: Bucket) -> None:
        """Take in the bucket that follows this one."""
        self.rec, self.n = other.rec, self.n + other.n
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + other.counts[k]
        if other.peak is not None and (self.peak is None or other.peak[PEAK] > self.peak[PEAK]):
            self.peak = other.peak
        if other.best is not None and (self.best is None or other.best[BEST] <= self.best[BEST]):
            self.best = other.best

    def mean(self, key: str) -> float | None:
        return self.sums[key] / self.counts[key] if self.counts.get(key) else None


class StepSeries:
    """The train (or eval) records of a run, one per step, in at most `cap` buckets of `stride` consecutive
    records: while the run fits, one record a bucket (exact); then each time it fills, neighbours merge and
    the stride doubles. A record for a step at or before the last one (a resume redoing steps) drops the
    buckets from that step on; with a stride above 1 the bucket it falls in goes too (at most stride records)."""

    def __init__(self, cap: int = MAX_POINTS) -> None:
        self.cap = cap
        self.buckets: list[Bucket] = []
        self.stride = 1

    def add(self, rec: Record) -> None:
        step = rec["step"]
        while self.buckets and self.buckets[-1].rec["step"] >= step:
            self.buckets.pop()
        if self.buckets and self.buckets[-1].n < self.stride:
            self.buckets[-1].add(rec)
            return
        self.buckets.append(Bucket.of(rec))
        if len(self.buckets) > self.cap:
            merged = self.buckets[::2]
            for into, nxt in zip(merged, self.buckets[1::2], strict=False):
                into.fold(nxt)
            self.buckets, self.stride = merged, self.stride * 2

    @property
    def count(self) -> int:
        """Records behind the series (one per step)."""
        return sum(b.n for b in self.buckets)

    @property
    def records(self) -> list[Record]:
        """One record per point, by step: every record while the run fits in `cap`."""
        return [b.rec for b in self.buckets]

    def points(self, key: str, scale: float = 1.0) -> list[tuple[int, float]]:
        """(step, value) per point: the bucket's mean, or for PEAK its largest."""
        if key == PEAK:
            return [(b.rec["step"], b.peak[PEAK] * scale) for b in self.buckets if b.peak is not None]
        return [(b.rec["step"], m * scale) for b in self.buckets if (m := b.mean(key)) is not None]


class BoundedSample:
    """A systematic sample of at most `cap` values for a median: every value while they fit, then every
    2nd, 4th, ... (the stride doubles each time the sample fills). Exact for up to `cap` values."""

    def __init__(self, cap: int = 4096) -> None:
        self.cap = cap
        self.values: list[float] = []
        self.count = 0
        self.stride = 1

    def add(self, value: float) -> None:
        if self.count % self.stride == 0:
            self.values.append(value)
            if len(self.values) > self.cap:
                self.values = self.values[::2]
                self.stride *= 2
        self.count += 1
