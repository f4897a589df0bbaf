"""Value types that parse human shorthand once: byte sizes ("16Gi", "20GB", "1e10"), CPU requests
("500m") and GPU requests ("H100:8"). The parsed value is what the rest of the code sees.

Sizes and CPU requests follow Kubernetes' quantity grammar (what the API server will parse), so a
spelling means here what it means in the manifest: '500000m' of memory is 500 bytes, never 500 MB.
Why not `kubernetes.utils.parse_quantity` itself: importing it loads the kubernetes client (measured
165 ms CPU warm, 270 ms cold, on the 2-core dev machine), which `validate`, `render` and `plan` never import,
and it has no room for the spellings people type (20GB, 16GiB) or for errors that name the slip. The
grammar is the same: tests/test_units.py checks every spelling against `parse_quantity`.

Each type's JSON Schema (`jobspec schema`) accepts every spelling its parser accepts, so an
editor does not flag `gpus: H100:8` or `memory: 16Gi`."""

from __future__ import annotations

import decimal
import math
import re
import typing
from fractions import Fraction
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

from jobspec.errors import HintedValueError

# Kubernetes' quantity grammar (apimachinery resource.Quantity), which the API server parses:
#   <signed number><suffix>; number 16, 1.5, 16. or .5; suffix a binary SI unit (Ki Mi Gi Ti Pi Ei), a
#   decimal SI unit (n u m "" k M G T P E) or a decimal exponent (e3, E-2). Case counts: m is milli, M mega.
_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_QUANTITY = re.compile(rf"({_NUMBER})(?:([eE][+-]?[0-9]+)|([A-Za-z]*))", re.ASCII)  # as the API server reads it
_SPACED = re.compile(rf"\s*({_NUMBER})(?:([eE][+-]?[0-9]+)|\s*([A-Za-z]*))\s*", re.ASCII)  # sizes: '16 Gi' too
_KUBERNETES_UNITS: dict[str, int | Fraction] = {
    "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5, "Ei": 1024**6,
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 10**3), "": 1,
    "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4, "P": 1000**5, "E": 1000**6,
}  # fmt: skip
# Sizes people write that Kubernetes refuses, read in any case: 20GB, 16GiB, 16gi, 512K, 64g. Never a
# lone m: that is milli in a quantity (Docker's 512m, 512 MB, is 0.512 bytes to Kubernetes).
_SIZE_EXTRAS = {
    "k": 1000, "g": 1000**3, "t": 1000**4, "p": 1000**5, "e": 1000**6,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5, "eb": 1000**6,
    "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4, "pi": 1024**5, "ei": 1024**6,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5, "eib": 1024**6,
}  # fmt: skip
_BELOW_ONE = {"n": "nano", "u": "micro", "m": "milli"}  # Kubernetes' units that divide
MAX_DIGITS = 40  # 8Ei has 19 digits; Fraction would parse thousands of them slowly
MAX_BYTES = 2**63 - 1  # a Kubernetes quantity is a 64-bit integer (8 EiB)
MAX_SIZE_CHARS = 1024  # longer is no size (a number of hundreds of digits still gets "too large")
# A size without a unit is bytes (as in Kubernetes). Every size in a spec is memory for a pod, a GPU,
# /dev/shm or a weights file: below 1 MiB a bare number is a missing unit ("memory: 64"), not a setting.
MIN_BARE_BYTES = 1024**2
_TOO_LARGE = f"too large: a size is at most {MAX_BYTES} bytes (2^63 - 1, just under 8Ei)"


class _Quantity(typing.NamedTuple):
    value: Fraction  # exact: no float rounding or overflow
    number: str  # as written, sign included
    unit: str  # the suffix as written; "" for a bare number or an exponent
    exponent: bool  # written as 1e10


