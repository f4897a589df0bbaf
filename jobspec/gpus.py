"""GPU catalogue: memory and vendor of common accelerators, keyed by the names people type.

Used only before submit (plan, render); the runner reads the real device instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GiB = 1024**3
Vendor = Literal["cuda", "rocm"]


@dataclass(frozen=True)
class GpuInfo:
    name: str
    vendor: Vendor
    memory_bytes: int
    bf16: bool
    bf16_tflops: float | None = None  # dense peak, for MFU


_CATALOGUE = [
    GpuInfo("H200", "cuda", 141 * GiB, True, 989.0),
    GpuInfo("H100", "cuda", 80 * GiB, True, 989.0),
    GpuInfo("A100-80GB", "cuda", 80 * GiB, True, 312.0),
    GpuInfo("A100-40GB", "cuda", 40 * GiB, True, 312.0),
    GpuInfo("L40S", "cuda", 48 * GiB, True, 362.0),
    GpuInfo("A10G", "cuda", 24 * GiB, True, 70.0),
    GpuInfo("L4", "cuda", 24 * GiB, True, 121.0),
    GpuInfo("RTX4090", "cuda", 24 * GiB, True, 165.0),
    GpuInfo("RTX3090", "cuda", 24 * GiB, True, 71.0),
    GpuInfo("RTX3080-20GB", "cuda", 20 * GiB, True, 59.5),  # the seeds' modded 3080
    GpuInfo("RTX3080", "cuda", 10 * GiB, True, 59.5),
    GpuInfo("V100", "cuda", 32 * GiB, False),
    GpuInfo("T4", "cuda", 16 * GiB, False),
    GpuInfo("MI300X", "rocm", 192 * GiB, True, 1307.0),
    GpuInfo("MI250X", "rocm", 64 * GiB, True, 191.5),  # per GCD, as torch sees it
    GpuInfo("MI210", "rocm", 64 * GiB, True, 181.0),
    GpuInfo("RX7900XTX", "rocm", 24 * GiB, True, 123.0),
    GpuInfo("RX6800XT", "rocm", 16 * GiB, False),  # the seeds' 16 GB ROCm card
]

_ALIASES = {"A100": "A100-80GB", "A100-80G": "A100-80GB", "A100-40G": "A100-40GB"}


def _key(name: str) -> str:
    return name.upper().replace("_", "-").replace(" ", "")


GPUS: dict[str, GpuInfo] = {_key(g.name): g for g in _CATALOGUE}


def lookup(name: str) -> GpuInfo | None:
    """The catalogue entry for a GPU type name (case and separator insensitive), or None."""
    key = _key(name)
    key = _key(_ALIASES.get(key, key))
    return GPUS.get(key)


def known_names() -> list[str]:
    return [g.name for g in _CATALOGUE]
