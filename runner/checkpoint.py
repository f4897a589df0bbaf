"""Checkpoints: written atomically, found on restart, sharded when the model is.

Layout of `checkpoints.dir`:
    step-<N>/              one complete checkpoint after optimizer step N
        .metadata, *.distcp  model + optimizer via torch.distributed.checkpoint (DCP): every rank
                             writes its shard (FSDP) or its share of the replicated tensors (DDP);
                             DCP reshards on load, so a resume may use another tier or world size
        rng-<rank>.pt        python, numpy, torch and CUDA RNG states of each rank
        meta.json            step, epoch, samples, plan, spec hash, lineage (runner/lineage.py), loss
        spec.yaml            the spec it was trained with: `jobspec export` needs nothing else
        DONE                 written last; a directory without it is ignored and later removed
    .tmp-step-<N>/         a checkpoint being written (same filesystem, so the rename is atomic)

Protocol: rank 0 makes the temp dir; every rank writes its files (fsynced); barrier; rank 0 writes
meta.json, renames the temp dir to step-<N> (an existing complete step-<N> is kept, an incomplete one
replaced), writes DONE, fsyncs the parent and prunes to the last `keep`; barrier. The last good
checkpoint is never touched until a newer one is complete. LoRA runs store the adapters only.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from runner.dist import Control

log = logging.getLogger("jobspec.runner")
DONE = "DONE"
META = "meta.json"
SPEC = "spec.yaml"
_STEP = re.compile(r"^step-(\d+)$")


def is_step_dir(path: Path) -> bool:
    return bool(_STEP.match(path.name))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool) -> dict[str, Any]:
    """{"model": ..., "optim": ...} keyed by plain FQNs (DDP/FSDP wrappers removed; DTensor shards under FSDP).

    LoRA (`trainable_only`): the frozen base is rebuilt from the preset or path, so only the adapters are
    stored. Filtered by name: DCP's `ignore_frozen_params` keeps a tied output head (GPT-2's lm_head).
    """
    options = StateDictOptions(strict=not trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if trainable_only:
        inner = getattr(model, "module", model)  # DDP's wrapper; FSDP2 shards in place
        names = {n for n, p in inner.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in names}
    return {"model": model_sd, "optim": optim_sd}


def complete(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint with its DONE marker, oldest first."""
    root = Path(root)
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _STEP.match(p.name)
        if m and (p / DONE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = complete(root)
    return done[-1][1] if done else None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())


def save(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    *,
    rank: int,
    ctrl: Control,
    keep: int,
    trainable_only: bool = False,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Write checkpoint `step` (collective: every rank calls it); rank 0 adds `files` (name -> bytes) beside
    meta.json. Returns step-<N>'s path."""
    t0 = time.perf_counter()
    root = Path(root)
    tmp, final = root / f".tmp-step-{step}", root / f"step-{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a writer that was killed
        tmp.mkdir()
    ctrl.barrier()
    writer = dcp.FileSystemWriter(tmp, sync_files=True)
    with warnings.catch_warnings():  # DCP warns that one process means one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            _state(model, optimizer, trainable_only),
            storage_writer=writer,
            process_group=ctrl.group,
            no_dist=not dist.is_initialized(),
        )
    with open(tmp / f"rng-{rank}.pt", "wb") as f:
        torch.save(rng_state(), f)
        f.flush()
        os.fsync(f.fileno())
    ctrl.barrier()
    if rank == 0:
        for name, data in (files or {}).items():
            _write_durable(tmp / name, data)
        _write_durable(tmp / META, json.dumps({**meta, "step": step}, indent=1).encode())
        fsync_dir(tmp)
        _publish(tmp, final)
        prune(root, keep)
        log.info("checkpoint %s written in %.1f s", final, time.perf_counter() - t0)
    ctrl.barrier()
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished temp dir into place, then mark it complete."""
    if final.exists():
        if (final / DONE).is_file():  # this step is already saved (e.g. SIGTERM right after a periodic save)
            shutil.rmtree(tmp)
            return
        shutil.rmtree(final)  # an incomplete step-<N> from an older attempt
    os.rename(tmp, final)
    fsync_dir(final.parent)
    _write_durable(final / DONE, b"")
    fsync_dir(final)


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones, incomplete ones and stale temp dirs."""
    done = complete(root)
    newest = done[-1][0] if done else -1
    doomed = [p for _, p in done[:-keep]]
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if p.name.startswith(".tmp-step-") or (m and int(m.group(1)) < newest and not (p / DONE).is_file()):
            doomed.append(p)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)


def load(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    ctrl: Control,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from `path` (collective). Returns meta.json."""
    state = _state(model, optimizer, trainable_only)  # also initialises Adam's state, for DCP to load into
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, process_group=ctrl.group, no_dist=not dist.is_initialized())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=not trainable_only),
    )
    rng_file = path / f"rng-{rank}.pt"
    if not rng_file.is_file():  # more ranks than when it was written: rank 0's stream is the best guess
        log.warning("checkpoint %s has no RNG state for rank %d; using rank 0's", path, rank)
        rng_file = path / "rng-0.pt"
    set_rng_state(torch.load(rng_file, weights_only=True))
    return read_meta(path)
