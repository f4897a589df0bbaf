"""Device and host probes. Faked only at the boundary: fake cgroup trees in tmp_path, and the vendor
modules (pynvml, amdsmi) or the torch view that probe.py reads through. The CPU path runs for real."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pynvml
import pytest
import torch

from runner.oom.detect import oom_guard
from runner.sizing import hostmem, probe
from runner.sizing.hostmem import HostInfo, loader_settings, probe_host
from runner.sizing.probe import DeviceInfo, describe, probe_device, resolve_precision

GiB = 1024**3
MEMINFO = "MemTotal:       65536000 kB\nMemFree:         1000000 kB\nMemAvailable:   52428800 kB\n"


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture
def meminfo(tmp_path: Path) -> Path:
    return write(tmp_path, {"meminfo": MEMINFO}) / "meminfo"


@pytest.fixture
def own(tmp_path: Path) -> Path:
    """/proc/self/cgroup inside a cgroup namespace: the container's cgroup is the mount's root."""
    return write(tmp_path, {"proc-cgroup": "0::/\n"}) / "proc-cgroup"


@pytest.fixture
def many_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostmem, "_affinity", lambda: 16)


# -- host ---------------------------------------------------------------------------------------------


def test_cgroup_v2_limit(tmp_path: Path, meminfo: Path, own: Path, many_cpus: None) -> None:
    root = write(tmp_path / "cg", {
        "memory.max": str(8 * GiB), "memory.current": str(3 * GiB),
        "memory.stat": f"anon 123\ninactive_file {GiB}\nactive_file 5\n", "cpu.max": "250000 100000",
    })  # fmt: skip
    host = probe_host(root, meminfo, own)
    # 8 GiB limit; usage 3 GiB of which 1 GiB is reclaimable cache -> 6 GiB left; 2.5 cores -> 3
    assert host == HostInfo(8 * GiB, 6 * GiB, 3, "cgroup2")


def test_cgroup_v2_unlimited_falls_back_to_meminfo(tmp_path: Path, meminfo: Path, own: Path, many_cpus: None) -> None:
    root = write(tmp_path / "cg", {"memory.max": "max", "memory.current": str(GiB), "cpu.max": "max 100000"})
    host = probe_host(root, meminfo, own)
    assert host == HostInfo(65536000 * 1024, 52428800 * 1024, 16, "meminfo")


def test_cgroup_v1_limit(tmp_path: Path, meminfo: Path, own: Path, many_cpus: None) -> None:
    root = write(tmp_path / "cg", {
        "memory/memory.limit_in_bytes": str(4 * GiB), "memory/memory.usage_in_bytes": str(GiB),
        "memory/memory.stat": "cache 10\ntotal_inactive_file 0\n",
        "cpu/cpu.cfs_quota_us": "150000", "cpu/cpu.cfs_period_us": "100000",
    })  # fmt: skip
    assert probe_host(root, meminfo, own) == HostInfo(4 * GiB, 3 * GiB, 2, "cgroup1")


def test_cgroup_v1_unlimited_sentinel(tmp_path: Path, meminfo: Path, own: Path, many_cpus: None) -> None:
    root = write(tmp_path / "cg", {
        "memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": str(GiB),
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
    })  # fmt: skip
    host = probe_host(root, meminfo, own)
    assert (host.source, host.total_bytes, host.cpus) == ("meminfo", 65536000 * 1024, 16)


def test_limit_above_the_machine_is_capped_by_meminfo(tmp_path: Path, meminfo: Path, own: Path) -> None:
    root = write(tmp_path / "cg", {"memory.max": str(512 * GiB), "memory.current": str(10 * GiB)})
    host = probe_host(root, meminfo, own)
    assert (host.total_bytes, host.available_bytes, host.source) == (65536000 * 1024, 52428800 * 1024, "meminfo")


def test_no_cgroup_files_and_affinity_caps_cpus(tmp_path: Path, meminfo: Path) -> None:
    host = probe_host(tmp_path / "nothing-here", meminfo, tmp_path / "no-proc-file")
    assert host.source == "meminfo" and host.available_bytes == 52428800 * 1024
    assert host.cpus == len(os.sched_getaffinity(0))


def test_nested_v2_without_namespace_takes_the_tightest_level(tmp_path: Path, meminfo: Path, many_cpus: None) -> None:
    proc = write(tmp_path, {"proc": "0::/kubepods/pod1/ctr\n"}) / "proc"
    root = write(tmp_path / "cg", {
        "memory.max": "max",
        "kubepods/memory.max": str(16 * GiB), "kubepods/memory.current": str(2 * GiB),
        "kubepods/pod1/memory.max": str(4 * GiB), "kubepods/pod1/memory.current": str(GiB),
        "kubepods/pod1/cpu.max": "200000 100000",
        "kubepods/pod1/ctr/memory.max": "max", "kubepods/pod1/ctr/memory.current": str(GiB),
        "kubepods/pod1/ctr/cpu.max": "max 100000",
    })  # fmt: skip
    assert probe_host(root, meminfo, proc) == HostInfo(4 * GiB, 3 * GiB, 2, "cgroup2")


def test_v1_private_mount_with_host_path_in_proc(tmp_path: Path, meminfo: Path, many_cpus: None) -> None:
    # Docker on v1 without a cgroup namespace: /proc says /docker/abc, but the mount is the container's own.
    proc = write(tmp_path, {"proc": "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"}) / "proc"
    root = write(tmp_path / "cg", {
        "memory/memory.limit_in_bytes": str(6 * GiB), "memory/memory.usage_in_bytes": str(GiB),
        "cpu/cpu.cfs_quota_us": "400000", "cpu/cpu.cfs_period_us": "100000",
    })  # fmt: skip
    assert probe_host(root, meminfo, proc) == HostInfo(6 * GiB, 5 * GiB, 4, "cgroup1")


def test_real_host_is_sane() -> None:
    host = probe_host()
    assert 0 < host.available_bytes <= host.total_bytes
    assert 1 <= host.cpus <= (os.cpu_count() or 1)


def test_loader_settings() -> None:
    roomy = loader_settings(HostInfo(64 * GiB, 40 * GiB, 32), on_gpu=True, local_ranks=2, need_per_rank=2 * GiB)
    assert (roomy.num_workers, roomy.pin_memory) == (
        8,
        True,
    )  # min(32 cpus / 2 ranks - 1 = 15, cap 8, 36 GiB spare x 0.5 / 0.5 GiB / 2 ranks = 18)
    few_gib = loader_settings(HostInfo(16 * GiB, 7 * GiB, 32), on_gpu=True, local_ranks=1, need_per_rank=2 * GiB)
    assert few_gib.num_workers == 5  # (7 - 2) GiB x 0.5 / 0.5 GiB
    tight = loader_settings(HostInfo(8 * GiB, 3 * GiB, 8), on_gpu=True, local_ranks=1, need_per_rank=2 * GiB)
    assert (tight.num_workers, tight.pin_memory) == (0, False)
    cpu = loader_settings(HostInfo(64 * GiB, 40 * GiB, 2), on_gpu=False, local_ranks=1, need_per_rank=GiB)
    # CPU training: workers would take cores from torch's compute threads (measured 17k -> 12k tok/s)
    assert (cpu.num_workers, cpu.pin_memory) == (0, False) and "CPU training" in cpu.reasons[0]
    assert loader_settings(HostInfo(64 * GiB, 40 * GiB, 2), on_gpu=False, local_ranks=1, need_per_rank=GiB,
                           requested=2).num_workers == 2  # the spec's number is honoured  # fmt: skip
    assert all(any(ch.isdigit() for ch in r) or "no GPU" in r or "CPU" in r for r in roomy.reasons + cpu.reasons)


# -- device -------------------------------------------------------------------------------------------


def fake_view(vendor: str = "cuda", **kw: object) -> probe._TorchView:
    base: dict[str, object] = dict(
        vendor=vendor, name="NVIDIA H100 80GB HBM3" if vendor == "cuda" else "AMD Instinct MI300X",
        total_bytes=80 * GiB, capability=(9, 0) if vendor == "cuda" else "gfx942", bf16=True, count=8,
        uuid="GPU-1234" if vendor == "cuda" else None, pci_bdf="0000:c1:00.0",
    )  # fmt: skip
    return probe._TorchView(**{**base, **kw})  # type: ignore[arg-type]


def test_cpu_path_on_this_machine() -> None:
    device = probe_device()
    assert (device.vendor, device.source, device.count, device.capability) == ("cpu", "cpu", 0, None)
    assert 0 < device.free_bytes <= device.total_bytes
    assert not torch.cuda.is_available()


def test_nvml_memory_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    monkeypatch.setattr(probe, "_torch_view", lambda i: fake_view())
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: seen.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda uuid: seen.append(uuid) or "h")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: b"NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetMemoryInfo", lambda h: types.SimpleNamespace(total=80 * GiB, free=70 * GiB)
    )
    monkeypatch.setattr(probe, "_torch_memory", lambda i: pytest.fail("torch must not be asked when NVML answers"))
    device = probe_device(3)
    assert device == DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 80 * GiB, 70 * GiB, (9, 0), True, 8, "pynvml", 3)
    assert seen == ["GPU-1234", "shutdown"]


def test_nvml_failure_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(probe, "_torch_view", lambda i: fake_view())
    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    monkeypatch.setattr(probe, "_torch_memory", lambda i: (60 * GiB, 80 * GiB))
    device = probe_device()
    assert (device.source, device.free_bytes, device.total_bytes, device.name) == (
        "torch", 60 * GiB, 80 * GiB, "NVIDIA H100 80GB HBM3")  # fmt: skip
    assert "pynvml unavailable for GPU 0 (NVMLError" in caplog.text


def test_every_memory_backend_failing_still_gives_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("driver gone")

    monkeypatch.setattr(probe, "_torch_view", lambda i: fake_view())
    monkeypatch.setattr(probe, "_nvml_memory", broken)
    monkeypatch.setattr(probe, "_torch_memory", broken)
    device = probe_device()
    assert (device.source, device.free_bytes, device.total_bytes) == ("torch", 80 * GiB, 80 * GiB)


def test_rocm_without_amdsmi_uses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi -> ImportError
    monkeypatch.setattr(probe, "_torch_view", lambda i: fake_view("rocm"))
    monkeypatch.setattr(probe, "_torch_memory", lambda i: (100 * GiB, 192 * GiB))
    device = probe_device()
    assert (device.vendor, device.source, device.capability, device.free_bytes) == (
        "rocm",
        "torch",
        "gfx942",
        100 * GiB,
    )


def test_rocm_amdsmi_matches_the_pci_address(monkeypatch: pytest.MonkeyPatch) -> None:
    handles = {"a": ("0000:03:00.0", 10 * GiB), "b": ("0000:C1:00.0", 40 * GiB)}  # amdsmi may print upper case
    fake = types.SimpleNamespace(
        amdsmi_init=lambda: None, amdsmi_shut_down=lambda: None,
        amdsmi_get_processor_handles=lambda: list(handles),
        amdsmi_get_gpu_device_bdf=lambda h: handles[h][0],
        AmdSmiMemoryType=types.SimpleNamespace(VRAM="vram"),
        amdsmi_get_gpu_memory_total=lambda h, t: 192 * GiB,
        amdsmi_get_gpu_memory_usage=lambda h, t: handles[h][1],
        amdsmi_get_gpu_asic_info=lambda h: {"market_name": "AMD Instinct MI300X"},
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    monkeypatch.setattr(probe, "_torch_view", lambda i: fake_view("rocm"))
    device = probe_device()
    assert (device.source, device.total_bytes, device.free_bytes) == ("amdsmi", 192 * GiB, 152 * GiB)


def test_broken_torch_means_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(i: int) -> None:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(probe, "_torch_view", boom)
    host = HostInfo(32 * GiB, 20 * GiB, 4)
    assert probe_device(host=host) == DeviceInfo("cpu", "cpu", 32 * GiB, 20 * GiB, None, False, 0, "cpu", 0)


def test_describe_is_one_line_with_everything() -> None:
    device = DeviceInfo("cuda", "NVIDIA\nH100", 80 * GiB, 70 * GiB, (9, 0), True, 8, "pynvml", 2)
    line = describe(device, HostInfo(64 * GiB, 50 * GiB, 12, "cgroup2"))
    assert "\n" not in line
    for part in (
        "cuda:2/8",
        "70.0/80.0 GiB free",
        "pynvml",
        "sm_90",
        "bf16 yes",
        "50.0/64.0 GiB",
        "cgroup2",
        "12 cpus",
    ):
        assert part in line
    assert "cpu" in describe(probe_device(), probe_host())


def test_resolve_precision() -> None:
    h100 = DeviceInfo("cuda", "H100", 80 * GiB, 80 * GiB, (9, 0), True, 1, "pynvml")
    t4 = DeviceInfo("cuda", "T4", 16 * GiB, 16 * GiB, (7, 5), False, 1, "pynvml")
    cpu = DeviceInfo("cpu", "cpu", 16 * GiB, 16 * GiB, None, False, 0, "cpu")
    assert [resolve_precision("auto", d)[0] for d in (h100, t4, cpu)] == ["bf16", "fp16", "fp32"]
    assert resolve_precision("bf16", t4) == ("bf16", "precision bf16 from the spec (T4 has no native bf16: slow)")


def test_oom_guard_on_cpu() -> None:
    def step(mbs: int) -> None:
        if mbs > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if mbs == 3:
            raise ValueError("a real bug")

    try_step = oom_guard(step)
    assert try_step(4) is True
    assert try_step(8) is False
    with pytest.raises(ValueError, match="a real bug"):
        try_step(3)
