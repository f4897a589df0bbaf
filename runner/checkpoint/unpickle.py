"""No code from the run directory: the pickles a DCP checkpoint holds, read so that none can run code.

torch.distributed.checkpoint (DCP) keeps two kinds of pickle, and its readers trust both:
- `.metadata`, read by FileSystemReader with pickle.load: a file that names `os.system` runs it. Here
  `read_metadata` reads it (a bounded read of a regular file) with `_Unpickler`, which admits only the
  globals DCP writes: its metadata dataclasses, torch.Size, dtypes, layouts and memory formats by name,
  a path (the private ones from runner/internals/), with its memo in a dict (`_Unpickler`: the C
  unpickler's memo array grows to any index a PUT names), then checks it field by field (`check_metadata`):
  exact types; every stored item in a shard file of this checkpoint (`__<rank>_<n>.distcp`, no path),
  its byte range inside that file; every chunk inside its tensor and stored; no stream transforms. The
  walk takes at most one step per byte of the file (a chunk list shared by every entry would otherwise
  cost entries x chunks).
- the byte items inside the shards (the optimizer's hyper-parameters: lr, betas, ...), which DCP's
  DefaultLoadPlanner reads with torch.load(weights_only=False). `SafeLoadPlanner` reads them with
  weights_only=True and admits plain values and tensors only; `items_problem` does the same at verify.
Tensor items DCP reads with torch.load(weights_only=True) already; the RNG states: runner/checkpoint/rng.py.

Every dcp.load of the runner and of export passes `reader(path)` and `SafeLoadPlanner()`. The reader
opens files through runner/checkpoint/files.py (regular files only, never through a link), so a file
swapped for a FIFO or a link after `verify` still cannot hang a load or lead it out of the directory.
"""

from __future__ import annotations

import io
import math
import pickle
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import FileSystem

from jobspec import shared_dir
from runner import internals
from runner.checkpoint import files, torchzip

METADATA = ".metadata"
MAX_METADATA_BYTES = 512 * 2**20  # ~120 bytes per stored chunk: 4M chunks (70B params x 3 x 2048 ranks is 430k)
MAX_BYTES_ITEM = 16 * 2**20  # an optimizer hyper-parameter pickles to ~1 KB; a parameter-name list to a few MB
SHARD = re.compile(r"^__\d+_\d+\.distcp$")  # FileSystemWriter's names: __<rank>_<file>.distcp
_MAX_DIMS = 64
_MAX_EXTENT = 2**48  # elements along one dimension
_MAX_PLAIN_DEPTH = 8
_ITEM_OVERHEAD = 2**20  # torch.save's zip around a tensor's bytes (DCP saves each chunk with a storage of its own)


class _Unpickler(pickle._Unpickler):
    """pickle's pure-Python Unpickler, resolving only the globals in `allowed` (see the module docstring).

    Not the C one: its memo is an array it grows to twice any index a PUT opcode names, so an 11-byte pickle
    (PUT 2**31) makes it allocate and zero 32 GB. This one keeps its memo in a dict. About 2x slower: 4.4 s
    for the 13 MiB metadata of 96k chunks (1,500 tensors x 64 ranks), where pickle.load takes 1.9 s."""

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any]):
        super().__init__(io.BytesIO(data))
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {_show(f'{module}.{name}')}, which DCP metadata never holds")
        return found


