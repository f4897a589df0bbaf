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
import operator
import os
import re
from itertools import accumulate, count
from pathlib import Path
from typing import Any, BinaryIO

from jobspec.errors import ConfigError
from jobspec.shared_dir import Unsafe, open_fd


def inside(path: Path, root: Path, what: str) -> Path:
    """`path` with its links resolved, which must stay under `root` (resolved too); ConfigError otherwise."""
    real, top = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if real != top and top not in real.parents:
        raise ConfigError(f"{what} {path} links to {real}, outside {top}: refusing a link out of the directory")
    return real


def open_regular(path: str | Path, *, what: str = "file", limit: int | None = None,
                 root: str | Path | None = None, follow: bool = True) -> BinaryIO:  # fmt: skip
    """`path` opened for binary reading once it is known to be a regular file (of at most `limit` bytes,
    resolving under `root` when given; not through a link in its last component unless `follow`). Opened by
    jobspec.shared_dir.open_fd: never blocking on a FIFO, checked on the descriptor."""
    path = Path(path)
    if root is not None:
        inside(path, Path(root), what)
    try:
        fd = open_fd(path, os.O_RDONLY, follow=follow)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except Unsafe as err:
        raise ConfigError(f"{what} {path} is {err.detail.removeprefix('is ')}: replace it with the file") from None
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be opened: {err.strerror or err}") from None
    f = os.fdopen(fd, "rb")
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise ConfigError(f"{what} {path} is {size:,} bytes, more than the {limit:,} allowed for it")
        return f
    except BaseException:
        f.close()
        raise


def read_bounded(path: str | Path, limit: int, *, what: str = "file", root: str | Path | None = None,
                 follow: bool = True) -> bytes:  # fmt: skip
    """The bytes of regular file `path`, at most `limit` of them (a file that grows while read is cut there and
    refused, not read on)."""
    with open_regular(path, what=what, limit=limit, root=root, follow=follow) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(f"{what} {path} grew past the {limit:,} bytes allowed for it while it was read")
    return data


MAX_JSON_DEPTH = 512  # Kubernetes objects and model configs nest a few dozen levels; json's C parser gives up at ~1000
# Linear on any input: escapes first (a backslash and the byte after it, left to right: in JSON they occur only inside
# strings), then strings, which hold no quote once their escapes are gone. One pattern for both backtracked on an
# unterminated string of escaped quotes, quadratically (32 KB took 4.5 s).
_JSON_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_JSON_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


def json_loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads of text someone else wrote, refused (ValueError) when it nests deeper than `max_depth`, before
    the parser sees it: the C parser's RecursionError at ~1000 levels leaves the interpreter at its recursion
    limit, where a finalizer that the garbage collector happens to run fails (an 'exception ignored' that a test
    harness counts against whatever test runs). The check is linear and C-speed: escapes, then strings, then every
    byte but the brackets are removed, a few levels of innermost pairs dropped, and the running depth of what is
    left summed (its largest value is the deepest any parser would recurse, valid JSON or not). Removing
    innermost pairs keeps every bracket's depth relative to the others, so the maximum is unchanged."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    shape = _JSON_STRING.sub(b"", _JSON_ESCAPE.sub(b"", raw)).translate(None, _NOT_BRACKETS)
    for _ in range(8):  # the innermost pairs, a few levels (all of most files' brackets) at memcpy speed
        inner = shape.replace(b"[]", b"").replace(b"{}", b"")
        if len(inner) == len(shape):
            break
        shape = inner
    # What is left, in one pass of C iterators: 2 for an opening bracket, 0 for a closing one, so that after k
    # brackets the depth is their sum minus k. Linear whatever the nesting (passes alone took d passes for depth d).
    steps = shape.translate(_DEPTH_STEP)
    if steps and max(map(operator.sub, accumulate(steps), count(1))) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return json.loads(text)