def _quantity(
    text: str, units: typing.Callable[[str], int | Fraction | None], grammar: re.Pattern[str] = _QUANTITY
) -> _Quantity | None:
    """`text` read by the quantity grammar (None: not a quantity); `units` maps a suffix to its factor."""
    match = grammar.fullmatch(text)
    if not match:
        return None
    number, exponent, unit = match.group(1), match.group(2), match.group(3) or ""
    factor = units(unit)
    if factor is None:
        return None
    whole, _, fraction = number.lstrip("+-").partition(".")
    if len(whole.lstrip("0")) > MAX_DIGITS and not exponent:  # past every bound (and no 5000-digit Fraction)
        return _Quantity(Fraction(10) ** 60 * (-1 if number[0] == "-" else 1), number, unit, False)
    if len(whole.lstrip("0")) > MAX_DIGITS or len(whole) + len(fraction) > 4 * MAX_DIGITS:
        return None  # digits by the hundred, before an exponent, or after the point: no quantity anyone writes
    value = Fraction(number) * factor
    if exponent:
        # |exponent| <= 60 keeps the arithmetic small and changes no result: a nonzero number of at most
        # MAX_DIGITS whole digits times 10^60 is past every bound; times 10^-60, less than any unit.
        digits = exponent[1:].lstrip("+-").lstrip("0") or "0"
        power = min(60, int(digits)) if len(digits) <= 6 else 60
        value *= Fraction(10) ** (-power if "-" in exponent else power)
    return _Quantity(value, number, unit, bool(exponent))


def _size_unit(unit: str) -> int | Fraction | None:
    return _KUBERNETES_UNITS.get(unit, _SIZE_EXTRAS.get(unit.lower()))


def _read_size(value: Any) -> tuple[int, _Quantity | None]:
    """(bytes, the quantity as written; None for a YAML number). A fraction of a byte: see parse_bytes."""
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
        return value, None
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '16Gi' or '20GB', got {type(value).__name__}")
    if len(value) > MAX_SIZE_CHARS:  # measured before the grammar reads it
        raise ValueError(f"a text of {len(value):,} characters is not a size (at most {MAX_SIZE_CHARS} characters)")
    quantity = _quantity(value, _size_unit, _SPACED)
    if quantity is None:
        raise ValueError(f"{_shown(value)} is not a size; write e.g. '16Gi', '512Mi' or '20GB'")
    if quantity.number.startswith("-"):  # '-0k' too: the schema allows no '-'
        raise ValueError("a size cannot be negative")
    if quantity.value.denominator != 1 and not quantity.unit:
        raise ValueError(f"{_shown(value)} bytes: a size in bytes is a whole number; write e.g. '1.5Gi' with a unit")
    size = math.ceil(quantity.value)
    if size > MAX_BYTES:
        raise ValueError(_TOO_LARGE)
    return size, quantity


def parse_bytes(value: Any) -> int:
    """'16Gi' -> 17179869184, '20GB' -> 20e9, '1e10' -> 10^10, 1024 -> 1024: a Kubernetes quantity, or a
    size as people write it (20GB, 16GiB, 512K, 64g; any case, except that m is milli and M mega).

    A unit that leaves a fraction of a byte ('1.1Gi' = 1181116006.4) rounds up to the next byte, as
    Kubernetes' own Quantity.Value() does for a memory request: what the manifest carries (a whole
    number) is then what the node enforces. A number without a unit is bytes and must be whole
    ('1048576.5' is refused): a fraction there is a slip, not a rounding.
    """
    return _read_size(value)[0]


def parse_size(value: Any) -> int:
    """A spec's size: `parse_bytes`, refusing below MIN_BARE_BYTES a size that has no unit (64, '1e3')
    or a unit below a byte ('40000m' is 40 bytes): a forgotten unit, or Docker's m for mega."""
    size, quantity = _read_size(value)
    if size >= MIN_BARE_BYTES:
        return size
    if quantity is not None and quantity.unit in _BELOW_ONE:
        number, unit = quantity.number.lstrip("+"), quantity.unit
        raise HintedValueError(
            f"{_shown(value)} was read as {number} {_BELOW_ONE[unit]}-bytes = {_decimal(quantity.value)} bytes: "
            f"in a Kubernetes quantity '{unit}' is {_BELOW_ONE[unit]}"
            + (" (a thousandth), not mega" if unit == "m" else ""),
            f"for mebibytes write {number}Mi, for megabytes (10^6 bytes) {number}M",
        )
    if quantity is not None and quantity.exponent:
        raise HintedValueError(
            f"{_shown(value)} is {size} bytes? a number without a unit counts bytes",
            "write a size with a unit, e.g. 16Gi; a number of bytes is at least 1 MiB (1e10 is 10 GB)",
        )
    if quantity is None or not quantity.unit:
        fix = f"write {size}Gi or {size}Mi (or {size}G, 10^9 bytes)" if size else "write a size with a unit, e.g. 16Gi"
        raise HintedValueError(f"{size} bytes? a size without a unit counts bytes", fix)
    return size