def _allowed_globals() -> dict[tuple[str, str], Any]:
    public = (md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
              md.TensorProperties, md.MetadataIndex, md.StorageMeta)  # fmt: skip
    allowed: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in public}
    allowed.update({("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)})
    allowed[("torch", "Size")] = torch.Size
    # StorageMeta.checkpoint_id: the writer's directory, informational (replaced on read); a pure path does no I/O
    allowed[("pathlib", "PosixPath")] = allowed[("pathlib._local", "PosixPath")] = PurePosixPath
    allowed.update(internals.dcp_private_globals())
    allowed[("builtins", "getattr")] = _enum_member
    return allowed


def _enum_member(cls: Any, name: Any) -> Any:
    """What `builtins.getattr` may do in DCP metadata: name a member of its enum. Python 3.12 and 3.11's later
    patch releases (the runner image's) pickle an enum member as `getattr(EnumClass, "NAME")`; the enum class is
    then the unpickler's by-value stand-in (runner.internals.dcp_private_globals), which carries the members.
    Any other object or name is refused."""
    members = getattr(cls, "members", None) if callable(cls) and not isinstance(cls, type) else None
    if not isinstance(members, dict) or not isinstance(name, str) or name not in members:
        raise pickle.UnpicklingError(f"it calls getattr on {_show(cls)}.{_show(name)}, which DCP metadata never does")
    return members[name]


def _show(value: object, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(err: BaseException) -> str:
    return _show((str(err).strip().splitlines() or [type(err).__name__])[0], 200)


def read_metadata(directory: Path) -> md.Metadata:
    """The checked DCP metadata of checkpoint `directory`: ValueError (why, naming the file) when it is not
    metadata DCP wrote for these shards, OSError (files.UnsafeFile) when it is not a regular file of at most
    MAX_METADATA_BYTES."""
    data = files.read_bytes(directory / METADATA, MAX_METADATA_BYTES, "DCP metadata file")
    try:
        metadata = _Unpickler(data, _allowed_globals()).load()
    except Exception as err:  # only admitted constructors ran: any failure means a file DCP did not write
        raise ValueError(f"{METADATA} is not DCP metadata ({_first_line(err)}): a forged or foreign file") from None
    shards = {name: size for name, size in files.regular_sizes(directory).items() if SHARD.match(name)}
    try:
        check_metadata(metadata, shards, budget=len(data) + 1024)
    except _ShardGone as err:  # the metadata may be fine: the shard it names is what is wrong
        raise ValueError(files.problem(directory / str(err)) or f"{err} is missing") from None
    except ValueError as err:
        why = f"{METADATA} does not describe this checkpoint's shards ({err}): a forged or foreign file"
        raise ValueError(why) from None
    metadata.storage_meta = md.StorageMeta()  # the writer's temp dir and save id: informational, not trusted
    return metadata


class _ShardGone(ValueError):
    """A shard name the metadata reads from is not a regular file of the directory (missing, a link, a FIFO...)."""


class _Budget:
    """One step per entry or chunk visited; more steps than the file has bytes means shared parts repeated."""

    def __init__(self, steps: int):
        self.left = steps

    def step(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise ValueError("its entries repeat shared parts (more entries than its bytes can hold)")


def _fields(obj: Any, cls: type, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if type(obj) is not cls:
        raise ValueError(f"it holds a {_show(type(obj).__name__)} where DCP writes a {cls.__name__}")
    fields = vars(obj)
    if not set(required) <= fields.keys() <= {*required, *optional}:
        raise ValueError(f"its {cls.__name__} has the fields {_show(sorted(map(str, fields)))}")
    return fields


def _size(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not torch.Size or len(value) > _MAX_DIMS or not all(0 <= d <= _MAX_EXTENT for d in value):
        raise ValueError(f"the {what} is not a tensor size")
    return tuple(value)


def _fqn(value: Any) -> str:
    if type(value) is not str or not 0 < len(value) <= 4096:
        raise ValueError(f"it names an item {_show(value)}, which is not a state-dict key")
    return value


def _properties(value: Any, fqn: str) -> int:
    """The bytes per element of a tensor's checked properties."""
    props = _fields(value, md.TensorProperties, ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"))
    if not (
        type(props["dtype"]) is torch.dtype
        and type(props["layout"]) is torch.layout
        and type(props["memory_format"]) is torch.memory_format
        and type(props["requires_grad"]) is bool
        and type(props["pin_memory"]) is bool
    ):
        raise ValueError(f"the tensor properties of {_show(fqn)} are not a dtype, layout and flags")
    return props["dtype"].itemsize


def check_metadata(metadata: Any, shards: dict[str, int], *, budget: int) -> None:
    """ValueError (why) unless `metadata` has the shape DCP writes and stores every item inside `shards`
    (shard file name -> size). At most `budget` entries and chunks are visited."""
    steps = _Budget(budget)
    fields = _fields(metadata, md.Metadata, ("state_dict_metadata",),
                     ("planner_data", "storage_data", "storage_meta", "version"))  # fmt: skip
    items, stored = fields["state_dict_metadata"], fields.get("storage_data")
    if type(items) is not dict or type(stored) is not dict:
        raise ValueError("its item or storage table is not a dict")
    needed: dict[tuple[str, tuple[int, ...] | None], int] = {}  # each stored item -> the most bytes it may take
    for fqn, item in items.items():
        steps.step()
        _fqn(fqn)
        if type(item) is md.BytesStorageMetadata:
            _fields(item, md.BytesStorageMetadata, ())
            needed[(fqn, None)] = MAX_BYTES_ITEM
            continue
        tensor = _fields(item, md.TensorStorageMetadata, ("properties", "size", "chunks"))
        itemsize = _properties(tensor["properties"], fqn)
        size = _size(tensor["size"], f"size of {_show(fqn)}")
        if type(tensor["chunks"]) is not list:
            raise ValueError(f"the chunks of {_show(fqn)} are not a list")
        for chunk in tensor["chunks"]:
            steps.step()
            cut = _fields(chunk, md.ChunkStorageMetadata, ("offsets", "sizes"))
            offsets, sizes = _size(cut["offsets"], "chunk offset"), _size(cut["sizes"], "chunk size")
            if not len(offsets) == len(sizes) == len(size) or any(map(lambda o, s, d: o + s > d, offsets, sizes, size)):
                raise ValueError(f"a chunk of {_show(fqn)} lies outside its tensor {list(size)}")
            needed[(fqn, offsets)] = math.prod(sizes) * itemsize + _ITEM_OVERHEAD
    found = set()
    for index, info in stored.items():
        steps.step()
        key = _fields(index, md.MetadataIndex, ("fqn",), ("offset", "index"))  # absent: the class default, None
        fqn = _fqn(key["fqn"])
        offset = None if key.get("offset") is None else _size(key["offset"], "stored offset")
        if (fqn, offset) not in needed or not (key.get("index") is None or type(key["index"]) is int):
            raise ValueError(f"it stores bytes for {_show(fqn)} at {offset}, which is not one of its items or chunks")
        _check_storage(info, shards, most=needed[(fqn, offset)], fqn=fqn)
        found.add((fqn, offset))
    if missing := needed.keys() - found:
        raise ValueError(f"{_show(min(missing)[0])} has no stored bytes")
    _check_planner_data(fields.get("planner_data"))
    version, meta = fields.get("version"), fields.get("storage_meta")
    if not (version is None or (type(version) is str and len(version) <= 64)):
        raise ValueError("its version is not a short string")
    if not (meta is None or type(meta) is md.StorageMeta):
        raise ValueError("its storage_meta is not a StorageMeta")


def _check_storage(info: Any, shards: dict[str, int], *, most: int, fqn: str) -> None:
    """`info` (where an item is stored) names a shard of `shards`, a byte range inside it of at most `most` bytes."""
    where = _fields(info, internals.dcp_storage_info(), ("relative_path", "offset", "length"),
                    ("transform_descriptors",))  # fmt: skip
    name, offset, length = where["relative_path"], where["offset"], where["length"]
    if type(name) is not str or not SHARD.match(name):
        raise ValueError(f"it reads from {_show(name)}, which is not a shard file (__<rank>_<n>.distcp) of this "
                         "checkpoint")  # fmt: skip
    if name not in shards:
        raise _ShardGone(name)
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise ValueError(f"its byte range in {name} is not two non-negative integers")
    if offset + length > shards[name]:
        raise ValueError(f"it reads bytes {offset}..{offset + length} of {name}, which has {shards[name]}")
    if length > most:
        raise ValueError(f"it stores {length:,} bytes for {_show(fqn)}, which takes at most {most:,}")
    if where.get("transform_descriptors") not in (None, [], ()):
        raise ValueError("it applies stream transforms (e.g. compression), which jobspec never writes")


def _check_planner_data(data: Any) -> None:
    """DefaultSavePlanner's: flattened key -> the path of keys it came from."""
    if data is None:
        return
    if type(data) is not dict or not all(
        type(k) is str and type(v) in (tuple, list) and len(v) <= _MAX_DIMS and all(type(p) in (str, int) for p in v)
        for k, v in data.items()
    ):
        raise ValueError("its planner data is not a table of key paths")


# --- the byte items inside the shards ----------------------------------------------------------------------


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether `value` is made of plain values and tensors only (what an optimizer's param_groups hold)."""
    if value is None or type(value) in (bool, int, float, str, bytes) or isinstance(value, torch.Tensor):
        return True
    if depth >= _MAX_PLAIN_DEPTH:
        return False
    if type(value) in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(type(k) in (str, int) and _plain(v, depth + 1) for k, v in value.items())
    return False


_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation", "WeightsUnpickler error")


def weights_only_load(data: bytes) -> Any:
    """torch.load(weights_only=True) of `data`, once its zip is known to inflate nothing (runner/checkpoint/
    torchzip.py): ValueError saying what it refused (torch's advice to retry with weights_only=False is left
    out: that is the code execution this avoids)."""
    torchzip.check_bytes(data)
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": noise about a file that is refused anyway
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses any global outside torch's allowlist: no code ran
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        reason = next((line for line in lines if not line.startswith(_BOILERPLATE)), type(err).__name__)
        raise ValueError(_show(reason, 200)) from None


def decode_bytes_item(data: bytes, fqn: str) -> Any:
    """The value DCP stored for the non-tensor item `fqn`, read with torch.load(weights_only=True)."""
    try:
        value = weights_only_load(data)
    except ValueError as err:
        raise ValueError(f"the stored value of {_show(fqn)} is not plain data ({err})") from None
    if not _plain(value):
        raise ValueError(f"the stored value of {_show(fqn)} is a {_show(type(value).__name__)}, not plain data")
    return value


def read_bytes_item(directory: Path, metadata: md.Metadata, fqn: str) -> Any:
    """The non-tensor item `fqn` stored in the shards of checkpoint `directory` (checked `metadata`), decoded as
    `decode_bytes_item`; KeyError when the checkpoint holds no such item, OSError or ValueError: unreadable."""
    if not isinstance(metadata.state_dict_metadata.get(fqn), md.BytesStorageMetadata):
        raise KeyError(fqn)
    info = next(i for index, i in (metadata.storage_data or {}).items() if index.fqn == fqn)
    with files.open_regular(directory / info.relative_path) as f:
        _check_item(f, fqn, info, md.BytesStorageMetadata)
        f.seek(info.offset)
        return decode_bytes_item(files.read_at_most(f, info.length), fqn)


def items_problem(directory: Path, metadata: md.Metadata) -> str | None:
    """Why an item stored in the shards of checkpoint `directory` (checked `metadata`) cannot be read safely: its
    torch.save zip would inflate (torchzip.py: a few small reads each, tensors included), or a non-tensor item
    is not plain data read with weights_only=True."""
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    for name, items in sorted(by_file.items()):
        try:
            with files.open_regular(directory / name) as f:
                for index, info in sorted(items, key=lambda item: item[1].offset):
                    _check_item(f, index.fqn, info, type(metadata.state_dict_metadata[index.fqn]))
        except files.UnsafeFile as err:
            return str(err)
        except OSError as err:
            return f"{name} cannot be read ({err.strerror or err})"
        except ValueError as err:
            return f"{name}: {err}"
    return None


def _check_item(f: BinaryIO, fqn: str, info: Any, kind: type) -> None:
    try:
        torchzip.check(f, info.offset, info.length)
    except ValueError as err:
        raise ValueError(f"the stored bytes of {_show(fqn)} are {err}") from None
    if kind is md.BytesStorageMetadata:
        f.seek(info.offset)
        decode_bytes_item(files.read_at_most(f, info.length), fqn)


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor items are read with torch.load(weights_only=True) (`decode_bytes_item`)
    instead of weights_only=False."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        decoded = decode_bytes_item(value.read(), read_item.dest_index.fqn)
        plain = io.BytesIO()
        torch.save(decoded, plain)  # DefaultLoadPlanner unpickles without restriction: only bytes written here
        plain.seek(0)
        super().load_bytes(read_item, plain)


# --- the reader ------------------------------------------------------------------------------------------------


class _RegularFiles(FileSystem):
    """DCP's file access in a shared volume: reading regular files only (files.open_regular), writing new files only,
    created exclusively, never through a name someone else made (jobspec.shared_dir.create): the shards and
    `.metadata`'s temporary, which DCP renames into place. `guard` runs before each file is created and before each
    write into it (`_Guarded`)."""

    def __init__(self, guard: Callable[[], None] | None = None):
        super().__init__()
        self.guard = guard

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if mode not in ("rb", "wb"):
            raise ValueError(f"a checkpoint is read whole or written new, never opened {mode!r}")
        if mode == "rb":
            with files.open_regular(Path(path)) as f:
                yield f
            return
        if self.guard is not None:
            self.guard()
        with shared_dir.create(Path(path)) as f:
            yield f if self.guard is None else _Guarded(f, self.guard)


class _Latch:
    """A writer's guard that, once it raised, raises the same for every later call: a write that follows a refused
    one (torch.save closing its archive) is refused too, and `stopped` keeps the first reason for the caller (DCP
    and torch.save wrap what a write raised in errors of their own)."""

    def __init__(self, guard: Callable[[], None]):
        self.guard = guard
        self.stopped: BaseException | None = None

    def __call__(self) -> None:
        if self.stopped is not None:
            raise self.stopped
        try:
            self.guard()
        except BaseException as exc:
            self.stopped = exc
            raise


class _Guarded:
    """A file being written whose every `write` first calls `guard` (which raises when this writer must stop): a rank
    frozen in the middle of a shard and woken after its gang moved on stops within one write, instead of writing
    the rest of a shard no attempt will read into the volume the next attempt checkpoints to. Everything else is
    the file's own."""

    def __init__(self, f: BinaryIO, guard: Callable[[], None]):
        self._f, self._guard = f, guard

    def write(self, data: Any) -> int:
        self._guard()
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the file's
        return getattr(self._f, name)


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader with `metadata` already read and checked (`read_metadata`), opening files through
    files.open_regular."""

    def __init__(self, path: str | Path, metadata: md.Metadata):
        super().__init__(path)
        if not isinstance(getattr(self, "fs", None), FileSystem):  # torch 2.13 keeps its file access in `fs`
            raise RuntimeError("torch's FileSystemReader keeps no `fs`: runner/checkpoint/unpickle.py needs updating")
        self.fs = _RegularFiles()
        self.metadata = metadata

    def read_metadata(self) -> md.Metadata:  # type: ignore[override]  # no **kwargs: DCP then never asks per rank
        self.metadata.storage_meta = md.StorageMeta(load_id=getattr(self, "load_id", None))
        return self.metadata


class SafeWriter(dcp.FileSystemWriter):
    """FileSystemWriter (fsynced) creating its files through `_RegularFiles`: exclusively, never through a link;
    `guard` (if given) runs before each file it creates and each write into one; once it raised, every later write
    raises the same (`stopped`)."""

    def __init__(self, path: str | Path, guard: Callable[[], None] | None = None):
        super().__init__(path, sync_files=True)
        if not isinstance(getattr(self, "fs", None), FileSystem):
            raise RuntimeError("torch's FileSystemWriter keeps no `fs`: runner/checkpoint/unpickle.py needs updating")
        self.latch = _Latch(guard) if guard is not None else None
        self.fs = _RegularFiles(self.latch)

    @property
    def stopped(self) -> BaseException | None:
        """What the guard raised, if it did: the reason a dcp.save with this writer failed."""
        return self.latch.stopped if self.latch is not None else None


def reader(path: str | Path) -> SafeReader:
    """The reader every dcp.load passes. It reads and checks `.metadata` here, so a forged one is a ValueError or
    OSError naming the file before DCP starts (DCP would log its own traceback for a failed metadata read)."""
    return SafeReader(path, read_metadata(Path(path)))


def load_failure(err: BaseException) -> str:
    """The first line of what made a dcp.load fail (a CheckpointException wraps one exception per rank)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            if isinstance(failure, tuple) and isinstance(failure[0], BaseException):
                return _first_line(failure[0])
    return _first_line(err)
