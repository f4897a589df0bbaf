"""Sizes and CPU requests mean what Kubernetes makes of them: its quantity grammar, read exactly.

The reference is the Kubernetes client's own `parse_quantity` (and, for what a manifest may carry, the
apimachinery grammar written out below). A spelling the loader accepts is one the schema accepts, and
what the renderer writes reads back, in Kubernetes, as the number the loader parsed.
"""

from __future__ import annotations

import decimal
import math
import re
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st
from kubernetes.utils import parse_quantity

from jobspec.errors import SpecError
from jobspec.plan.planner import gpu_memory_bytes
from jobspec.render import render
from jobspec.spec.loader import load_spec, parse_spec
from jobspec.spec.units import (
    CPU_PATTERN,
    MAX_BYTES,
    MIN_BARE_BYTES,
    SIZE_PATTERN,
    format_bytes,
    parse_bytes,
    parse_cpu,
    parse_size,
)
from tests.cli_helpers import cli

ROOT = Path(__file__).resolve().parents[1]
SFT = str(ROOT / "examples" / "sft_fast.yaml")
GiB = 1024**3

# apimachinery's resource.Quantity grammar, as the API server parses it (case counts; no spaces).
KUBERNETES_QUANTITY = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?", re.ASCII)


def kubernetes_value(text: str) -> Decimal:
    """The exact number Kubernetes reads from `text` (the client's parser, without its 28-digit rounding)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 200
        return parse_quantity(text)


def problems(text: str, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.yaml", overrides)
    return str(info.value)


GOOD = "name: demo\nmodel:\n  preset: tiny\ntraining:\n  global_batch: 8\n  steps: 10\nhardware:\n  vendor: cpu\n"


# --- the grammar --------------------------------------------------------------------------------

numbers = st.one_of(
    st.from_regex(r"[0-9]{1,12}", fullmatch=True),
    st.from_regex(r"[0-9]{1,8}\.[0-9]{0,6}", fullmatch=True),
    st.from_regex(r"\.[0-9]{1,6}", fullmatch=True),
)
kubernetes_suffixes = st.sampled_from(
    ["", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
) | st.from_regex(r"[eE][+-]?[0-9]{1,2}", fullmatch=True)


@st.composite
def kubernetes_quantities(draw: st.DrawFn) -> str:
    return draw(st.sampled_from(["", "+", "-"])) + draw(numbers) + draw(kubernetes_suffixes)


@given(kubernetes_quantities())
@example("1e3")
@example("1e10")
@example("40000m")
@example("1500m")
@example("1.1Gi")
@example("-0")
def test_every_kubernetes_quantity_reads_as_kubernetes_reads_it(text: str) -> None:
    assert KUBERNETES_QUANTITY.fullmatch(text)
    exact = kubernetes_value(text)
    try:
        size = parse_bytes(text)
    except ValueError as err:
        # Refused only past the bounds, or a fraction of a byte written without a unit.
        unitless = text.lstrip("+-")[-1:].isdigit()
        negative = text.startswith("-")  # '-0' too: a size is never written with a minus
        assert negative or math.ceil(exact) > MAX_BYTES or (unitless and exact != int(exact)), (text, err)
        return
    assert size == math.ceil(exact)  # Quantity.Value(): a fraction of a byte rounds up
    if Decimal("0.001") <= exact <= 10**6:  # a CPU request: kept as written, for the manifest
        assert parse_cpu(text) == text


def test_m_is_milli_and_M_is_mega() -> None:
    assert parse_bytes("500000m") == 500  # not 500 GB
    assert parse_size("99999999999999999999m") == 10**17  # 100 PB, not past 8Ei (a fresh seed's example)
    assert parse_bytes("500M") == 500 * 10**6
    assert parse_bytes("2000000000m") == 2 * 10**6 == parse_size("2000000000m")
    assert parse_bytes("5000000u") == 5 and parse_bytes("5000000000n") == 5


def test_exponents_and_signs() -> None:
    assert parse_size("1e10") == parse_size("1E10") == parse_size("+1e10") == 10**10
    assert parse_size("1.5e9") == parse_size("15e8") == 1_500_000_000
    assert parse_size(".5Gi") == parse_size("0.5Gi") == parse_size("512.Mi") == 512 * 1024**2
    assert parse_size("1E") == 10**18 and parse_size("1Ei") == 2**60  # E alone is exa; with digits an exponent
    for text in ("1e99999999", "1e99999999999999999999", "9" * 400 + "Gi"):
        with pytest.raises(ValueError, match="too large"):
            parse_size(text)
    with pytest.raises(ValueError, match="negative"):
        parse_size("-16Gi")


def test_the_friendly_extras_stay() -> None:
    for text, size in [
        ("20GB", 20 * 10**9), ("20gb", 20 * 10**9), ("16GiB", 16 * GiB), ("16gi", 16 * GiB), ("16 Gi", 16 * GiB),
        ("512K", 512_000), ("64g", 64 * 10**9), ("2mb", 2 * 10**6), ("2MiB", 2 * 1024**2), ("2mi", 2 * 1024**2),
    ]:  # fmt: skip
        assert parse_size(text) == size, text


def test_a_fraction_of_a_byte_rounds_up_with_a_unit_and_is_refused_without() -> None:
    assert parse_size("1.1Gi") == math.ceil(Decimal("1.1") * GiB) == 1_181_116_007
    assert parse_size("1048576500m") == 1_048_577
    for text in ("1048576.5", "1048576.5e0", 1048576.5):
        with pytest.raises(ValueError, match="whole number"):
            parse_size(text)


# --- the forgotten unit: below 1 MiB ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("40000m", "'40000m' was read as 40000 milli-bytes = 40 bytes"),
        ("1500m", "= 1.5 bytes"),
        ("512m", "512 milli-bytes = 0.512 bytes"),  # Docker's 512m
        ("64u", "64 micro-bytes"),
        ("1e3", "'1e3' is 1000 bytes?"),
        ("1e6", "'1e6' is 1000000 bytes?"),
        ("1000", "1000 bytes? a size without a unit counts bytes"),
    ],
)
def test_a_size_below_1mib_without_a_real_unit_is_refused(text: str, words: str) -> None:
    with pytest.raises(ValueError, match="bytes") as info:
        parse_size(text)
    assert words in str(info.value) and info.value.hint  # type: ignore[attr-defined]


def test_a_unit_may_be_small_on_purpose() -> None:
    assert parse_size("512Ki") == 512 * 1024 and parse_size("1.001k") == 1001 and parse_size("1k") == 1000


@pytest.mark.parametrize(
    ("value", "code", "words"),
    [
        ("1e3", 2, "hardware.memory: '1e3' is 1000 bytes? a number without a unit counts bytes"),
        ("40000m", 2, "hardware.memory: '40000m' was read as 40000 milli-bytes = 40 bytes"),
        ("500000m", 2, "= 500 bytes"),
        ("1e10", 0, "ok"),
        ("64Gi", 0, "ok"),
    ],
)
def test_validate_says_how_it_read_the_memory(value: str, code: int, words: str) -> None:
    rc, out = cli("validate", SFT, "--set", f"hardware.memory={value}")
    assert rc == code and words in out and "Traceback" not in out, out
    if value == "40000m":
        assert "hint: for mebibytes write 40000Mi, for megabytes (10^6 bytes) 40000M" in out


def test_a_size_in_the_file_is_located() -> None:
    text = problems(GOOD + "  memory: 40000m\n  shm_size: 1e3\n")
    assert "spec.yaml:9: hardware.memory: '40000m' was read as 40000 milli-bytes" in text
    assert "spec.yaml:10: hardware.shm_size: '1e3' is 1000 bytes?" in text


def test_gpu_memory_flag_reads_an_exponent_as_a_bare_number() -> None:
    assert gpu_memory_bytes("2.4e1") == 24 * GiB and gpu_memory_bytes("+24") == 24 * GiB
    assert gpu_memory_bytes("80GB") == 80 * 10**9


# --- what the schema and the renderer publish --------------------------------------------------

size_texts = st.one_of(
    kubernetes_quantities(),
    st.builds(
        lambda pre, n, space, unit, post: pre + n + space + unit + post,
        st.sampled_from(["", " ", "+", "\t"]),
        numbers,
        st.sampled_from(["", " "]),
        st.sampled_from(["", "K", "kb", "KB", "mB", "Gb", "gib", "GIB", "g", "t", "p", "e", "EB", "ki", "mi", "TI"]),
        st.sampled_from(["", " ", "\n"]),
    ),
    st.text(alphabet="0123456789.+-eEkKmMgGiIbBnu \t", max_size=12),
)


@given(size_texts)
@example("-0k")  # found by a fresh seed: 0 bytes, but the schema allows no '-'
@example("1e10")
@example("+1048576")
@example("1048576.")
@example(" 16 Gi ")
def test_schema_accepts_every_size_the_loader_accepts(text: str) -> None:
    try:
        parse_size(text)
    except ValueError:
        return
    assert re.search(SIZE_PATTERN, text), text


@given(st.one_of(kubernetes_quantities(), st.text(alphabet="0123456789.+-eEkKmMGiIunT ", max_size=10)))
@example("1e3")
@example("+.5")
@example("1Ki")
def test_schema_accepts_every_cpu_the_loader_accepts(text: str) -> None:
    try:
        kept = parse_cpu(text)
    except ValueError:
        return
    assert re.search(CPU_PATTERN, text), text
    assert KUBERNETES_QUANTITY.fullmatch(kept) and kubernetes_value(kept) == kubernetes_value(text.strip())


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        ("2K", "not a CPU count"),  # the API server refuses K; k is kilo
        ("500 m", "not a CPU count"),
        ("0", "more than 0"),
        ("-1", "more than 0"),
        ("100u", "below 1m"),
        (1e-05, "below 1m"),
        ("1e7", "million"),
    ],
)
def test_cpu_requests_kubernetes_would_refuse_or_never_grant(value: object, refused: str) -> None:
    with pytest.raises(ValueError, match=refused):
        parse_cpu(value)


@given(st.integers(min_value=0, max_value=MAX_BYTES))
@example(1001)
@example(MIN_BARE_BYTES + 1)
def test_every_written_size_is_a_kubernetes_quantity_of_that_size(n: int) -> None:
    text = format_bytes(n)
    assert KUBERNETES_QUANTITY.fullmatch(text) and kubernetes_value(text) == n


@pytest.mark.parametrize(
    ("overrides", "memory", "cpu"),
    [
        (("hardware.memory=1.1Gi", "hardware.shm_size=1Gi"), "1181116007", "8"),
        (("hardware.memory=1e10", "hardware.cpu=1e3"), "9765625Ki", "1e3"),
        (("hardware.memory=64G", "hardware.cpu=+.5"), "62500000Ki", "+.5"),
        (("hardware.memory=20000001000m", "hardware.cpu=1500m", "hardware.shm_size=16Mi"), "20000001", "1500m"),
    ],
)
def test_the_manifest_carries_what_was_parsed(overrides: tuple[str, ...], memory: str, cpu: str) -> None:
    spec = load_spec(SFT, overrides)
    (job,) = [obj for obj in render(spec) if obj["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    resources = container["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == memory
    assert kubernetes_value(memory) == spec.hardware.memory
    assert resources["requests"]["cpu"] == cpu and KUBERNETES_QUANTITY.fullmatch(cpu)
    assert parse_spec(yaml.safe_dump(spec.to_yaml_dict())) == spec  # the ConfigMap's copy reads back the same
