"""Host memory and CPUs as the container sees them: the cgroup limit, not the machine's total.

A pod with `resources.limits.memory: 32Gi` on a 1 TiB node is OOM-killed at 32 GiB, so sizing
dataloader workers (or, on CPU, the micro-batch) from /proc/meminfo alone is wrong. Reads cgroup v2
(`memory.max`, `memory.current`, `cpu.max`) or v1 (`memory/memory.limit_in_bytes`, `cpu/cpu.cfs_*`)
under an injectable root, capped by /proc/meminfo. Pure file reads: no torch, no psutil.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as a huge page-aligned number (2^63 - 4096 on x86-64); anything at or
# above 2^60 bytes (1 EiB) is no limit in practice.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class HostInfo:
    """Host memory in bytes and usable CPUs, for this container."""

    total_bytes: int  # cgroup limit, or MemTotal when there is none (or it is larger)
    available_bytes: int  # what this container can still allocate without being OOM-killed
    cpus: int  # cores this process may use: cgroup CPU quota and sched affinity
    source: str = "meminfo"  # "cgroup2" | "cgroup1" | "meminfo": where the memory limit came from


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None) -> int | None:
    """An integer file value; None for missing files, "max" and the v1 "unlimited" sentinel."""
    if text is None or text == "max":
        return None
    try:
        value = int(text.split()[0])
    except (ValueError, IndexError):
        return None
    return value if 0 <= value < _UNLIMITED else None


def _stat(path: Path, key: str) -> int:
    """One counter from a memory.stat file (bytes), 0 when absent."""
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _meminfo(path: Path) -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) in bytes; the file gives kB (KiB)."""
    values: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * 1024
    if "MemTotal" not in values:
        return None
    return values["MemTotal"], values.get("MemAvailable", values.get("MemFree", values["MemTotal"]))


