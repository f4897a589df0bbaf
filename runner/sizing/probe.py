"""What this process trains on: its GPU (or the CPU) and the host, probed once at start.

Memory comes from the vendor library when it answers (pynvml on NVIDIA, amdsmi on AMD: they do not
need a CUDA/HIP context), else from `torch.cuda.mem_get_info`; every backend call is guarded and a
failure falls back to torch with a warning. Capabilities come from torch (`is_bf16_supported`),
never from a list of names. Tests replace the `_torch_view`, `_nvml_memory` and `_amdsmi_memory`
boundary functions (or the vendor modules they call) to fake a GPU.

Also the search of the planner's probe steps: `largest_passing`, which `runner.sizing.plan.verify_micro_batch`
runs with `runner.oom.detect.oom_guard` (a training step that answers "did it fit?").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runner.sizing.hostmem import HostInfo, probe_host

log = logging.getLogger("jobspec.runner")
GiB = 1024**3


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator as this rank sees it (or the CPU, with the container's host memory)."""

    vendor: str  # "cuda" | "rocm" | "cpu"
    name: str
    total_bytes: int
    free_bytes: int  # what this process can allocate now: the device's free memory plus what its allocator holds
    capability: tuple[int, int] | str | None  # CUDA (major, minor); ROCm gfx arch, e.g. "gfx90a"
    bf16: bool  # native bf16 matmuls (Ampere+, any ROCm GPU); False on CPU: plan fp32 there
    count: int  # accelerators visible to this process; 0 on CPU
    source: str  # where the memory numbers came from: "pynvml" | "amdsmi" | "torch" | "cpu"
    index: int = 0  # local device index (local rank)

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"


@dataclass(frozen=True)
class _TorchView:
    """What torch says about one visible GPU, without creating a context (no mem_get_info)."""

    vendor: str
    name: str
    total_bytes: int
    capability: tuple[int, int] | str | None
    bf16: bool
    count: int
    uuid: str | None  # NVIDIA: matches NVML's "GPU-..." UUID, which survives CUDA_VISIBLE_DEVICES
    pci_bdf: str | None  # "0000:c1:00.0": matches amdsmi's BDF under HIP_VISIBLE_DEVICES


def _torch_view(index: int) -> _TorchView | None:
    """torch's view of GPU `index`, or None when torch has no usable GPU (CPU build, no device)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    props = torch.cuda.get_device_properties(index)
    hip = bool(torch.version.hip)
    arch = getattr(props, "gcnArchName", "") or ""
    uuid = getattr(props, "uuid", None)
    bus = getattr(props, "pci_bus_id", None)
    bdf = None
    if bus is not None:
        bdf = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    with torch.cuda.device(index):  # is_bf16_supported asks about the current device
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return _TorchView(
        vendor="rocm" if hip else "cuda",
        name=props.name,
        total_bytes=int(props.total_memory),
        capability=(arch.split(":")[0] or None) if hip else (props.major, props.minor),
        bf16=bool(bf16),
        count=torch.cuda.device_count(),
        uuid=None if hip or uuid is None else f"GPU-{uuid}",
        pci_bdf=bdf,
    )


def _torch_memory(index: int) -> tuple[int, int]:
    """(free, total) bytes from the CUDA/HIP runtime; creates the device context (~0.3-0.6 GiB)."""
    import torch

    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


def _own_reserved(index: int) -> int:
    """Bytes this process's caching allocator holds on GPU `index` (0 before its context exists): the device's free
    memory leaves them out, yet they are this process's to use and every probe peak counts them
    (`runner.oom.detect.oom_guard`)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    return int(torch.cuda.memory_reserved(index))


