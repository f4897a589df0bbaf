"""A run's metrics.jsonl read as untrusted input: one regular file, one bounded line at a time, typed records.

`jobspec report` and `jobspec plan --from` (and the runner, from its own run directory) read files that
other jobs and other people wrote. So:
- only a regular file inside the run directory is read (jobspec/untrusted.py: a link to /dev/zero, a FIFO,
  a device, a directory or a link out is refused before a byte is read), of at most MAX_FILE_BYTES, and
  reading stops at the size the file had when it was opened (a live run appending cannot keep it going);
- a line is read with a length bound (MAX_LINE_BYTES): a longer one is skipped without being held;
- the JSON parser refuses what no runner writes before Python builds it: integers of more than
  MAX_INT_DIGITS digits, NaN and Infinity, nesting deeper than the parser's recursion limit;
- each record's known fields are checked for type and range (FIELDS; objects such as a train record's
  `samples_by_source` {name: count} entry by entry, MAPS); a record with one bad field is
  skipped as a whole (its other figures are suspect too) and counted with its line and reason. Unknown
  fields are dropped, so nothing hostile is kept.
A file in which no line is a usable record is refused (exit 2) naming its first bad line.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from jobspec.errors import ConfigError
from jobspec.untrusted import open_regular, read_bounded

log = logging.getLogger(__name__)

Record = dict[str, Any]
KiB, MiB, GiB = 1024, 1024**2, 1024**3
MAX_FILE_BYTES = 2 * GiB  # about 5 million records; streaming it takes about a minute
MAX_LINE_BYTES = 256 * KiB  # the runner's records are well under 4 KiB
MAX_INT_DIGITS = 24  # 2**64 has 20 digits: a longer integer is not a count, a step or a byte size
MAX_NOTED = 10  # skipped lines named one by one; the rest are counted
METRICS_WHAT = "metrics file"


# --- fields -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """What one field may hold: exact JSON types (a boolean is no integer) and a range, for a string of its
    length. `null` is accepted everywhere except `kind` and `step` and means unknown."""

    types: tuple[type, ...]
    low: float = 0
    high: float = 1

    def why_not(self, value: Any) -> str:
        """Why `value` does not fit (the value is echoed only as a short number: a string may be huge)."""
        if type(value) not in self.types:
            return f"expected {' or '.join(map(_TYPE_NAMES.__getitem__, self.types))}, got {_type_name(value)}"
        if type(value) is str:
            return f"a string of {len(value):,} characters (at most {self.high:,.0f})"
        return f"{value:.4g} is out of range [{self.low:g}, {self.high:g}]"  # inf too: 1e999 parses as inf


_TYPE_NAMES = {bool: "a boolean", str: "a string", int: "an integer", float: "a number", list: "a list",
               dict: "an object"}  # fmt: skip


def _type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), "null")  # null: what else json.loads returns


_INT, _NUM = (int,), (int, float)
_TIME = Rule(_NUM, 0, 1e11)  # unix seconds, up to the year 5138
_STEP = Rule(_INT, 0, 10**12)
_COUNT = Rule(_INT, 0, 2**62)
_BYTES = Rule(_INT, 0, 2**60)  # an exbibyte
_SIZE = Rule(_INT, 1, 10**9)  # micro-batches, accumulation, ranks, batches, sequence lengths
_NAME = Rule((str,), 0, 64)
_LOSS = Rule(_NUM, -1e30, 1e30)
_BOOL = Rule((bool,))

FIELDS: dict[str, Rule] = {
    "kind": _NAME, "event": _NAME, "tier": _NAME, "device": _NAME, "precision": _NAME,
    "from_tier": _NAME, "to_tier": _NAME,
    "reason": Rule((str,), 0, 4096),
    "time": _TIME, "oom_at": _TIME,
    "step": _STEP, "total_steps": _STEP,
    "samples": _COUNT, "targets": _COUNT, "eval_tokens": _COUNT, "epoch": _COUNT,
    "loss": _LOSS, "eval_loss": _LOSS,
    "lr": Rule(_NUM, 0, 1e6), "grad_norm": Rule(_NUM, 0, 1e300),
    "tokens_per_s": Rule(_NUM, 0, 1e15), "gpu_util": Rule(_NUM, 0, 100),
    "mem_used_bytes": _BYTES, "mem_total_bytes": _BYTES, "estimated_bytes": _BYTES, "budget_bytes": _BYTES,
    "micro_batch": _SIZE, "grad_accum": _SIZE, "world_size": _SIZE, "global_batch": _SIZE, "seq_len": _SIZE,
    "from_micro_batch": _SIZE, "to_micro_batch": _SIZE, "from_grad_accum": _SIZE, "to_grad_accum": _SIZE,
    "checkpointing": _BOOL, "resumed": _BOOL, "pin_memory": _BOOL,
    "task": Rule((str,), 1, 256), "limit": _COUNT, "num_fewshot": _COUNT, "seconds": Rule(_NUM, 0, 1e9),
    # a preference objective's TRL-named metrics (runner/train/objectives.py) and a mixture of experts' router loss
    "rewards/chosen": _LOSS, "rewards/rejected": _LOSS, "rewards/margins": _LOSS,
    "rewards/accuracies": Rule(_NUM, 0, 1), "logps/chosen": _LOSS, "logps/rejected": _LOSS,
    "nll_loss": _LOSS, "log_odds_ratio": _LOSS, "log_odds_chosen": _LOSS, "router_aux_loss": Rule(_NUM, 0, 1e30),
    "logits/chosen": _LOSS, "logits/rejected": _LOSS, "kl": _LOSS,  # KTO's KL estimate, GRPO's KL term
    # GRPO's (runner/rl/rollout.py, runner/train/grpo.py); each reward's `rewards/<name>/mean|std` by REWARD_KEY
    "reward": _LOSS, "reward_std": _LOSS, "frac_reward_zero_std": Rule(_NUM, 0, 1),
    "completions/mean_length": Rule(_NUM, 0, 1e9), "completions/min_length": Rule(_NUM, 0, 1e9),
    "completions/max_length": Rule(_NUM, 0, 1e9), "completions/clipped_ratio": Rule(_NUM, 0, 1),
    "completions/mean_terminated_length": Rule(_NUM, 0, 1e9), "completions/min_terminated_length": Rule(_NUM, 0, 1e9),
    "completions/max_terminated_length": Rule(_NUM, 0, 1e9), "clip_ratio/low_mean": Rule(_NUM, 0, 1),
    "clip_ratio/high_mean": Rule(_NUM, 0, 1), "clip_ratio/region_mean": Rule(_NUM, 0, 1),
}  # fmt: skip
REWARD_KEY = re.compile(r"rewards/[A-Za-z0-9_.-]{1,64}/(mean|std)")  # a GRPO reward's, named in the spec
# Fields that hold an object: its keys names (of at most key_chars characters), its values held to a rule.
MAPS: dict[str, tuple[int, int, Rule]] = {  # field: (most entries, key_chars, rule of each value)
    "samples_by_source": (64, 256, _COUNT),  # data.sources: at most 64, each named by a word
    "metrics": (64, 512, _LOSS),  # a benchmark record's {"eval/<task>/<metric>": value} (runner/output/benchmarks.py)
}
# A train or eval record without its step says nothing; a benchmark record says nothing without its task and numbers.
REQUIRED = {"train": ("step",), "eval": ("step",), "benchmark": ("task", "metrics")}
# The same as plain tuples: `validate` runs on every field of every record, and attribute lookups add up.
_LIMITS = {key: (rule.types, rule.low, rule.high) for key, rule in FIELDS.items()}


def validate(obj: Any) -> tuple[Record | None, str]:
    """(the record with its known, non-null fields, "") or (None, why it is not one)."""
    if not isinstance(obj, dict):
        return None, f"not a JSON object but {_type_name(obj)}"
    kind = obj.get("kind")
    if not isinstance(kind, str):
        return None, "kind: missing" if kind is None else f"kind: expected a string, got {_type_name(kind)}"
    clean: Record = {}
    for key, value in obj.items():
        limits, named = _LIMITS.get(key), key
        if limits is None and len(key) <= 80 and REWARD_KEY.fullmatch(key):
            limits, named = _LIMITS["reward"], "reward"
        if limits is None and key in MAPS and value is not None:
            why = _map_why_not(key, value)
            if why:
                return None, f"{key}: {why}"
            clean[key] = dict(value)
            continue
        if limits is None or value is None:  # an unknown field is dropped; null is unknown
            continue
        types, low, high = limits
        kind_of = type(value)
        if kind_of not in types or not low <= (len(value) if kind_of is str else value) <= high:
            return None, f"{key}: {FIELDS[named].why_not(value)}"
        clean[key] = value
    for key in REQUIRED.get(kind, ()):
        if key not in clean:
            return None, f"{key}: missing from a {kind} record"
    return clean, ""


def _map_why_not(key: str, value: Any) -> str:
    """Why `value` is no object of MAPS[key]'s shape; "" when it is."""
    most, key_chars, rule = MAPS[key]
    if type(value) is not dict:
        return f"expected an object, got {_type_name(value)}"
    if len(value) > most:
        return f"an object of {len(value):,} entries (at most {most})"
    for name, item in value.items():  # JSON keys are strings; their length is still the writer's
        if len(name) > key_chars:
            return f"a key of {len(name):,} characters (at most {key_chars})"
        if type(item) not in rule.types or not rule.low <= item <= rule.high:
            return f"a value: {rule.why_not(item)}"  # the key is not echoed: a writer's text
    return ""