def _chain(base: Path, proc_cgroup: Path, controller: str) -> list[Path]:
    """This process's cgroup directory under `base` and its ancestors, innermost first.

    With a cgroup namespace (Kubernetes, Docker on v2) /proc/self/cgroup says "/" and `base` is the
    container's own cgroup; without one the host hierarchy is mounted and the path leads to it.
    Limits nest, so every level counts. Levels missing from the mount are skipped.
    """
    rel = "/"
    for line in (_read(proc_cgroup) or "").splitlines():  # "0::/path" (v2) or "4:memory:/path" (v1)
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "-", "")
        if controller in controllers.split(","):  # v2's line has no controllers: ""
            rel = path
    parts = [p for p in rel.strip("/").split("/") if p and p != ".."]
    dirs = [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def cgroup_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[int, int, str] | None:
    """(limit, usage, version) of the tightest memory cgroup over this process, in bytes; None: unlimited.

    Usage excludes inactive file cache, which the kernel reclaims before it OOM-kills (the kubelet's
    "working set" does the same): counting it would make a pod that read its data set look full.
    """
    layouts = (
        ("cgroup2", root, "", "memory.max", "memory.current", "inactive_file"),
        ("cgroup1", root / "memory", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    )
    for version, base, controller, limit_file, usage_file, cache in layouts:
        best: tuple[int, int, str] | None = None
        for d in _chain(base, proc_cgroup, controller):
            limit = _int(_read(d / limit_file))
            if limit is None:
                continue
            usage = max(0, (_int(_read(d / usage_file)) or 0) - _stat(d / "memory.stat", cache))
            if best is None or limit - usage < best[0] - best[1]:  # the least headroom binds
                best = (limit, usage, version)
        if best:
            return best
    return None


def oom_kills(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Processes the kernel's OOM killer ended in this cgroup (v2 memory.events, v1 memory.oom_control
    `oom_kill`); None when neither file is readable. The supervisor compares it around an attempt."""
    layouts = ((root, "", "memory.events"), (root / "memory", "memory", "memory.oom_control"))
    for base, controller, name in layouts:
        for d in _chain(base, proc_cgroup, controller):
            if (d / name).is_file():
                return _stat(d / name, "oom_kill")
    return None


def host_oom(before: int | None, after: int | None) -> str | None:
    """The reason to report when the OOM-kill counter grew during an attempt; None when it did not."""
    if before is None or after is None or after <= before:
        return None
    return (f"host out of memory: the kernel's OOM killer ended {after - before} process(es) of this container; "
            "raise hardware.memory, lower data.num_workers, or use a tier without CPU offload")  # fmt: skip


def cgroup_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CPU quota over this process in cores (quota / period), None when unlimited."""
    quotas: list[float] = []
    for d in _chain(root, proc_cgroup, ""):
        quota, _, period = (_read(d / "cpu.max") or "").partition(" ")  # "max 100000", "250000 100000" (us)
        q, p = _int(quota), _int(period)
        if q and p:
            quotas.append(q / p)
    v1 = [] if quotas else _chain(root / "cpu", proc_cgroup, "cpu")  # v1's cpu (often co-mounted with cpuacct)
    for d in v1:
        q, p = _read(d / "cpu.cfs_quota_us"), _int(_read(d / "cpu.cfs_period_us"))  # quota -1: unlimited
        if q and q.lstrip("-").isdigit() and int(q) > 0 and p:
            quotas.append(int(q) / p)
    return min(quotas) if quotas else None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def probe_host(root: Path = CGROUP_ROOT, meminfo: Path = MEMINFO, proc_cgroup: Path = PROC_CGROUP) -> HostInfo:
    """Host memory and CPUs available to this container (paths injectable for tests)."""
    total, available = _meminfo(meminfo) or (0, 0)
    source = "meminfo"
    cgroup = cgroup_memory(root, proc_cgroup)
    if cgroup:
        limit, usage, version = cgroup
        # The cgroup can be larger than the machine (a limit nobody lowered): the smaller wins.
        if not total or limit <= total:
            source = version
        total = min(total, limit) if total else limit
        available = min(available, limit - usage) if available else limit - usage
    quota = cgroup_cpus(root, proc_cgroup)
    # A quota of 2.5 cores lets 3 threads run part of the time: round up, never below 1.
    cpus = min(_affinity(), math.ceil(quota)) if quota else _affinity()
    return HostInfo(total_bytes=total, available_bytes=max(0, available), cpus=max(1, cpus), source=source)


# Dataloader sizing. A forked worker shares the parent's pages copy-on-write, but refcount updates
# copy what it touches: ~0.3-0.5 GiB RSS each with torch and a tokenizer imported, plus its
# prefetched batches (small: token ids). Budget 0.5 GiB per worker.
WORKER_BYTES = 512 * 1024**2
MAX_WORKERS = 8  # tokenised SFT batches are cheap to collate; more workers only cost memory and fork time
WORKER_SHARE = 0.5  # at most half of the spare host memory goes to workers; the rest absorbs spikes
# Per training process on a GPU node: interpreter, torch, CUDA/HIP runtime host allocations, pinned
# staging buffers. Below this much spare memory per rank the host is "tight": no workers, no pinning.
HOST_PROCESS_BYTES = 2 * 1024**3
HOST_TIGHT_BYTES = 2 * 1024**3
# Offload tiers keep optimizer state (16 bytes per trainable param / ranks) in host RAM: at most this
# share of what is available, the rest stays for the processes, workers and page cache.
HOST_OFFLOAD_SHARE = 0.8


def offload_fits(host_bytes_per_rank: int, local_ranks: int, host: HostInfo) -> bool:
    """Whether `local_ranks` processes can each offload `host_bytes_per_rank` to this host."""
    return host_bytes_per_rank * local_ranks <= HOST_OFFLOAD_SHARE * host.available_bytes


@dataclass(frozen=True)
class LoaderSettings:
    num_workers: int  # DataLoader workers per rank
    pin_memory: bool
    reasons: tuple[str, ...]


def loader_settings(
    host: HostInfo, *, on_gpu: bool, local_ranks: int, need_per_rank: int, requested: int | None = None
) -> LoaderSettings:
    """DataLoader workers and pin_memory per rank from the container's CPUs and spare host memory.

    `need_per_rank`: host bytes each training process needs besides the workers (offloaded optimizer
    state on GPU; the whole training footprint on CPU). `requested`: the spec's number, honoured.
    """
    gib = 1024**3
    spare = host.available_bytes - local_ranks * need_per_rank  # bytes left for workers, all ranks
    tight = spare < local_ranks * HOST_TIGHT_BYTES
    by_cpu = max(0, host.cpus // local_ranks - 1)  # one core stays with the training process
    by_mem = 0 if tight else int(spare * WORKER_SHARE) // (local_ranks * WORKER_BYTES)
    auto = min(by_cpu, MAX_WORKERS, by_mem)
    why = (
        f"min({host.cpus} cpus / {local_ranks} ranks - 1 = {by_cpu}, cap {MAX_WORKERS}, "
        f"{spare / gib:.1f} GiB spare host memory x {WORKER_SHARE} / {WORKER_BYTES / gib:.1f} GiB per worker "
        f"/ {local_ranks} ranks = {by_mem})"
    )
    if not on_gpu:  # measured: a worker on a 2-core box cut the quick start from 17k to 12k tokens/s
        auto, why = 0, "CPU training: torch's threads use every core, collating in process is cheaper"
    elif tight:
        why = (
            f"host memory tight: {host.available_bytes / gib:.1f} GiB available, {local_ranks} ranks x "
            f"{need_per_rank / gib:.1f} GiB needed leaves {spare / gib:.1f} GiB < {local_ranks} x "
            f"{HOST_TIGHT_BYTES / gib:.0f} GiB"
        )
    if requested is None:
        workers, reasons = auto, [f"dataloader workers auto -> {auto}: {why}"]
    else:
        workers, reasons = requested, [f"dataloader workers {requested} from the spec (auto would give {auto}: {why})"]
    left = spare - local_ranks * workers * WORKER_BYTES  # after the workers take their share
    pin = on_gpu and left >= local_ranks * HOST_TIGHT_BYTES
    if not on_gpu:
        reasons.append("pin_memory off: no GPU to copy to")
    else:
        reasons.append(
            f"pin_memory {'on' if pin else 'off'}: {left / gib:.1f} GiB host memory left after workers "
            f"{'>=' if pin else '<'} {local_ranks} ranks x {HOST_TIGHT_BYTES / gib:.0f} GiB"
        )
    return LoaderSettings(workers, pin, tuple(reasons))