def _nvml_memory(index: int, uuid: str | None) -> tuple[str, int, int]:
    """(name, total, free) bytes from NVML, by UUID when torch gave one (NVML ignores CUDA_VISIBLE_DEVICES)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return (name.decode() if isinstance(name, bytes) else str(name)), int(mem.total), int(mem.free)
    finally:
        pynvml.nvmlShutdown()


def _amdsmi_memory(index: int, bdf: str | None) -> tuple[str, int, int]:
    """(name, total, free) bytes from amdsmi, matched by PCI address when known (else by index)."""
    import amdsmi  # type: ignore[import-not-found]  # ships with ROCm, not on PyPI for every version

    amdsmi.amdsmi_init()
    try:
        handles = amdsmi.amdsmi_get_processor_handles()
        if bdf is not None:
            match = [h for h in handles if str(amdsmi.amdsmi_get_gpu_device_bdf(h)).lower() == bdf]
            if not match:
                raise LookupError(f"no amdsmi device at PCI address {bdf}")
            handle = match[0]
        else:
            handle = handles[index]
        vram = amdsmi.AmdSmiMemoryType.VRAM
        total = int(amdsmi.amdsmi_get_gpu_memory_total(handle, vram))  # bytes
        used = int(amdsmi.amdsmi_get_gpu_memory_usage(handle, vram))  # bytes
        name = amdsmi.amdsmi_get_gpu_asic_info(handle).get("market_name") or ""
        return str(name), total, total - used
    finally:
        amdsmi.amdsmi_shut_down()


def probe_device(local_rank: int = 0, *, host: HostInfo | None = None) -> DeviceInfo:
    """The accelerator this rank trains on (device index `local_rank`), or the CPU when there is none.

    On CPU, total/free are the container's host memory (`host`, probed when not given).
    """
    try:
        view = _torch_view(local_rank)
    except Exception as err:  # a broken driver must not stop a run that can fall back to CPU
        log.warning("torch could not query GPU %d (%s: %s); planning for the CPU", local_rank, type(err).__name__, err)
        view = None
    if view is None:
        host = host or probe_host()
        return DeviceInfo("cpu", "cpu", host.total_bytes, host.available_bytes, None, False, 0, "cpu", local_rank)
    backend, query, key = (
        ("pynvml", _nvml_memory, view.uuid) if view.vendor == "cuda" else ("amdsmi", _amdsmi_memory, view.pci_bdf)
    )
    try:
        name, total, free = query(local_rank, key)
        source = backend
    except Exception as err:  # ImportError, NVMLError, AmdSmiException, LookupError: torch still knows
        log.warning("%s unavailable for GPU %d (%s: %s); using torch", backend, local_rank, type(err).__name__, err)
        name, source = view.name, "torch"
        try:
            free, total = _torch_memory(local_rank)
        except Exception as err2:  # the probe steps still check every micro-batch for real
            log.warning(
                "torch.cuda.mem_get_info failed (%s); assuming the whole %.1f GiB free", err2, view.total_bytes / GiB
            )
            free, total = view.total_bytes, view.total_bytes
    try:
        own = _own_reserved(local_rank)
    except Exception as err:  # a broken driver: the device's free memory alone, as before
        log.warning("torch could not tell what this process holds on GPU %d (%s)", local_rank, err)
        own = 0
    if own:
        log.info("device: %.2f GiB free on GPU %d plus %.2f GiB this process's allocator holds", free / GiB,
                 local_rank, own / GiB)  # fmt: skip
    return DeviceInfo(
        vendor=view.vendor,
        name=name or view.name,
        total_bytes=total,
        free_bytes=min(free + own, total),  # what this process can use: its own allocator's blocks are its
        capability=view.capability,
        bf16=view.bf16,
        count=view.count,
        source=source,
        index=local_rank,
    )


def describe(device: DeviceInfo, host: HostInfo) -> str:
    """Everything probed, as one log line."""
    cap = device.capability
    cap_text = f"sm_{cap[0]}{cap[1]}" if isinstance(cap, tuple) else (cap or "-")
    where = f"{device.vendor}:{device.index}/{device.count}" if device.is_gpu else "cpu"
    return (
        f"device {where} {device.name!r} {device.free_bytes / GiB:.1f}/{device.total_bytes / GiB:.1f} GiB free "
        f"(via {device.source}), capability {cap_text}, bf16 {'yes' if device.bf16 else 'no'}; "
        f"host {host.available_bytes / GiB:.1f}/{host.total_bytes / GiB:.1f} GiB available "
        f"(via {host.source}), {host.cpus} cpus"
    ).replace("\n", " ")


def resolve_precision(asked: str, device: DeviceInfo) -> tuple[str, str]:
    """(precision, reason): `auto` is bf16 where the device has it natively, else fp16 on GPU, fp32 on CPU."""
    if asked != "auto":
        slow = asked == "bf16" and device.is_gpu and not device.bf16
        return asked, f"precision {asked} from the spec" + (
            f" ({device.name} has no native bf16: slow)" if slow else ""
        )
    chosen = "bf16" if device.is_gpu and device.bf16 else "fp16" if device.is_gpu else "fp32"
    why = "native bf16" if chosen == "bf16" else "no native bf16 on this GPU" if device.is_gpu else "CPU"
    return chosen, f"precision auto -> {chosen}: {why}"


def largest_passing(
    cands: Sequence[int], guess: int, ok: Callable[[int], bool], max_probes: int | None = None
) -> tuple[int | None, dict[int, bool], bool]:
    """The largest of the ascending `cands` for which `ok` holds, `ok` being True up to some threshold.

    Probes `guess` (a member of `cands`), then its neighbour, then bisects what is left: 2 probes when
    the guess is right to one candidate, at most 2 + ceil(log2(len(cands))) otherwise.
    Returns (the largest passing candidate or None, {candidate: outcome}, whether the search finished
    before `max_probes` ran out).
    """
    seen: dict[int, bool] = {}

    def probe(i: int) -> bool:
        seen[cands[i]] = ok(cands[i])
        return seen[cands[i]]

    def more() -> bool:
        return max_probes is None or len(seen) < max_probes

    lo, hi = -1, len(cands)  # index of the largest known pass / the smallest known failure
    g = list(cands).index(guess)
    if probe(g):
        lo = g
        if g + 1 < hi and more():
            lo, hi = (g + 1, hi) if probe(g + 1) else (lo, g + 1)
    else:
        hi = g
        if g > 0 and more():
            lo, hi = (g - 1, hi) if probe(g - 1) else (lo, g - 1)
    while hi - lo > 1 and more():
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return (cands[lo] if lo >= 0 else None), seen, hi - lo <= 1
