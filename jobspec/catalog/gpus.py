"""GPU catalogue: memory, vendor and 16-bit peak of common accelerators, keyed by the names people type.

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
    # Dense (no 2:4 sparsity) 16-bit matrix peak in TFLOPS, from the vendor's datasheet: bf16 with
    # fp32 accumulation, or fp16 on cards without bf16. `jobspec plan` sizes step times from it.
    tflops16: float | None = None
    # The most of them one node holds in the servers sold with them (HGX/DGX and OAM boards: 8; the 16-GPU HGX-2 and
    # HGX A100 40GB boards; PCIe servers with up to 10 cards). A spec asking more per node describes no machine.
    per_node: int = 8


# Datasheet figures, dense. NVIDIA datasheets print the sparse figure first (2x): halved here.
_CATALOGUE = [
    GpuInfo("H200", "cuda", 141 * GiB, True, 989.0),  # H200 SXM datasheet: BF16 1,979 sparse
    GpuInfo("H100", "cuda", 80 * GiB, True, 989.0),  # H100 SXM5 datasheet: BF16 1,979 sparse
    GpuInfo("A100-80GB", "cuda", 80 * GiB, True, 312.0),  # A100 datasheet: BF16 312 (624 sparse)
    GpuInfo("A100-40GB", "cuda", 40 * GiB, True, 312.0, per_node=16),
    GpuInfo("L40S", "cuda", 48 * GiB, True, 362.0, per_node=10),  # L40S datasheet: BF16 362.05 (733 sparse)
    # A10 datasheet: BF16 125 (250 sparse). AWS's A10G publishes no figure and clocks lower: an upper bound.
    GpuInfo("A10G", "cuda", 24 * GiB, True, 125.0, per_node=8),
    GpuInfo("L4", "cuda", 24 * GiB, True, 121.0, per_node=10),  # L4 datasheet: BF16 242 sparse
    GpuInfo("RTX4090", "cuda", 24 * GiB, True, 165.2, per_node=10),  # Ada whitepaper: BF16, FP32 accumulate
    GpuInfo("RTX3090", "cuda", 24 * GiB, True, 71.0, per_node=10),  # GA102 whitepaper: BF16, FP32 accumulate
    GpuInfo("RTX3080-20GB", "cuda", 20 * GiB, True, 59.5, per_node=10),  # the seeds' modded 3080: same GA102 die
    GpuInfo("RTX3080", "cuda", 10 * GiB, True, 59.5, per_node=10),  # GA102 whitepaper: BF16, FP32 accumulate
    GpuInfo("V100", "cuda", 32 * GiB, False, 125.0, per_node=16),  # V100 SXM2 datasheet: tensor (fp16) 125
    GpuInfo("T4", "cuda", 16 * GiB, False, 65.0, per_node=10),  # T4 datasheet: mixed precision (fp16) 65
    GpuInfo("MI300X", "rocm", 192 * GiB, True, 1307.4),  # MI300X datasheet: BF16 1,307.4 dense
    GpuInfo("MI250X", "rocm", 64 * GiB, True, 191.5),  # MI250X datasheet: BF16 383 per OAM = 2 GCDs; per GCD
    GpuInfo("MI210", "rocm", 64 * GiB, True, 181.0),  # MI210 datasheet: BF16 181
    GpuInfo("RX7900XTX", "rocm", 24 * GiB, True, 122.8, per_node=10),  # AMD spec sheet: FP16/BF16 122.8 (WMMA)
    GpuInfo("RX6800XT", "rocm", 16 * GiB, False, 41.5, per_node=10),  # the seeds' 16 GB card; AMD spec: FP16 41.47
]

_ALIASES = {"A100": "A100-80GB", "A100-80G": "A100-80GB", "A100-40G": "A100-40GB", "H100-80GB": "H100"}


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


def catalogue() -> list[GpuInfo]:
    return list(_CATALOGUE)


def suggest(name: str) -> list[str]:
    """Catalogue names close to an unknown `name` ('H10' -> H100, 'MI300' -> MI300X), best first."""
    import difflib  # only on an error: keeps it out of every CLI start
    key = _key(name).replace("-", "")
    keys = {_key(g.name).replace("-", ""): g.name for g in _CATALOGUE}
    prefixed = [keys[k] for k in keys if k.startswith(key) or (len(k) >= 3 and key.startswith(k))]
    if prefixed:
        return prefixed[:3]
    return [keys[k] for k in difflib.get_close_matches(key, list(keys), n=3, cutoff=0.6)]