def is_bare_number(value: Any) -> bool:
    """A number without a unit: a YAML number, or a text of digits (1048576, +24, 1e10)."""
    if isinstance(value, str):
        match = _SPACED.fullmatch(value)
        return bool(match) and not match.group(3)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _decimal(value: Fraction) -> str:
    # Exact: a unit's denominator divides 10^9, and the number has at most 4 * MAX_DIGITS digits.
    with decimal.localcontext() as ctx:
        ctx.prec = 6 * MAX_DIGITS
        text = format(decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


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


# Every spelling parse_size may accept: 7+ digits (bytes; fewer are refused), a number with an exponent,
# or a number with a unit (Kubernetes' and the extras, any case). A sign only as '+': a size is not negative.
_UNSIGNED = r"([0-9]+(\.[0-9]*)?|\.[0-9]+)"
SIZE_PATTERN = rf"^\s*\+?([0-9]{{7,}}(\.[0-9]*)?|{_UNSIGNED}([eE][+-]?[0-9]+|\s*([kKmMgGtTpPeE][iI]?[bB]?|[nu])))\s*$"

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

MAX_CPUS = 10**6
MAX_CPU_CHARS = 32  # "1000000", "0.001", "500m", "1e3": a CPU count is a few characters
MIN_CPU = Fraction(1, 1000)  # 1m: the finest CPU request a node grants (Kubernetes rounds a smaller one up)
_CPU_EXAMPLES = "write e.g. 8, 0.5 or '500m'"


def parse_cpu(value: Any) -> str:
    """CPU request: a Kubernetes quantity (8, 0.5, '500m', '1e3'), kept as written for the manifest.

    Kubernetes' grammar exactly (case counts: 'm' is milli; '2K' is refused, as the API server refuses
    it), between 1m and a million CPUs. A fraction of a millicore ('1.5m') is Kubernetes' to round up.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("expected a CPU count such as 8, 0.5 or '500m'")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("expected a CPU count such as 8, 0.5 or '500m', not an infinite or NaN number")
    if isinstance(value, int) and value > MAX_CPUS:  # before str(): a 5000-digit int cannot even be printed
        raise ValueError(f"more than a million CPUs: give the request per pod; {_CPU_EXAMPLES}")
    text = str(value).strip()  # str(1e-05) is '1e-05': a quantity too
    if len(text) > MAX_CPU_CHARS:  # measured before the grammar reads it
        raise ValueError(f"a text of {len(text):,} characters is not a CPU count (at most {MAX_CPU_CHARS} characters)")
    quantity = _quantity(text, _KUBERNETES_UNITS.get)
    if quantity is None:
        raise ValueError(f"{_shown(text)} is not a CPU count; {_CPU_EXAMPLES}")
    if quantity.value <= 0:
        raise ValueError(f"{_shown(text)} CPUs: a CPU request must be more than 0; {_CPU_EXAMPLES}")
    if quantity.value < MIN_CPU:
        raise ValueError(f"{_shown(text)} is below 1m (a thousandth of a CPU), the smallest request; {_CPU_EXAMPLES}")
    if quantity.value > MAX_CPUS:
        raise ValueError(f"more than a million CPUs: give the request per pod; {_CPU_EXAMPLES}")
    return text


# parse_cpu's text forms: Kubernetes' quantity grammar (a sign only as '+': a request is not negative).
CPU_PATTERN = rf"^\s*\+?{_UNSIGNED}([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?\s*$"

CpuQuantity = Annotated[
    str,
    BeforeValidator(parse_cpu),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": CPU_PATTERN},
                {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_CPUS},
            ],
            "examples": [8, "500m"],
        }
    ),
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
