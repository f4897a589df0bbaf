"""Training records from files: JSON lines, a JSON array, Parquet, a `datasets` directory or a hub id.

`read_records(source, spec)` picks the reader from the source and returns an iterator of
`(Location, record)`; every error names the file and the line (text files, 1-based) or the row
(tables and JSON arrays, 0-based as in `dataset[N]`):

- `.jsonl` / `.ndjson`: one JSON object per line, streamed line by line; each line is decoded on its
  own, so one bad byte names its line and column instead of failing the whole file;
- `.json`: one array of objects, or an object whose only key holds that array (`{"data": [...]}`);
  read whole (JSON has no record boundaries to stream on);
- `.parquet`: streamed in record batches with pyarrow;
- a directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`; from a DatasetDict
  the first of `splits` it has (`train` for data.path; `validation`, else `test`, for data.eval_path);
- otherwise a name like `org/name` that is no local path: `datasets.load_dataset(name)`, same splits.

pyarrow and datasets are optional (`pip install 'jobspec-k8s[data]'`); they are imported only when a
source needs them. Arrow has no "absent": a column or struct field missing from one record reads as
null there. Nulls are dropped, so a record holds the keys its JSON line would (`to_pylist` already
makes structs dicts and lists of structs lists of dicts).
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

log = logging.getLogger("jobspec.runner")
TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("validation", "test")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
SUPPORTED = (
    ".jsonl/.ndjson (one JSON object per line), .json (an array of objects), .parquet, "
    "a directory written by datasets' save_to_disk, or a Hugging Face hub dataset id (org/name)"
)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
BATCH_ROWS = 1024  # rows per Arrow batch: bounded memory, few Python-level calls


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
        return read_jsonl(path)
    if kind == "json":
        return read_json(path, spec)
    if kind == "parquet":
        return read_parquet(path, field)
    if kind == "datasets":
        return read_saved_dataset(path, field, splits)
    return read_hub_dataset(source, field, splits)


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


def read_jsonl(path: Path) -> Records:
    """(line, record) per non-empty line, read as bytes and decoded line by line."""
    try:
        f = path.open("rb")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the data file ({err})") from err
    return _jsonl_lines(f, path)


def _jsonl_lines(f: BinaryIO, path: Path) -> Records:
    with f:
        for n, raw in enumerate(f, 1):
            if n == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            line = decode_utf8(raw, str(path), n)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{path}:{n}: not valid JSON ({err.msg}); each line must be one JSON object"
                ) from None
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


def read_json(path: Path, spec: DataSpec) -> Records:
    """(row, record) per element of the file's array (or of the only key of its top-level object)."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the data file ({err})") from err
    try:
        doc = json.loads(decode_utf8(raw.removeprefix(codecs.BOM_UTF8), str(path)))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    return _json_rows(path, _json_array(doc, path, spec))


def _json_array(doc: object, path: Path, spec: DataSpec) -> list:
    if isinstance(doc, list):
        return doc
    record_keys = {spec.messages_field, spec.prompt_field, spec.response_field}
    if isinstance(doc, dict) and len(doc) == 1 and not record_keys & doc.keys():
        key, value = next(iter(doc.items()))
        if isinstance(value, list):
            log.info("data %s: records from its key %r", path, key)
            return value
    what = "one record" if isinstance(doc, dict) and record_keys & doc.keys() else type(doc).__name__
    raise ConfigError(
        f"{path}: expected a JSON array of records, or an object whose only key holds one "
        f'(e.g. {{"data": [...]}}), got {what}; use [...] or one object per line in a .jsonl file'
    )


def _json_rows(path: Path, items: list) -> Records:
    for i, record in enumerate(items):
        if not isinstance(record, dict):
            raise ConfigError(f"{path}: row {i}: expected a JSON object, got {type(record).__name__}")
        yield Location(str(path), row=i), record


def _optional(module: str, field: str, source: object, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise ConfigError(f"{field} {source} is {what}: install {package} (pip install 'jobspec-k8s[data]')") from None


def read_parquet(path: Path, field: str) -> Records:
    """(row, record) per row, in record batches of BATCH_ROWS."""
    pq = _optional("pyarrow.parquet", field, path, "a Parquet file")
    try:
        file = pq.ParquetFile(path)
    except (OSError, ValueError) as err:  # ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise ConfigError(f"{path}: not a readable Parquet file ({err})") from err
    return arrow_rows(file.iter_batches(batch_size=BATCH_ROWS), str(path))


def arrow_rows(batches: Iterable[Any], where: str) -> Records:
    """(row, record) per row of Arrow record batches or tables, nulls dropped (see the module docstring)."""
    row = 0
    try:
        for batch in batches:
            for record in batch.to_pylist():
                yield Location(where, row=row), drop_nulls(record)
                row += 1
    except (OSError, ValueError) as err:  # a damaged file found mid-read
        raise ConfigError(f"{where}: row {row}: cannot read ({err})") from err


def drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def read_saved_dataset(path: Path, field: str, splits: Sequence[str]) -> Records:
    """A `Dataset` or `DatasetDict` directory from `save_to_disk`."""
    datasets = _optional("datasets", field, path, "a datasets directory (save_to_disk)")
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
    return arrow_rows(loaded.with_format("arrow").iter(batch_size=BATCH_ROWS), where)
