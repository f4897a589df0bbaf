"""Bounds on data records written by someone else, and JSON parsing that keeps to them.

A data set may come from another team or a download; a record in it must not crash the runner (Python's
json raises RecursionError past ~1000 levels and ValueError on integers over 4300 digits), stall it
(converting an n-digit number costs O(n^2), the reason for that 4300-digit cap), or take gigabytes (a
100 MB line is held as bytes, text and objects at once). Each limit is far above what a training record
needs and far below the harm; a record over one is refused with exit 2 naming its file, line or row and
the limit (`RecordError`, located by the reader). Records under them may still be long: a chat's text that
`max_seq_len` cannot use is clipped before tokenizing (runner/data/dataset.py, `clip_texts`); a raw-text document
(`data.format: text`) is tokenized whole, up to MAX_RECORD_BYTES, and cut into blocks of a row when loaded.

The checks cost next to nothing on ordinary records: the C parser runs as is unless the bytes hold a
run of more than MAX_NUMBER_DIGITS digits (then a parser whose number hooks count them), and the parsed
value is walked for its depth only when the text has more than MAX_DEPTH brackets.
"""

from __future__ import annotations

import json
import re
from typing import Any

MiB = 1024**2
# A chat max_seq_len (<= 131,072 tokens) can use is at most ~0.5 MB of text at ~4 characters a token,
# ~3 MB as JSON with every character \u-escaped; 32 MiB leaves room for long raw-text documents (cut into
# blocks, every token trained) and for extra columns, while one record stays a few hundred MB at most once parsed.
MAX_RECORD_BYTES = 32 * MiB
MAX_LINE_BYTES = MAX_RECORD_BYTES  # a JSON-lines record is its line
# Chat records nest 3 levels (record, messages, message), tool calls with JSON arguments about 8; 64 is
# Arrow's own IPC nesting limit and far below the recursion limits of json and pyarrow's to_pylist.
MAX_DEPTH = 64
# Digits in a row in a number: an int64 has 19, a float64 needs 17 significant digits; a longer number is
# refused before Python converts it (quadratic time in the digits, and a ValueError past 4300).
MAX_NUMBER_DIGITS = 100
# A .json array is held whole as text while its records are parsed one by one (JSON has no record
# boundaries to stream on): up to 4 bytes a character in memory, so 256 MiB of file can take ~1.3 GB.
MAX_JSON_FILE_BYTES = 256 * MiB
JSONL_FIX = "convert it to JSON lines, one record per line (jq -c '.[]' data.json > data.jsonl)"
LONG_DIGITS = re.compile(rf"[0-9]{{{MAX_NUMBER_DIGITS + 1}}}")  # in a number's own text
_AS_DIGITS = bytes(0x31 if 0x30 <= b <= 0x39 else 0x30 for b in range(256))  # digit -> "1", any other byte -> "0"
_DIGIT_RUN = b"1" * (MAX_NUMBER_DIGITS + 1)
_SCAN_BYTES = 16 * MiB  # a file is scanned in pieces: the translated copy stays small


class RecordError(Exception):
    """A record over a limit; the message says what and the limit, the reader adds where (file:line or row)."""


def size(n: int) -> str:
    """Bytes in words: `33,554,432 bytes (32 MiB)`."""
    return f"{n:,} bytes ({n / MiB:.3g} MiB)" if n >= MiB else f"{n:,} bytes"


def over_limit(subject: str, name: str = "MAX_RECORD_BYTES") -> str:
    """`subject` ("a record of 40,000,000 bytes") and the limit `name`d, with the fix."""
    limit, what = (MAX_LINE_BYTES, "a line") if name == "MAX_LINE_BYTES" else (MAX_RECORD_BYTES, "a record")
    return (
        f"{subject}: over the limit of {size(limit)} {what} ({name}, runner/data/limits.py); "
        "max_seq_len uses a few MB of text at most, so split or shorten the record"
    )


def too_deep() -> RecordError:
    return RecordError(
        f"nested more than {MAX_DEPTH} levels deep (MAX_DEPTH, runner/data/limits.py; a chat record needs 3: "
        "record, messages, message); flatten or drop the deep field"
    )


def _number(text: str, convert: type) -> Any:
    if LONG_DIGITS.search(text):
        run = max(len(r) for r in re.findall(r"[0-9]+", text))
        raise RecordError(
            f"a number of {run:,} digits ({text[:12]}...), over the limit of {MAX_NUMBER_DIGITS} "
            "(MAX_NUMBER_DIGITS, runner/data/limits.py); store it as a string or drop the field"
        )
    return convert(text)


def _int(text: str) -> int:
    return _number(text, int)


def _float(text: str) -> float:
    return _number(text, float)


PLAIN = json.JSONDecoder()
COUNTING = json.JSONDecoder(parse_int=_int, parse_float=_float)  # a Python call a number: only when needed


def long_digits(raw: bytes) -> bool:
    """Whether `raw` has a run of digits a number may not have (in a number or a string: the parser tells).
    Bytes translated and searched by C loops, ~5 ns a byte; a regular expression took ~40."""
    pieces = (raw[i : i + _SCAN_BYTES + MAX_NUMBER_DIGITS] for i in range(0, len(raw), _SCAN_BYTES))  # overlapping
    return any(_DIGIT_RUN in piece.translate(_AS_DIGITS) for piece in pieces)


def loads(text: str, counting: bool) -> Any:
    """`text` as one JSON value within the limits: RecordError over one, json.JSONDecodeError if invalid;
    `counting`: `long_digits` of its bytes (the numbers are then checked one by one)."""
    try:
        value = (COUNTING if counting else PLAIN).decode(text)
    except RecursionError:  # past ~1000 levels the C parser gives up; below, the walk counts
        raise too_deep() from None
    if text.count("[") + text.count("{") > MAX_DEPTH:
        check_depth(value)
    return value


def raw_decode(text: str, start: int, counting: bool) -> tuple[Any, int]:
    """The JSON value that starts at `text[start]` and the index after it, within the limits as `loads`;
    `counting`: `long_digits` of the whole file (asked once, not once a value)."""
    try:
        value, end = (COUNTING if counting else PLAIN).raw_decode(text, start)
    except RecursionError:
        raise too_deep() from None
    if text.count("[", start, end) + text.count("{", start, end) > MAX_DEPTH:
        check_depth(value)
    return value, end


def check_depth(value: Any) -> None:
    """RecordError when `value` has a dict or list more than MAX_DEPTH levels down (the value is level 1).
    Level by level, not recursive: the check must not fail the way it guards against."""
    level, depth = [value] if isinstance(value, (dict, list)) else [], 1
    while level:
        if depth > MAX_DEPTH:
            raise too_deep()
        level = [c for item in level for c in (item.values() if isinstance(item, dict) else item)
                 if isinstance(c, (dict, list))]  # fmt: skip
        depth += 1
