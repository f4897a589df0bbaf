"""Training records from files: JSON lines, a JSON array, Parquet, a `datasets` directory or a hub id.

`read_records(source, spec)` picks the reader from the source and returns an iterator of
`(Location, record)`; every error names the file and the line (text files, 1-based) or the row
(tables and JSON arrays, 0-based as in `dataset[N]`):

- `.jsonl` / `.ndjson`: one JSON object per line, streamed line by line; each line is decoded on its
  own, so one bad byte names its line and column instead of failing the whole file;
- `.json`: one array of objects, or an object whose only key holds that array (`{"data": [...]}`);
  held whole as text (JSON has no record boundaries to stream on), its records parsed one at a time;
- `.parquet`: streamed in record batches with pyarrow (runner/data/tables.py);
- a directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`; from a DatasetDict
  the first of `splits` it has (`train` for data.path; `validation`, else `test`, for data.eval_path);
- otherwise a name like `org/name` that is no local path: `datasets.load_dataset(name)`, same splits.

Files are data someone else wrote: each must be a regular file (runner/data/files.py), each record keeps
to the limits on size, nesting and numbers (runner/data/limits.py), and every reader holds one record
(or one bounded Arrow batch) at a time, a .json file's text aside. pyarrow and datasets are optional
(`pip install 'jobspec-k8s[data]'`); they are imported only when a source needs them.
"""

from __future__ import annotations

import codecs
import importlib
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec
from runner.data import limits, tables
from runner.data.files import check_saved_dataset, open_data
from runner.data.limits import JSONL_FIX, RecordError, loads, long_digits, over_limit, raw_decode, size

log = logging.getLogger("jobspec.runner")
TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("validation", "test")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
SUPPORTED = (
    ".jsonl/.ndjson (one JSON object per line), .json (an array of objects), .parquet, "
    "a directory written by datasets' save_to_disk, or a Hugging Face hub dataset id (org/name)"
)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's (json.decoder.WHITESPACE)


@dataclass(frozen=True)
class Location:
    """Where a record is: `path:line` in a text file, `path: row N` in a table (0-based)."""

    path: str
    line: int | None = None
    row: int | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}" if self.line is not None else f"{self.path}: row {self.row}"


Records = Iterator[tuple[Location, dict[str, Any]]]


def read_records(
    source: str | Path, spec: DataSpec, field: str = "data.path", splits: Sequence[str] = TRAIN_SPLITS
) -> Records:
    """The records of `source` (named `field` in errors); a bad source fails here, before iterating."""
    source = str(source)
    path = Path(source)
    kind = source_kind(source, field)
    if kind == "jsonl":
        return read_jsonl(path, field)
    if kind == "json":
        return read_json(path, spec, field)
    if kind == "parquet":
        return read_parquet(path, field)
    if kind == "datasets":
        return read_saved_dataset(path, field, splits)
    return read_hub_dataset(source, field, splits)


# The key of an assistant message of a preference pair's prompt (runner/data/pairs.py): rendered, never a target. The
# runner puts it there; data that carries it is refused (`as_message_list`), or it would untrain the marked replies.
PROMPT_TURN = "jobspec_prompt_turn"


def as_message_list(value: object) -> object:
    """A dict of equal-length lists ({role: [...], content: [...]}, how `datasets` stores a Sequence
    of dicts) as the list of dicts it stands for; anything else unchanged. ValueError for a message that holds a key
    the runner reserves (PROMPT_TURN): every message of the data passes here before the runner marks any."""
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
        lengths = {len(v) for v in value.values()}
        if len(lengths) == 1:
            value = [dict(zip(value, row, strict=True)) for row in zip(*value.values(), strict=True)]
    if isinstance(value, list) and any(isinstance(m, dict) and PROMPT_TURN in m for m in value):
        raise ValueError(f"a message holds the key {PROMPT_TURN!r}, which jobspec reserves for its own marks (a reply "
                         "of a preference pair's prompt, never trained on): remove it from the data")  # fmt: skip
    return value


