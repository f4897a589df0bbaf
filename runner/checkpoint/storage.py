"""The checkpoint volume: room for the next checkpoint, and write errors that retrying cannot fix.

A full, read-only or forbidden volume ends the run with EXIT_STORAGE (the Job's podFailurePolicy fails
the Job: a full disk does not empty itself between attempts) and a message that names the directory,
the room needed and the room left. The room needed is the size of the newest checkpoint, else an
estimate from the model: the saved parameters plus AdamW's two moments per trainable parameter.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch

from jobspec.contract import EXIT_STORAGE
from jobspec.errors import JobspecError
from jobspec.spec.units import human_bytes as gib
from runner.checkpoint import files

MARGIN = 1.02  # the filesystem's own blocks and the small files, on top of the expected bytes
_FULL = {errno.ENOSPC, errno.EDQUOT}
_ANYWHERE = {*_FULL, errno.EROFS}  # errors that always mean the volume, whatever file they name
_FORBIDDEN = {errno.EACCES, errno.EPERM}  # the volume's only when they name a file in the run directory


class StorageError(JobspecError):
    """The checkpoint volume cannot take the next checkpoint (full, read-only, or not writable)."""

    exit_code = EXIT_STORAGE


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (or of its nearest parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def directory_bytes(path: Path) -> int:
    """The bytes of the regular files in `path` (a link to a large file elsewhere is not the checkpoint's)."""
    return sum(files.regular_sizes(Path(path)).values())


def estimate_bytes(model: torch.nn.Module, trainable_only: bool) -> int:
    """A checkpoint's bytes before one exists: the saved parameters (tied ones twice, as the state dict holds
    them) plus AdamW's exp_avg and exp_avg_sq for each trainable one. Sharded parameters count whole."""
    saved = moments = 0
    for _, p in model.named_parameters(remove_duplicate=False):
        size = p.numel() * p.element_size()
        if p.requires_grad or not trainable_only:
            saved += size
        if p.requires_grad:
            moments += 2 * size
    return saved + moments


def no_space(root: Path, need: int | None, free: int) -> str:
    room = f"needs about {gib(need)}, has {gib(free)}" if need else f"{gib(free)} free"
    return (
        f"no space left at {root}: {room}. Free space on the checkpoint volume (remove old runs, lower "
        "checkpoints.keep) or give the run a larger one; the newest complete checkpoint is kept"
    )


def check_space(root: Path, need: int) -> None:
    """StorageError when the volume of `root` has less than `need` bytes (plus MARGIN) free."""
    free = free_bytes(root)
    if free < need * MARGIN:
        raise StorageError(no_space(root, need, free))


def volume_error(exc: BaseException, root: Path) -> OSError | None:
    """The OSError inside `exc` (its causes, or DCP's per-rank failures) that says the checkpoint volume is
    full, read-only, or forbids writing in `root`; None for any other error."""
    stack: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and (e.errno in _ANYWHERE or (e.errno in _FORBIDDEN and _inside(e, root))):
            return e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            stack += [f[0] for f in failures.values() if isinstance(f, tuple) and isinstance(f[0], BaseException)]
    return None


def _inside(err: OSError, root: Path) -> bool:
    if not err.filename:
        return False
    try:
        return Path(os.fsdecode(err.filename)).absolute().is_relative_to(Path(root).absolute())
    except (TypeError, ValueError):
        return False


def describe(err: OSError, root: Path, need: int | None = None) -> str:
    """The user's message for a volume error while writing into `root` (`need`: the bytes it was writing)."""
    where = f" (writing {os.fsdecode(err.filename)})" if err.filename else ""
    if err.errno in _FULL:
        return f"{no_space(root, need, free_bytes(root))}{where}"
    if err.errno == errno.EROFS:
        return f"{root} is on a read-only filesystem{where}: mount the checkpoint volume read-write"
    return (
        f"cannot write to {root}: {err.strerror or 'permission denied'}{where}. The runner's user (uid {os.getuid()}) "
        "needs write access: on Kubernetes the pod's fsGroup, elsewhere chown or chmod the directory"
    )
