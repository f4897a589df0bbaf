"""The one way jobspec opens, creates, appends to, truncates and renames files in a directory others can write
(this module), and the optional key that signs what jobs leave there (`signing.py`).

A checkpoint volume, a data cache (`data.cache_dir` is meant to be shared), its stamps, locks and stream indexes, a
lease, a run's metrics and an export directory may all be written by another job, a colleague or an attacker who can
plant a name there before this process uses it: a symbolic link (to another job's metrics, to /dev/zero), a hard
link, a FIFO, a device, a directory. Every file operation on such a directory goes through this module, whose rules
are:

- **never through a link**: every open carries O_NOFOLLOW (a link in the last component is ELOOP, refused), unless
  the caller names a path a person chose (`follow=True`: a `data.path` may be a link to the data);
- **regular files only**: every open is non-blocking (a FIFO's open returns at once) and the open descriptor is
  checked with fstat before a byte is read or written, so what is used is what was checked;
- **new names are created exclusively**: a temporary file gets a random suffix and O_CREAT|O_EXCL (a name planted
  there, even a hard link to a file elsewhere, fails the create instead of being written through); a whole file
  is written to such a temporary and renamed over its name (`write_atomic`: a reader sees the old file or the
  new one; a link planted at the name is replaced, its target untouched);
- **relative to a directory descriptor**: the temporary's create, write and rename happen in one directory opened
  once, so a directory swapped for a link between two of them changes nothing;
- **appends and locks** (`open_append`, `open_lock`) open an existing regular file of a single hard link or create
  one, never a link;
- **no temporary outlives a process that ends on purpose**: a process about to leave with `os._exit` from another
  thread (a rank whose gang moved on, runner/process/worker.py) calls `seal()`, which removes the temporaries its
  `write_atomic` calls have under way and refuses every later one.

A refusal is `Unsafe`, an OSError (errno ELOOP or EINVAL) naming the file and what it is, so callers that treat an
unwritable file as "not written, logged" or "damaged, skipped" keep doing so. The readers of `jobspec.untrusted` and
`runner.checkpoint.files` open through `open_read` here.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, BinaryIO

_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
}
_BASE = os.O_NONBLOCK | os.O_CLOEXEC


class Unsafe(OSError):
    """A name that is not a regular file of its own directory (a link, a FIFO, a device, a directory)."""

    def __init__(self, path: str | Path, problem: str, code: int = errno.EINVAL):
        super().__init__(code, f"{Path(path).name} {problem}", str(path))
        self.detail = problem  # "is a FIFO (named pipe), not a regular file"
        self.problem = f"{Path(path).name} {problem}"

    def __str__(self) -> str:
        return self.problem


def kind(mode: int) -> str:
    """What a file of `st_mode` is, in words ("a FIFO (named pipe)"); "a regular file" for one."""
    return "a regular file" if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_fd(path: str | Path, flags: int, *, follow: bool = False, dir_fd: int | None = None, mode: int = 0o644,
            alone: bool = False) -> int:  # fmt: skip
    """os.open(`path`, `flags`) of a regular file: never blocking (a FIFO), never through a link unless `follow`,
    checked on the descriptor; the descriptor is blocking again when returned. `alone`: the file may have no other
    hard link (one planted at the name would lead a write into a file elsewhere). `Unsafe` for anything else."""
    try:
        fd = os.open(path, flags | _BASE | (0 if follow else os.O_NOFOLLOW), mode, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP and not follow:
            raise Unsafe(path, "is a symbolic link", errno.ELOOP) from None
        if err.errno == errno.EISDIR:
            raise Unsafe(path, "is a directory, not a regular file") from None
        if err.errno == errno.ENXIO:  # a non-blocking open for writing of a FIFO without a reader
            raise Unsafe(path, "is a FIFO (named pipe), not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unsafe(path, f"is {kind(st.st_mode)}, not a regular file")
        if alone and st.st_nlink > 1:
            raise Unsafe(path, f"has {st.st_nlink} hard links, not a file of its own")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_read(path: str | Path, *, follow: bool = False, buffering: int = -1) -> BinaryIO:
    """`path` opened for binary reading, a regular file (reached through a link only with `follow`)."""
    return os.fdopen(open_fd(path, os.O_RDONLY, follow=follow), "rb", buffering=buffering)


def open_append(path: str | Path, *, encoding: str = "utf-8") -> IO[str]:
    """`path` opened to append text lines (line-buffered), created when missing; never a link or a FIFO."""
    fd = open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, alone=True)
    return os.fdopen(fd, "a", buffering=1, encoding=encoding)


def open_lock(path: str | Path) -> int:
    """A read-write descriptor of the lock file `path` (created when missing) for fcntl.flock; never a link."""
    return open_fd(path, os.O_RDWR | os.O_CREAT, alone=True)


def create(path: str | Path, mode: int = 0o644) -> BinaryIO:
    """A new file `path` opened for binary writing: FileExistsError when the name is taken (by anything, a link
    or a hard link included): nothing is ever written through a name someone else made."""
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode=mode), "wb")


def directory(path: str | Path, *, create_it: bool = True, follow: bool = False) -> Path:
    """`path` as a directory of its own (made when missing and `create_it`): `Unsafe` when it is a link (unless
    `follow`: a directory a person named) or not a directory. Returns `path`."""
    path = Path(path)
    if create_it:
        with suppress(FileExistsError):  # a file or a dangling link there: told below
            path.mkdir(parents=True, exist_ok=True)
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        if create_it:
            raise Unsafe(path, "is a dangling symbolic link, not a directory", errno.ELOOP) from None
        raise
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(path, f"is {kind(st.st_mode)}, not a directory of its own")
    return path


@contextmanager
def opened_dir(path: str | Path, *, follow: bool = True) -> Iterator[int]:
    """A descriptor of the directory `path` (links followed in it: the caller chose it; not in its last component
    unless `follow`: ELOOP), closed at the end."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        yield fd
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """A fresh temporary name beside `name`: hidden, random (64 bits), never one a planter could guess."""
    return f".{name[:100]}.{secrets.token_hex(8)}.tmp"


