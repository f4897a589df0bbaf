"""Reading files that someone else wrote: regular files only, inside their directory, with a size bound.

A run directory, a model directory, a data set or a metrics file may come from another job or another
person. A name there can be a link to `/dev/zero` (a read without end), a FIFO (an open that blocks until
a writer comes), a device, or a link out of the directory. The file is opened without blocking and
checked on the open descriptor (`fstat`), so what is read is what was checked: no window between the
check and the read in which the name could be swapped.

Everything here raises `ConfigError` (exit 2) naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from jobspec.errors import ConfigError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip


def kind(mode: int) -> str:
    """What a file of `st_mode` is, in words ("a FIFO (named pipe)"); "a regular file" for one."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else "special")


def inside(path: Path, root: Path, what: str) -> Path:
    """`path` with its links resolved, which must stay under `root` (resolved too); ConfigError otherwise."""
    real, top = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if real != top and top not in real.parents:
        raise ConfigError(f"{what} {path} links to {real}, outside {top}: refusing a link out of the directory")
    return real


def open_regular(path: str | Path, *, what: str = "file", limit: int | None = None,
                 root: str | Path | None = None) -> BinaryIO:  # fmt: skip
    """`path` opened for binary reading once it is known to be a regular file (of at most `limit` bytes,
    resolving under `root` when given). The open never blocks: O_NONBLOCK makes a FIFO's open return."""
    path = Path(path)
    if root is not None:
        inside(path, Path(root), what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be opened: {err.strerror or err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is {kind(st.st_mode)}, not a regular file: replace it with the file")
        if limit is not None and st.st_size > limit:
            raise ConfigError(f"{what} {path} is {st.st_size:,} bytes, more than the {limit:,} allowed for it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | Path, limit: int, *, what: str = "file", root: str | Path | None = None) -> bytes:
    """The bytes of regular file `path`, at most `limit` of them (a file that grows while read is cut there and
    refused, not read on)."""
    with open_regular(path, what=what, limit=limit, root=root) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(f"{what} {path} grew past the {limit:,} bytes allowed for it while it was read")
    return data


MAX_JSON_DEPTH = 512  # Kubernetes objects and model configs nest a few dozen levels; json's C parser gives up at ~1000
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads of text someone else wrote, refused (ValueError) when it nests deeper than `max_depth`, before
    the parser sees it: the C parser's RecursionError at ~1000 levels leaves the interpreter at its recursion
    limit, where a finalizer that the garbage collector happens to run fails (an 'exception ignored' that a test
    harness counts against whatever test runs). The check is C-speed passes over the brackets outside strings:
    each pass removes the innermost pairs, so depth d takes d passes (a 5 MB Kubernetes list: +0.25 s over the
    parse's 0.13 s on this 2-core machine)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    shape = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth + 1):
        inner = shape.replace(b"[]", b"").replace(b"{}", b"")
        if len(inner) == len(shape):
            break
        shape = inner
    depth = deepest = 0
    for byte in shape:  # what no pass could pair: empty for valid JSON; an attacker's brackets otherwise
        depth += 1 if byte in b"[{" else -1
        deepest = max(deepest, depth)
        if deepest > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return json.loads(text)
