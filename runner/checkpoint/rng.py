"""The RNG state a checkpoint carries for each rank (`rng-<rank>.pt`): python, numpy, torch and CUDA generators.

Written by torch.save as plain types and tensors only (numpy's key as a list), so that it reads back with
torch.load(weights_only=True): no code runs from it. `read` takes a bounded read of a regular file
(runner/checkpoint/files.py) and then checks the state against the shape `rng_state` writes, so a forged
or foreign file is damage that `verify` reports (and a resume skips), not a traceback in `set_rng_state`.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.checkpoint import files, unpickle

MAX_BYTES = 4 * 2**20  # ~12 KB per rank (5 KB of torch state, 2 x 624 words of Mersenne Twister, 16 B per GPU)
_MT_WORDS = 624
_UINT32 = 2**32
_MAX_DEVICES = 1024


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),  # plain types: loads with weights_only
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def encode(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def read(path: Path) -> dict[str, Any]:
    """The RNG state in `path`; ValueError (why) when it is not one `rng_state` wrote, UnsafeFile/OSError when
    the file is not a regular file of at most MAX_BYTES."""
    data = files.read_bytes(path, MAX_BYTES, "RNG state")
    try:
        state = unpickle.weights_only_load(data)
    except ValueError as err:
        raise ValueError(f"is not an RNG state torch reads safely ({err})") from None
    problem = shape_problem(state)
    if problem:
        raise ValueError(f"is not an RNG state ({problem})")
    return state


def problem(path: Path) -> str | None:
    """Why `path` is not a usable RNG state (naming the file), or None."""
    try:
        read(path)
    except files.UnsafeFile as err:
        return str(err)
    except FileNotFoundError:
        return f"{path.name} is missing"
    except OSError as err:
        return f"{path.name} cannot be read ({err.strerror or err})"
    except ValueError as err:
        return f"{path.name} {err}"
    return None


def _words(value: Any, count: int) -> bool:
    return (
        isinstance(value, tuple | list)
        and len(value) == count
        and all(type(w) is int and 0 <= w < _UINT32 for w in value)
    )


def _byte_tensor(value: Any, numel: int | None) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.uint8
        and value.dim() == 1
        and value.device.type == "cpu"
        and (value.numel() == numel if numel is not None else 0 < value.numel() <= 4096)
    )


def shape_problem(state: Any) -> str | None:
    """What in `state` differs from what `rng_state` writes (the values `set_rng_state` accepts), or None."""
    if not isinstance(state, dict) or set(state) != {"python", "numpy", "torch", "cuda"}:
        return "not a dict of python, numpy, torch and cuda states"
    py = state["python"]
    if not (
        isinstance(py, tuple | list)
        and len(py) == 3
        and py[0] == 3
        and type(py[0]) is int
        and _words(py[1], _MT_WORDS + 1)
        and (py[2] is None or type(py[2]) is float)
    ):
        return "its python state is not random.getstate()'s"
    npy = state["numpy"]
    if not (
        isinstance(npy, tuple | list)
        and len(npy) == 5
        and npy[0] == "MT19937"
        and _words(npy[1], _MT_WORDS)
        and type(npy[2]) is int
        and 0 <= npy[2] <= _MT_WORDS
        and type(npy[3]) is int
        and npy[3] in (0, 1)
        and type(npy[4]) is float
    ):
        return "its numpy state is not numpy.random.get_state()'s"
    if not _byte_tensor(state["torch"], torch.get_rng_state().numel()):
        return "its torch state is not torch.get_rng_state()'s"
    cuda = state["cuda"]
    if not (isinstance(cuda, list) and len(cuda) <= _MAX_DEVICES and all(_byte_tensor(t, None) for t in cuda)):
        return "its cuda state is not torch.cuda.get_rng_state_all()'s"
    return None