def write_atomic(path: str | Path, data: bytes, *, fsync: bool = True, mode: int = 0o644,
                 follow_dir: bool = True, ready: Callable[[], bool] | None = None) -> bool:  # fmt: skip
    """`data` as the whole content of `path`: written to an exclusively created temporary in the same directory,
    fsynced (`fsync`), renamed over `path`, all relative to one descriptor of the directory. A link planted at
    `path` is replaced, never followed; a directory there fails (IsADirectoryError). Without `follow_dir` the
    directory itself may not be a link either (ELOOP): one inside a shared directory that nobody chose.
    `ready`: asked before the temporary is created and again right before the rename, once the data is written and
    synced; False leaves `path` as it is (no temporary left) and returns False. A writer whose right to write may
    end meanwhile (a lease's holder) checks it there: between the last check and the rename there is no write or
    fsync, microseconds, not milliseconds. Sealed (`seal`): Sealed, nothing created."""
    path = Path(path)
    if ready is not None and not ready():
        return False
    with opened_dir(path.parent, follow=follow_dir) as dfd:
        tmp = temp_name(path.name)
        fd = _create_temporary(tmp, dfd, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            if ready is not None and not ready():
                _unlink_quietly(tmp, dfd)
                return False
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            _unlink_quietly(tmp, dfd)
            raise
        finally:
            with _FLIGHT.lock:
                _FLIGHT.temporaries.pop((dfd, tmp), None)
    return True


class Sealed(OSError):
    """A write after `seal()`: this process is ending and writes nothing more."""


class _Flight:
    """The temporaries of `write_atomic` calls under way in this process, by (directory descriptor, name)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.temporaries: dict[tuple[int, str], None] = {}
        self.sealed = False


_FLIGHT = _Flight()


def _create_temporary(name: str, dfd: int, mode: int) -> int:
    """Create `name` exclusively in `dfd`, registered as under way (under the lock, so that `seal` either sees it
    created or keeps it from being created)."""
    with _FLIGHT.lock:
        if _FLIGHT.sealed:
            raise Sealed(errno.ECANCELED, "this process is ending: it writes nothing more", name)
        fd = open_fd(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=dfd, mode=mode)
        _FLIGHT.temporaries[(dfd, name)] = None
        return fd


def seal(wait_s: float = 2.0) -> None:
    """For a process about to end with `os._exit` while another of its threads may be inside `write_atomic`:
    remove every temporary under way and refuse every later `write_atomic` (Sealed), so that the process leaves no
    half-written temporary behind. A creation under way is waited for up to `wait_s` (a file system that hangs:
    the process ends anyway)."""
    locked = _FLIGHT.lock.acquire(timeout=wait_s)
    try:
        _FLIGHT.sealed = True
        for dfd, name in list(_FLIGHT.temporaries):
            _unlink_quietly(name, dfd)
        _FLIGHT.temporaries.clear()
    finally:
        if locked:
            _FLIGHT.lock.release()


def create_exclusive(path: str | Path, data: bytes, *, mode: int = 0o644) -> bool:
    """Write `data` into a new file `path`, fsynced; False (nothing written) when the name is taken already."""
    try:
        f = create(path, mode)
    except FileExistsError:
        return False
    try:
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(path)
        raise
    return True


def make_temp_dir(parent: str | Path, prefix: str) -> Path:
    """A new directory `<parent>/<prefix><random>`, made exclusively (mkdir fails on any name already there)."""
    parent = Path(parent)
    for _ in range(8):
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no fresh temporary directory name under {parent}", str(parent))


def replace(src: str | Path, dst: str | Path) -> None:
    """Rename `src` over `dst` in one directory (relative to one descriptor of it: neither name is followed)."""
    src, dst = Path(src), Path(dst)
    if src.parent != dst.parent:
        raise ValueError(f"{src} and {dst} are not in one directory")
    with opened_dir(src.parent) as dfd:
        os.replace(src.name, dst.name, src_dir_fd=dfd, dst_dir_fd=dfd)


def fsync_dir(path: str | Path) -> None:
    """fsync the directory `path` (a rename in it is durable); a filesystem that refuses it is let be."""
    with opened_dir(path) as fd:
        try:
            os.fsync(fd)
        except OSError as err:  # some network filesystems refuse fsync on a directory
            if err.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise


def _unlink_quietly(name: str | Path, dir_fd: int | None = None) -> None:
    with suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def lstat_regular(path: str | Path) -> os.stat_result | None:
    """`path`'s lstat when it is a regular file itself (a link to one is not), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None

