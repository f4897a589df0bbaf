"""jobspec.untrusted.json_loads: JSON someone else wrote, refused before the parser when it nests too deep."""

from __future__ import annotations

import json

import pytest

from jobspec.untrusted import MAX_JSON_DEPTH, json_loads
from tests.cpu_clock import cpu_seconds


@pytest.mark.parametrize("text", [
    b"[" * 100_000 + b"]" * 100_000,
    b'[{"a":' * 5_000 + b"1" + b"}]" * 5_000,
    b"[" * 100_000 + b"}" * 100_000,  # mismatched too: refused for its depth, not handed to the parser
    "[" * (MAX_JSON_DEPTH + 1),
])  # fmt: skip
def test_nesting_past_the_bound_is_refused_before_parsing(text):
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_JSON_DEPTH}"):
        json_loads(text)


def test_what_json_reads_it_reads_the_same():
    values = [{"a": [1, "[[[{", {"b": '"]}'}], "c": "\\\\"}, [[[]]], "x", 3, None,
              json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)]  # fmt: skip
    for value in values:
        text = json.dumps(value)
        assert json_loads(text) == json_loads(text.encode()) == value
    with pytest.raises(ValueError):
        json_loads(b'{"a": ')  # not JSON: the parser's own error


@pytest.mark.parametrize("text", [
    b'"' + b'\\"' * 128_000,  # an unterminated string of escaped quotes: the old pattern took 4.5 s at 32 KB
    b'{"a": "' + b'\\"' * 128_000,
    b'"\\' * 128_000,
    b"[" * 128_000 + b"]" * 128_000,  # deep: passes that paired the innermost brackets took one per level
    (b"[" * 500 + b"]" * 500 + b",") * 256,
])  # fmt: skip
def test_the_reader_is_linear_on_hostile_text(text):
    """256 KB of each pattern a backtracking or per-level scan turns into minutes; linear, it takes milliseconds.
    The bound is 100 times what this 2-core machine needs, and thousands of times under the quadratic cost."""
    with cpu_seconds() as spent, pytest.raises(ValueError):
        json_loads(text)
    assert spent.seconds < 2.0
