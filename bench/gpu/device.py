"""What the report says about the machine (device, driver, versions, date) and the MFU arithmetic."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from typing import Any

from bench.gpu.common import ROOT, Config

# Dense bf16 tensor-core peaks in TFLOP/s (DESIGN.md: 1979 is H100's sparse figure). Matched in order
# against the device name; --peak-tflops overrides. A device not listed gets no MFU, never a guess.
DENSE_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)


def flops_per_token(preset: str, seq: int, trainable: int | None = None) -> int:
    """DESIGN.md / llm.c: 6N + 6*L*C*T (N all parameters incl. embeddings, L layers, C hidden, T row length).
    Model FLOPs: activation recomputation (checkpointing tiers) is not counted. With LoRA (`trainable`: the adapters'
    parameters): 4N + 2T + 6*L*C*T, the frozen base's forward and input gradients (2N each) and the adapters' weight
    gradients (2T; their forward and input gradients are in N's terms up to rank / width)."""
    from jobspec.catalog.presets import PRESETS

    s = PRESETS[preset]
    if trainable is not None:
        return 4 * s.params + 2 * trainable + 6 * s.layers * s.hidden * seq
    return 6 * s.params + 6 * s.layers * s.hidden * seq


def peak_tflops(cfg: Config, device_name: str | None) -> tuple[float | None, str]:
    """(dense bf16 peak in TFLOP/s, where it came from); None where the device is not known (CPU included)."""
    if cfg.peak_tflops:
        return cfg.peak_tflops, "--peak-tflops"
    if not device_name or cfg.device != "cuda":
        return None, "n/a (CPU)" if cfg.device == "cpu" else "unknown device"
    for key, tflops in DENSE_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops, f"dense bf16 peak of {key} (DESIGN.md)"
    return None, f"no dense bf16 peak known for {device_name!r}: pass --peak-tflops"


def mfu(tokens_per_s: float | None, fpt: int, peak: float | None) -> float | None:
    if tokens_per_s is None or peak is None:
        return None
    return tokens_per_s * fpt / (peak * 1e12)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (CPU, ROCm): the report says n/a
        return None


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def host_environment(cfg: Config) -> dict[str, Any]:
    """The report's header as the suite's own process sees it, without importing torch (the parts' processes
    fill in the device: `device_environment`). Every key is there from the start, unknown ones None."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "smoke (CPU)" if cfg.smoke else "gpu",
        "device": None,
        "device_memory_bytes": None,
        "capability": None,
        "driver": None,
        "cuda": None,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch_threads": None,
        "commit": _commit(),
        "peak_tflops": None,
        "peak_source": None,
        "argv": sys.argv[1:],
    }


def device_environment(cfg: Config) -> dict[str, Any]:
    """Device, driver and torch's own view, from inside a part's process (it imports torch, and on a GPU
    initialises CUDA: never in the suite's own process, whose context would take memory from every part)."""
    import torch

    gpu = cfg.device == "cuda" and torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if gpu else None
    name = props.name if props else None
    peak, source = peak_tflops(cfg, name)
    return {
        "device": name or f"cpu ({platform.processor() or platform.machine()})",
        "device_memory_bytes": int(props.total_memory) if props else None,
        "capability": f"sm_{props.major}{props.minor}" if props else None,
        "driver": _driver() if gpu else None,
        "cuda": torch.version.cuda if gpu else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "peak_tflops": peak,
        "peak_source": source,
    }
