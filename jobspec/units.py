"""Value types that parse human shorthand once: byte sizes ("16Gi", "20GB") and GPU
requests ("H100:8"). The parsed value is what the rest of the code sees."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_UNITS = {
    "": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """'16Gi' -> 17179869184, '20GB' -> 20e9, 1024 -> 1024. Kubernetes and human suffixes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as '16Gi', not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '16Gi' or '20GB', got {type(value).__name__}")
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size; write e.g. '16Gi', '512Mi' or '20GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
    """Kubernetes quantity with the largest binary suffix that divides n exactly."""
    for suffix, unit in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


ByteSize = Annotated[
    int,
    BeforeValidator(parse_bytes),
    PlainSerializer(format_bytes, return_type=str),
    WithJsonSchema({"type": ["string", "integer"], "examples": ["16Gi", "20GB", 1073741824]}),
]

_CPU = re.compile(r"^\d+(\.\d+)?m?$")


def parse_cpu(value: Any) -> str:
    """CPU request as a Kubernetes quantity: 8, 0.5 or '500m'."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("expected a CPU count such as 8, 0.5 or '500m'")
    text = str(value).strip()
    if not _CPU.match(text) or float(text.rstrip("m")) <= 0:
        raise ValueError(f"{value!r} is not a CPU count; write e.g. 8, 0.5 or '500m'")
    return text


CpuQuantity = Annotated[
    str, BeforeValidator(parse_cpu), WithJsonSchema({"type": ["string", "number"], "examples": [8, "500m"]})
]


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
        if not count.isdigit():
            if not _:
                return {"type": value.strip()}
            raise ValueError(f"{value!r}: the part after ':' must be a GPU count, as in 'H100:8'")
        return {"type": kind, "count": int(count)} if kind else {"count": int(count)}
    raise ValueError("expected 'TYPE:COUNT' such as 'H100:8', or a mapping {type, count}")