def source_kind(source: str, field: str) -> str:
    """jsonl | json | parquet | datasets | hub: from the suffix, the directory layout or the name."""
    path = Path(source)
    if path.is_dir():
        if any((path / name).is_file() for name in ("dataset_dict.json", "state.json", "dataset_info.json")):
            return "datasets"
        raise ConfigError(
            f"{field} {source}: a directory without a datasets save_to_disk layout (no dataset_dict.json, "
            f"state.json or dataset_info.json); supported: {SUPPORTED}"
        )
    if path.exists() and not path.is_file():
        raise ConfigError(f"{field} {source}: not a regular file (a FIFO, socket or device); supported: {SUPPORTED}")
    kind = SUFFIXES.get(path.suffix.lower())
    if path.is_file():
        if kind is None:
            raise ConfigError(
                f"{field} {source}: unknown data format {path.suffix or '(no suffix)'!r}; supported: {SUPPORTED}"
            )
        return kind
    if kind is None and HUB_ID.fullmatch(source):
        return "hub"
    raise ConfigError(f"{field} {source}: no such file or directory")


def read_jsonl(path: Path, field: str = "data.path") -> Records:
    """(line, record) per non-empty line, read as bytes (at most MAX_LINE_BYTES a line), decoded line by line."""
    f, file_size = open_data(path, field)
    return _jsonl_lines(f, path, file_size)


def read_jsonl_at(path: Path, field: str, offset: int, line: int) -> tuple[Records, BinaryIO]:
    """`read_jsonl` from byte `offset`, the start of line `line + 1` (a stream's resume point, runner/data/stream.py):
    the records and the open file, whose `tell()` after a record is the offset of the line after it."""
    f, file_size = open_data(path, field)
    if not 0 <= offset <= file_size:
        f.close()
        raise ConfigError(f"{field} {path}: offset {offset} is outside the file's {file_size} bytes")
    f.seek(offset)
    return _jsonl_lines(f, path, file_size - offset, line), f


def _jsonl_lines(f: BinaryIO, path: Path, left: int, n: int = 0) -> Records:
    with f:
        while left > 0:  # never past the size the file had when opened
            raw = f.readline(min(limits.MAX_LINE_BYTES + 1, left))
            if not raw:
                break
            n, left = n + 1, left - len(raw)
            if len(raw) > limits.MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise ConfigError(f"{path}:{n}: " + over_limit("a line longer than that", "MAX_LINE_BYTES"))
            if n == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            line = decode_utf8(raw, str(path), n)
            if not line.strip():
                continue
            try:
                record = loads(line, long_digits(raw))
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{path}:{n}: not valid JSON ({err.msg}); each line must be one JSON object"
                ) from None
            except RecordError as err:
                raise ConfigError(f"{path}:{n}: {err}") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
            yield Location(str(path), line=n), record


def decode_utf8(raw: bytes, path: str, first_line: int = 1) -> str:
    """`raw` as text; on a bad byte, a ConfigError with its line and (1-based, byte) column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = raw.rfind(b"\n", 0, err.start) + 1
        line = first_line + raw.count(b"\n", 0, err.start)
        raise ConfigError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start - line_start + 1}); "
            "save the file as UTF-8"
        ) from None


def read_json(path: Path, spec: DataSpec, field: str = "data.path") -> Records:
    """(row, record) per element of the file's array (or of the only key of its top-level object)."""
    f, file_size = open_data(path, field)
    with f:
        if file_size > limits.MAX_JSON_FILE_BYTES:
            raise ConfigError(
                f"{path}: a .json file of {size(file_size)}, over the limit of {size(limits.MAX_JSON_FILE_BYTES)} "
                f"(MAX_JSON_FILE_BYTES, runner/data/limits.py: a .json array is held whole); {JSONL_FIX}"
            )
        raw = f.read(file_size)
    counting = long_digits(raw)  # once for the file, not once a record
    text = decode_utf8(raw.removeprefix(codecs.BOM_UTF8), str(path))
    del raw  # the text alone from here: the bytes and the text are the file twice
    return _json_rows(path, text, *_array_start(path, text, spec, counting), counting)


