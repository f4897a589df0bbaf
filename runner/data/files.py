"""Data files as regular files: opened without blocking, checked on the descriptor, read within their size.

The file `data.path` (or `data.eval_path`) names may be a link (Hugging Face cache snapshots and
ConfigMap-style mounts are links), but it must resolve to a regular file: a link to /dev/zero, a FIFO, a
socket or a device is refused with exit 2 before a byte is read. The check is made on the open
descriptor (`jobspec.untrusted.open_regular`), so the name cannot be swapped between check and read, and
readers stop at the size the file had when it was opened (a file that grows is not followed).

A `datasets` directory is one unit written by `save_to_disk`, which writes no links: every file that
`load_from_disk` opens (dataset_dict.json, each split's state.json and dataset_info.json, and the Arrow
files state.json lists) must be a regular file that resolves inside the directory. The JSON files are
read here first within MAX_METADATA_BYTES and the record limits, since `datasets` reads them unbounded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

from jobspec.errors import ConfigError
from jobspec.untrusted import open_regular, read_bounded
from runner.data.limits import MiB, RecordError, loads, long_digits

# state.json lists the Arrow files and dataset_info.json the features: kilobytes in practice.
MAX_METADATA_BYTES = 16 * MiB
DATASET_DICT, STATE, INFO = "dataset_dict.json", "state.json", "dataset_info.json"


def open_data(path: Path, field: str) -> tuple[BinaryIO, int]:
    """`path` open for reading and its size when opened; ConfigError unless it is a regular file."""
    f = open_regular(path, what=field)
    return f, os.fstat(f.fileno()).st_size


def check_saved_dataset(path: Path, field: str) -> None:
    """ConfigError unless every file `datasets.load_from_disk(path)` opens is a regular file inside `path`."""
    root = Path(os.path.realpath(path))
    if os.path.lexists(root / DATASET_DICT):  # a DatasetDict: loading it loads every split it lists
        splits = _metadata(root, root / DATASET_DICT, field).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise ConfigError(f'{field} {root / DATASET_DICT}: expected {{"splits": [...]}} (DatasetDict.save_to_disk)')
        folders = [root / split for split in splits]
    else:
        folders = [root]
    for folder in folders:
        _metadata(root, folder / INFO, field)
        files = _metadata(root, folder / STATE, field).get("_data_files")
        if not isinstance(files, list) or not all(isinstance(_name(f), str) for f in files):
            raise ConfigError(
                f'{field} {folder / STATE}: expected "_data_files": [{{"filename": ...}}] (Dataset.save_to_disk)'
            )
        for entry in files:
            open_regular(folder / entry["filename"], what=f"{field} file", root=root).close()


def _name(entry: object) -> object:
    return entry.get("filename") if isinstance(entry, dict) else None


def _metadata(root: Path, path: Path, field: str) -> dict[str, Any]:
    """A JSON object file of the dataset directory, read within the limits."""
    raw = read_bounded(path, MAX_METADATA_BYTES, what=f"{field} file", root=root)
    try:
        doc = loads(raw.decode("utf-8"), long_digits(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{field} {path}: not a valid JSON file ({err}); save the dataset again") from None
    except RecordError as err:
        raise ConfigError(f"{field} {path}: {err}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{field} {path}: expected a JSON object, got {type(doc).__name__}")
    return doc
