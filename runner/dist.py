"""Who this process is, the process group, and the small CPU-side collectives the loop agrees on.

Control values (the stop flag, a step's token counts, plan agreement, OOM flags) go through a gloo
group even when training runs on NCCL: they live on the CPU, so agreeing on them never waits for the
GPU stream (no `.item()` sync per micro-step). With one process every collective is the identity.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from jobspec.errors import ConfigError

log = logging.getLogger("jobspec.runner")
T = TypeVar("T")
TIMEOUT_ENV = "JOBSPEC_DIST_TIMEOUT_S"
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, from the torchrun-style variables the supervisor sets."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @classmethod
    def from_env(cls) -> DistEnv:
        get = os.environ.get
        world = int(get("WORLD_SIZE", "1"))
        return cls(int(get("RANK", "0")), int(get("LOCAL_RANK", "0")), world, int(get("LOCAL_WORLD_SIZE", world)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_process_group(env: DistEnv, device: torch.device, *, needed: bool, timeout_s: float = 600.0) -> bool:
    """Join the job's process group (NCCL/RCCL on GPU, gloo on CPU) when there are several ranks or
    `needed` (FSDP wants a group even alone). Returns whether a group exists.

    `timeout_s` (the spec's `scheduling.collective_timeout_seconds`; JOBSPEC_DIST_TIMEOUT_S overrides it) bounds
    the rendezvous and every collective: one that hangs for a reason the heartbeat cannot see (a live rank stuck
    elsewhere) fails the attempt, which the Job retries, instead of waiting for ever."""
    if dist.is_initialized():
        return True
    if env.world_size == 1 and not needed:
        return False
    timeout = timedelta(seconds=collective_timeout_s(timeout_s))
    backend = "nccl" if device.type == "cuda" else "gloo"  # torch maps "nccl" to RCCL on ROCm builds
    kwargs: dict = {}
    if device.type == "cuda":  # NCCL binds one device; torch refuses a device_id without an index
        kwargs["device_id"] = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        kwargs["store"] = dist.HashStore()  # alone and in-process (tests): no rendezvous needed
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    log.info("process group: %s, rank %d of %d", backend, env.rank, env.world_size)
    return True


def collective_timeout_s(spec_s: float) -> float:
    """JOBSPEC_DIST_TIMEOUT_S when set (a debugging override), else the spec's value."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else spec_s
    except ValueError:
        value = -1.0
    if not value > 0:  # nan too
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r}: give the collective timeout in seconds, e.g. 600")
    return value


_HOST = threading.local()


@contextmanager
def host_side() -> Iterator[None]:
    """Marks control-plane work that lives in host memory whatever the device (the values below, the checkpoint's
    manifest entries gathered over the gloo group): a GPU's allocator never sees it, so the OOM-anywhere injector
    (runner/oom/anywhere.py) does not count it on a CPU run either, where the host is the training device."""
    _HOST.depth = getattr(_HOST, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST.depth -= 1


def on_host_side() -> bool:
    return getattr(_HOST, "depth", 0) > 0


def joined(collective: Callable[[], T], what: str = "collective", *,
           is_oom: Callable[[BaseException], bool] = lambda exc: isinstance(exc, torch.OutOfMemoryError),
           release: Callable[[], None] = lambda: None) -> T:  # fmt: skip
    """Issue `collective`, which the other ranks may have entered already: an out-of-memory error (`is_oom`) raised
    by the call itself on this rank, before it joined, is retried once after `release()`, so that this rank joins and
    nobody waits for it in vain (the one that remains propagates; the collective timeout bounds the others' wait)."""
    try:
        return collective()
    except Exception as exc:
        if not is_oom(exc):
            raise
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        traceback.clear_frames(exc.__traceback__)  # its frames may hold the failed call's tensors
    log.warning("out of memory issuing a %s (%s): issuing it again, the other ranks wait in it", what, reason)
    release()
    return collective()


class Control:
    """CPU collectives over all ranks (float64 values: exact for integers below 2**53)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.group = None
        if world_size > 1 and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # every rank calls this, in the same order

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if self.world_size == 1:
            return list(values)
        with host_side():
            t = torch.tensor(values, dtype=torch.float64)
            joined(lambda: dist.all_reduce(t, op=_OPS[op], group=self.group), "control all-reduce")
            return t.tolist()

    def from_rank0(self, text: str) -> str:
        """Rank 0's `text` (hexadecimal digits, at most 64) on every rank: summed as float64 words of 32 bits each,
        which carry it exactly, with zeros from the other ranks."""
        if self.world_size == 1:
            return text
        padded = text + "0" * (-len(text) % 8)
        words = [float(int(padded[i : i + 8], 16)) for i in range(0, len(padded), 8)]
        values = self.all_reduce([float(len(text)), *words, *[0.0] * (8 - len(words))])
        return "".join(f"{int(w):08x}" for w in values[1:])[: int(values[0])]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any rank (all-reduce MAX)."""
        return bool(self.all_reduce([float(flag)], "max")[0])

    def reduce_min(self, value: int) -> int:
        return int(self.all_reduce([float(value)], "min")[0])

    def barrier(self) -> None:
        if self.world_size > 1:
            with host_side():
                dist.barrier(group=self.group)

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's `obj`, in rank order (pickled, over the gloo group)."""
        if self.world_size == 1:
            return [obj]
        parts: list[object] = [None] * self.world_size
        with host_side():
            dist.all_gather_object(parts, obj, group=self.group)
        return parts


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