def _array_start(path: Path, text: str, spec: DataSpec, counting: bool) -> tuple[int, bool]:
    """(index of the '[' whose elements are the records, whether it is the value of a one-key object)."""
    i = _skip(text, 0)
    if text.startswith("[", i):
        return i, False
    record_keys = {spec.messages_field, spec.prompt_field, spec.response_field}
    if text.startswith("{", i) and text.startswith('"', j := _skip(text, i + 1)):
        key, j = _decode(path, text, j, counting)
        j = _skip(text, j)
        if text.startswith(":", j) and text.startswith("[", j := _skip(text, j + 1)) and key not in record_keys:
            log.info("data %s: records from its key %r", path, key)
            return j, True
    # Not a list of records: the whole document (within the file limit) for the error's words.
    try:
        doc = loads(text, counting)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    except RecordError as err:
        raise ConfigError(f"{path}: {err}") from None
    raise _not_an_array(path, doc, record_keys)


def _json_rows(path: Path, text: str, i: int, wrapped: bool, counting: bool) -> Records:
    """The records of the array at `text[i]`, each parsed, checked and yielded before the next is parsed."""
    row, i = 0, _skip(text, i + 1)
    while not text.startswith("]", i):
        start = i
        try:
            record, i = raw_decode(text, i, counting)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        except RecordError as err:
            raise ConfigError(f"{path}: row {row}: {err}") from None
        _check_size(path, row, text, start, i)
        if not isinstance(record, dict):
            raise ConfigError(f"{path}: row {row}: expected a JSON object, got {type(record).__name__}")
        yield Location(str(path), row=row), record
        row, i = row + 1, _skip(text, i)
        if text.startswith(",", i):
            comma, i = i, _skip(text, i + 1)
            if text.startswith("]", i):  # where Python's json places it: at the comma
                raise _invalid(path, text, "Illegal trailing comma before end of array", comma)
        elif not text.startswith("]", i):
            raise _invalid(path, text, "Expecting ',' delimiter", i)
    i = _skip(text, i + 1)
    if wrapped:
        if text.startswith(",", i):  # a second key: not the one-key wrapper
            raise _not_an_array(path, {}, set())
        if not text.startswith("}", i):
            raise _invalid(path, text, "Expecting ',' delimiter", i)
        i = _skip(text, i + 1)
    if i != len(text):
        raise _invalid(path, text, "Extra data", i)


def _check_size(path: Path, row: int, text: str, start: int, end: int) -> None:
    """ConfigError when the record text[start:end] is over MAX_RECORD_BYTES as UTF-8. Characters <= bytes
    <= 4 x characters: only a span that could go either way is encoded to count."""
    chars, limit = end - start, limits.MAX_RECORD_BYTES
    if chars > limit:
        raise ConfigError(
            f"{path}: row {row}: " + over_limit(f"a record of {chars:,} characters (as many bytes or more)")
        )
    if chars > limit // 4 and (n := len(text[start:end].encode("utf-8", "surrogatepass"))) > limit:
        raise ConfigError(f"{path}: row {row}: " + over_limit(f"a record of {size(n)}"))


def _skip(text: str, i: int) -> int:
    return WHITESPACE.match(text, i).end()  # type: ignore[union-attr]  # matches the empty string too


def _decode(path: Path, text: str, i: int, counting: bool) -> tuple[Any, int]:
    try:
        return raw_decode(text, i, counting)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    except RecordError as err:
        raise ConfigError(f"{path}: {err}") from None


def _invalid(path: Path, text: str, message: str, i: int) -> ConfigError:
    err = json.JSONDecodeError(message, text, i)  # computes the line and column of i
    return ConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})")


def _not_an_array(path: Path, doc: object, record_keys: set[str]) -> ConfigError:
    what = "one record" if isinstance(doc, dict) and record_keys & doc.keys() else type(doc).__name__
    return ConfigError(
        f"{path}: expected a JSON array of records, or an object whose only key holds one "
        f'(e.g. {{"data": [...]}}), got {what}; use [...] or one object per line in a .jsonl file'
    )