# --- parsing ----------------------------------------------------------------------------------------


class Refused(ValueError):
    """A JSON value no runner writes, refused by the parser before Python builds it."""


def _parse_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:  # before int(): 5,000 digits would raise, 4,000 cost time
        raise Refused(f"an integer of {len(text.lstrip('-')):,} digits")
    return int(text)


def _parse_constant(name: str) -> float:
    raise Refused(f"{name} is not a finite number")


# Floats keep the C parser: 1e999 becomes inf, which every field's range refuses (and an unknown field is dropped).
_DECODER = json.JSONDecoder(parse_int=_parse_int, parse_constant=_parse_constant)


def loads(data: bytes) -> tuple[Any, str]:
    """(the parsed JSON value, "") or (None, why it is not JSON a runner writes). Never raises."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 text (byte {err.start + 1})"
    try:
        return _DECODER.decode(text), ""
    except Refused as err:
        return None, str(err)
    except RecursionError:
        return None, "nested deeper than any record"
    except ValueError as err:  # JSONDecodeError
        return None, f"not JSON ({getattr(err, 'msg', 'unreadable')})"


# --- files ------------------------------------------------------------------------------------------


def open_metrics(path: Path) -> tuple[BinaryIO, int]:
    """(the file opened for reading, its size then): a regular file inside its directory, at most MAX_FILE_BYTES
    (jobspec/untrusted.py; else a ConfigError naming the file and what it is)."""
    f = open_regular(path, what=METRICS_WHAT, limit=MAX_FILE_BYTES, root=path.parent)
    return f, os.fstat(f.fileno()).st_size


def read_small_json(path: Path, *, max_bytes: int = MiB) -> Any:
    """A small JSON file the runner writes (tier_state.json), read and parsed as strictly as a metrics line;
    ConfigError (not a regular file, too big) or ValueError (not JSON)."""
    value, why = loads(read_bounded(path, max_bytes, what="run state file", root=path.parent))
    if why:
        raise ValueError(why)
    return value


@dataclass
class Skipped:
    """Lines that were not a usable record: how many, and the first MAX_NOTED with their reason."""

    count: int = 0
    first: list[tuple[int, str, bool]] = field(default_factory=list)  # (1-based line, why, it was a JSON object)

    def add(self, path: Path, line: int, why: str, *, an_object: bool = False) -> None:
        self.count += 1
        if len(self.first) < MAX_NOTED:
            self.first.append((line, why, an_object))
            log.warning("%s:%d: %s; line ignored", path, line, why)

    def notes(self, name: str) -> list[str]:
        """Lines for a report: the first skipped lines by number, then a count of the rest."""
        out = [f"line {n} of {name}: {why}: record ignored" if an_object
               else f"line {n} of {name} is not a JSON record: ignored ({why})"
               for n, why, an_object in self.first]  # fmt: skip
        if self.count > len(self.first):
            out.append(f"... and {lines(self.count - len(self.first))} more ignored ({self.count:,} in all)")
        return out


class MetricsFile:
    """The records of one metrics.jsonl, validated, one at a time: `for rec in MetricsFile(path).records()`.

    Afterwards `skipped` tells what was left out, and `require_records()` refuses a file with nothing usable."""

    EXPECTED = "expected the metrics.jsonl the runner writes (JSON lines, one record per logged step)"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.skipped = Skipped()
        self.usable = 0

    def records(self) -> Iterator[Record]:
        f, size = open_metrics(self.path)
        with f:
            for number, data in _lines(f, size):
                if data is None:
                    self.skipped.add(self.path, number, f"longer than {MAX_LINE_BYTES // KiB} KiB")
                    continue
                if not data.strip():
                    continue
                value, why = loads(data)
                if why:
                    self.skipped.add(self.path, number, why)
                    continue
                rec, why = validate(value)
                if rec is None:
                    self.skipped.add(self.path, number, why, an_object=isinstance(value, dict))
                    continue
                self.usable += 1
                yield rec
        if self.skipped.count > len(self.skipped.first):
            log.warning("%s: %s ignored in all", self.path, lines(self.skipped.count))

    def require_records(self) -> None:
        """A ConfigError when no line was a usable record: an empty file, or one of garbage (named by its line)."""
        if self.usable:
            return
        if not self.skipped.count:
            raise ConfigError(f"{self.path}: no records; {self.EXPECTED}, from the run's first step")
        line, why, _ = self.skipped.first[0]
        raise ConfigError(f"{self.path}:{line}: {why}; no usable record in the file ({lines(self.skipped.count)} "
                          f"ignored): {self.EXPECTED}")  # fmt: skip


def _lines(f: BinaryIO, size: int) -> Iterator[tuple[int, bytes | None]]:
    """(1-based number, the line's bytes or None when longer than MAX_LINE_BYTES) up to `size` bytes.

    A long line is skipped in bounded pieces, never held whole; bytes appended after the file was opened
    are not read (a live run cannot keep the reader going)."""
    left, number = size, 0
    while left > 0:
        data = f.readline(min(MAX_LINE_BYTES + 1, left))
        if not data:
            return  # the file shrank under us
        left -= len(data)
        number += 1
        if len(data) <= MAX_LINE_BYTES or data.endswith(b"\n"):
            yield number, data
            continue
        while left > 0 and not data.endswith(b"\n"):
            data = f.readline(min(MAX_LINE_BYTES, left))
            if not data:
                break
            left -= len(data)
        yield number, None


def lines(n: int) -> str:
    """'1 line', '2,001 lines'."""
    return f"{n:,} line{'' if n == 1 else 's'}"
