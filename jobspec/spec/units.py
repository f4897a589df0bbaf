"""Value types that parse human shorthand once: byte sizes ("16Gi", "20GB") and GPU
requests ("H100:8"). The parsed value is what the rest of the code sees.

Each type's JSON Schema (`jobspec schema`) accepts every spelling its parser accepts, so an
editor does not flag `gpus: H100:8` or `memory: 16Gi`."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

from jobspec.errors import HintedValueError

_UNITS = {
    "": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4, "pi": 1024**5, "pib": 1024**5, "ei": 1024**6, "eib": 1024**6,
    "p": 1000**5, "pb": 1000**5, "e": 1000**6, "eb": 1000**6,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 2**63 - 1  # a Kubernetes quantity is a 64-bit integer (8 EiB)
# A size without a unit is bytes (as in Kubernetes). Every size in a spec is memory for a pod, a GPU,
# /dev/shm or a weights file: below 1 MiB a bare number is a missing unit ("memory: 64"), not a setting.
MIN_BARE_BYTES = 1024**2
_TOO_LARGE = f"too large: a size is at most {MAX_BYTES} bytes (2^63 - 1, just under 8Ei)"


def parse_bytes(value: Any) -> int:
    """'16Gi' -> 17179869184, '20GB' -> 20e9, 1024 -> 1024. Kubernetes and human suffixes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as '16Gi', not a boolean")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("expected a size such as '16Gi', not an infinite or NaN number")
        if not value.is_integer():
            raise ValueError("a size in bytes is a whole number; write e.g. '1.5Gi' with a suffix")
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        if value > MAX_BYTES:
            raise ValueError(_TOO_LARGE)
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '16Gi' or '20GB', got {type(value).__name__}")
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{_shown(value)} is not a size; write e.g. '16Gi', '512Mi' or '20GB'")
    if len(match.group(1)) > 40:  # 8Ei has 19 digits; Fraction would parse thousands of them slowly
        raise ValueError(_TOO_LARGE)
    size = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]  # exact: no float rounding or overflow
    if size > MAX_BYTES:
        raise ValueError(_TOO_LARGE)
    return int(size)


def parse_size(value: Any) -> int:
    """A spec's size: `parse_bytes`, refusing a number without a unit below MIN_BARE_BYTES."""
    size = parse_bytes(value)
    if size < MIN_BARE_BYTES and is_bare_number(value):
        fix = f"write {size}Gi or {size}Mi (or {size}G, 10^9 bytes)" if size else "write a size with a unit, e.g. 16Gi"
        raise HintedValueError(f"{size} bytes? a size without a unit counts bytes", fix)
    return size


def is_bare_number(value: Any) -> bool:
    """A number (or a text of digits) without a unit."""
    if isinstance(value, str):
        match = _SIZE.match(value)
        return bool(match) and not match.group(2)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: str) -> str:
    # Echo a short value to help fix it; a long one is not a typo of a size (it may be a token in the wrong place).
    return repr(value) if len(value) <= 12 else f"a text of {len(value)} characters"


def format_bytes(n: int) -> str:
    """Kubernetes quantity with the largest binary suffix that divides n exactly.

    `parse_size` reads every result back to n: a size below MIN_BARE_BYTES that no binary suffix
    divides keeps a unit, as a decimal fraction of k (1001 -> '1.001k').
    """
    for suffix, unit in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    if n >= MIN_BARE_BYTES:
        return str(n)
    digits = str(n).rjust(4, "0")
    return f"{digits[:-3]}.{digits[-3:]}".rstrip("0").rstrip(".") + "k"


# A number with a unit (`parse_bytes`' suffixes, any case), or 7+ digits (bytes; fewer are refused).
SIZE_PATTERN = r"^\s*(\d{7,}(\.\d+)?|\d+(\.\d+)?\s*[kKmMgGtTpPeE][iI]?[bB]?)\s*$"

ByteSize = Annotated[
    int,
    BeforeValidator(parse_size),
    PlainSerializer(format_bytes, return_type=str),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": SIZE_PATTERN},
                {"type": "integer", "minimum": MIN_BARE_BYTES, "maximum": MAX_BYTES},
            ],
            "examples": ["16Gi", "512Mi", "20GB"],
        }
    ),
]

_CPU = re.compile(r"^\d+(\.\d+)?m?$")


def parse_cpu(value: Any) -> str:
    """CPU request as a Kubernetes quantity: 8, 0.5 or '500m'."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("expected a CPU count such as 8, 0.5 or '500m'")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("expected a CPU count such as 8, 0.5 or '500m', not an infinite or NaN number")
    if isinstance(value, int) and value > 10**6:  # before str(): a 5000-digit int cannot even be printed
        raise ValueError("more than a million CPUs: write the request per pod, e.g. 8 or '500m'")
    text = str(value).strip()
    if len(text) > 24 or not _CPU.match(text) or float(text.rstrip("m")) <= 0:
        raise ValueError(f"{_shown(text)} is not a CPU count; write e.g. 8, 0.5 or '500m'")
    if float(text.rstrip("m")) / (1000 if text.endswith("m") else 1) > 10**6:
        raise ValueError("more than a million CPUs: write the request per pod, e.g. 8 or '500m'")
    return text


CpuQuantity = Annotated[
    str, BeforeValidator(parse_cpu), WithJsonSchema({"type": ["string", "number"], "examples": [8, "500m"]})
]


# parse_gpus' text forms: 'TYPE:COUNT', ':COUNT' or 'COUNT', and a bare 'TYPE' (one GPU).
GPUS_PATTERN = r"^([^:]*:\d+|[^:]+)$"


def parse_gpus(value: Any) -> dict[str, Any]:
    """'H100:8' -> {'type': 'H100', 'count': 8}; '8' or 8 -> {'count': 8}; a mapping passes through."""
    if isinstance(value, dict):
        return value
    if isinstance(value, bool):
        raise ValueError("expected 'TYPE:COUNT' such as 'H100:8'")
    if isinstance(value, int):
        return {"count": value}
    if isinstance(value, str):
        kind, _, count = value.strip().rpartition(":")
        if not (count.isascii() and count.isdigit()):
            if not _:
                return {"type": value.strip()}
            raise ValueError(f"{_shown(value)}: the part after ':' must be a GPU count, as in 'H100:8'")
        if len(count) > 6:
            raise ValueError(f"a GPU count of {len(count)} digits: at most 64 GPUs per node")
        return {"type": kind, "count": int(count)} if kind else {"count": int(count)}
    raise ValueError("expected 'TYPE:COUNT' such as 'H100:8', or a mapping {type, count}")


def human_bytes(n: float) -> str:
    """Bytes for log lines and reports: GiB, or MiB / KiB below 0.1 GiB (0.3 MiB a sample is not 0.00 GiB)."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
        if abs(n) >= 0.1 * size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"