def _optional(module: str, field: str, source: object, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise ConfigError(f"{field} {source} is {what}: install {package} (pip install 'jobspec-k8s[data]')") from None


def read_parquet(path: Path, field: str) -> Records:
    """(row, record) per row, in record batches sized to the rows (runner/data/tables.py)."""
    pq = _optional("pyarrow.parquet", field, path, "a Parquet file")
    f, _ = open_data(path, field)
    try:
        file = pq.ParquetFile(f)
    except (OSError, ValueError) as err:  # ArrowInvalid is a ValueError, ArrowIOError an OSError
        f.close()
        raise ConfigError(f"{path}: not a readable Parquet file ({err})") from err
    try:
        batches = tables.parquet_batches(file, str(path))
    except BaseException:
        f.close()
        raise
    return _closing(f, arrow_rows(batches, str(path)))


def _closing(f: BinaryIO, records: Records) -> Records:
    with f:
        yield from records


def arrow_rows(batches: Iterable[Any], where: str) -> Records:
    """(row, record) per row of Arrow record batches or tables, within the record limits."""
    for row, record in tables.rows(batches, where):
        yield Location(where, row=row), record


def read_saved_dataset(path: Path, field: str, splits: Sequence[str]) -> Records:
    """A `Dataset` or `DatasetDict` directory from `save_to_disk`."""
    datasets = _optional("datasets", field, path, "a datasets directory (save_to_disk)")
    check_saved_dataset(path, field)  # what load_from_disk opens: regular files inside `path`
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # the library's errors vary (FileNotFoundError, KeyError, ArrowInvalid): wrap them here
        raise ConfigError(f"{field} {path}: cannot load the datasets directory ({err})") from err
    return _dataset_rows(datasets, loaded, str(path), field, splits)


def read_hub_dataset(name: str, field: str, splits: Sequence[str]) -> Records:
    """`datasets.load_dataset(name)`: needs the network, or the dataset in the local HF cache."""
    datasets = _optional("datasets", field, repr(name), "a Hugging Face hub dataset id (no such local path)")
    try:
        loaded = datasets.load_dataset(name)
    except Exception as err:  # hub, network and builder errors of every kind: wrap them here
        raise ConfigError(
            f"{field} {name!r} is not a local file or directory, and loading it as a Hugging Face hub dataset "
            f"failed: {err}"
        ) from err
    return _dataset_rows(datasets, loaded, name, field, splits)


def read_hub_stream(name: str, field: str, splits: Sequence[str]) -> Records:
    """`datasets.load_dataset(name, streaming=True)`: the records as the hub serves them, none stored whole
    (`data.streaming`, runner/data/stream.py)."""
    datasets = _optional("datasets", field, repr(name), "a Hugging Face hub dataset id (no such local path)")
    try:
        loaded = datasets.load_dataset(name, streaming=True)
    except Exception as err:  # hub, network and builder errors of every kind: wrap them here
        raise ConfigError(
            f"{field} {name!r} is not a local file or directory, and streaming it as a Hugging Face hub dataset "
            f"failed: {err}"
        ) from err
    if isinstance(loaded, datasets.IterableDatasetDict):
        split = next((s for s in splits if s in loaded), None)
        if split is None:
            wanted = " or ".join(repr(s) for s in splits)
            raise ConfigError(f"{field} {name}: no {wanted} split; it has {sorted(loaded)}")
        loaded, name = loaded[split], f"{name}[{split}]"
    return arrow_rows(loaded.with_format("arrow").iter(batch_size=tables.BATCH_ROWS), name)


def _dataset_rows(datasets: ModuleType, loaded: Any, where: str, field: str, splits: Sequence[str]) -> Records:
    if isinstance(loaded, datasets.DatasetDict):
        split = next((s for s in splits if s in loaded), None)
        if split is None:
            raise ConfigError(
                f"{field} {where}: no {' or '.join(repr(s) for s in splits)} split; it has {sorted(loaded)} "
                "(save the split you want alone, with Dataset.save_to_disk)"
            )
        loaded, where = loaded[split], f"{where}[{split}]"
        log.info("data %s: split %s of a DatasetDict", where, split)
    return arrow_rows(loaded.with_format("arrow").iter(batch_size=tables.BATCH_ROWS), where)
