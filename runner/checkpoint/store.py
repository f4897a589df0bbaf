"""Checkpoints: written atomically, found on restart, sharded when the model is.

Layout of `checkpoints.dir`:
    step-<N>/              one complete checkpoint after optimizer step N
        .metadata, *.distcp  model + optimizer via torch.distributed.checkpoint (DCP): every rank
                             writes its shard (FSDP) or its share of the replicated tensors (DDP);
                             DCP reshards on load, so a resume may use another tier or world size
        rng-<rank>.pt        python, numpy, torch and CUDA RNG states of each rank
        meta.json            step, epoch, samples, plan, spec hash, lineage (runner/checkpoint/lineage.py), loss
        spec.yaml            the spec it was trained with: `jobspec export` needs nothing else
        manifest.json        every file above with its size and CRC-32 (runner/checkpoint/manifest.py)
        DONE                 written last; a directory without it is ignored and later removed
    .tmp-step-<N>/         a checkpoint being written (same filesystem, so the rename is atomic)
    step-<N>.damaged/      a checkpoint that failed verification, moved aside by a resume (never deleted)

Protocol: rank 0 checks the room on the volume and makes the temp dir; every rank writes its files
(fsynced) and hashes them; rank 0 writes meta.json and the manifest, renames the temp dir to step-<N>
(an existing intact step-<N> is kept, an incomplete or damaged one replaced), writes DONE, fsyncs the
parent and prunes to the last `keep`. Each phase ends in an all-reduce of "did a write fail": a full,
read-only or forbidden volume on any rank makes every rank raise StorageError (exit 74) after rank 0
removed the temp dir; a device out-of-memory error on any rank (DCP stages and plans with allocations:
`is_oom`, the caller's test) makes every rank raise CheckpointOOM the same way, and the caller decides
(runner/train/recipe.py: release memory and write again, else skip a periodic checkpoint). The last good
checkpoint is never touched until a newer one is complete. LoRA runs store the adapters only.

Resume (`resume_point`): rank 0 verifies the newest complete checkpoint (runner/checkpoint/verify.py: DONE,
meta.json's step, the manifest's sizes and checksums, then the pickles it holds: `.metadata` through a restricted
unpickler and the shards' byte items and RNG states through torch.load(weights_only=True),
runner/checkpoint/unpickle.py and rng.py; then that every rank's shard file holds this step and the optimizer's
step counters add up to meta.json's); a damaged one is logged, moved aside once an intact one is found, and the
next older one tried. Complete checkpoints but none intact: DamagedCheckpoint (exit 2).

Untrusted volume: no file of a checkpoint runs code when read, every one is opened as a regular file
(no link, FIFO or device: runner/checkpoint/files.py) and read within a bound, and a forged file is
damage like any other. With JOBSPEC_CHECKPOINT_KEY set the manifest is signed (jobspec/shared_dir/signing.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from jobspec import shared_dir
from jobspec.shared_dir import signing
from runner import internals
from runner.checkpoint import files, manifest, rng, storage, unpickle
from runner.checkpoint.rng import rng_state, set_rng_state
from runner.checkpoint.steps import DONE, STEP_NAME, complete, latest
from runner.checkpoint.steps import is_step_dir as is_step_dir  # re-exported: callers name store.is_step_dir
from runner.checkpoint.storage import StorageError
from runner.checkpoint.verify import DCP_METADATA as DCP_METADATA  # re-exported: callers name store.DCP_METADATA
from runner.checkpoint.verify import (
    FORMAT,
    META,
    OPTIMIZER_STEPS,
    RANK_STEP,
    STEP_ITEM,
    DamagedCheckpoint,
    newest_intact,
    optimizer_steps,
    read_meta,
    verify,
)
from runner.checkpoint.verify import SPEC as SPEC  # re-exported: callers name store.SPEC
from runner.dist import Control

log = logging.getLogger("jobspec.runner")
RANK_ITEMS = "rank_items"  # {"jobspec": {"rank_items": {"<rank>": {name: value}}}}: a rank's own items (`save`)
GUARD_S = 0.5  # the most seconds a shard is written between two fence checks (the fence reads the lease file)
T = TypeVar("T")


class CheckpointOOM(Exception):
    """Raised on every rank: a rank ran out of device memory while the checkpoint was written; its temp dir is gone
    and the previous checkpoint untouched."""


def _oom_in(exc: BaseException, is_oom: Callable[[BaseException], bool]) -> bool:
    """`is_oom` of the error, or of any rank's error DCP wrapped in a CheckpointException (its `failures`)."""
    if is_oom(exc):
        return True
    failures = getattr(exc, "failures", None)
    return isinstance(failures, dict) and any(
        isinstance(f, tuple) and f and isinstance(f[0], BaseException) and is_oom(f[0]) for f in failures.values()
    )




def fsync_dir(path: Path) -> None:
    shared_dir.fsync_dir(path)


def _write_durable(path: Path, data: bytes, fence: Callable[[], None] | None = None) -> None:
    """`data` as the file `path`, fsynced: a temporary created exclusively, renamed over the name (a link planted
    there is replaced, never written through: jobspec.shared_dir). `fence` runs right before the rename, after the
    fsync: a rank frozen while writing (an fsync takes milliseconds) raises there on waking, and the temporary goes."""

    def ready() -> bool:
        if fence is not None:
            fence()
        return True

    shared_dir.write_atomic(path, data, ready=ready)


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
    groups = [{**g, "lr": float(g["lr"])} if torch.is_tensor(g.get("lr")) else g for g in optim_sd["param_groups"]]
    plain = _plain_states(optim_sd.get("state") or {})  # torchao's lr is a 0-d tensor: saved as any other's float
    return {"model": model_sd, "optim": {**optim_sd, "state": plain, "param_groups": groups}}


LOW_BIT = "_low_bit"  # a state dict's {(parameter, key): the optimizer's own 8-bit state} (never written)


def _plain_states(states: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The optimizer state by parameter, each 8-bit moment (training.optimizer adamw_8bit) as fp32 values on the host
    (runner/internals/lowbit.py): what DCP writes and reshards like any state shaped as its parameter. New dicts:
    the optimizer's own keep their 8-bit tensors, listed under LOW_BIT for `load` to write the values read into."""
    out: dict[str, Any] = {}
    low: dict[tuple[str, str], torch.Tensor] = {}
    for name, entry in states.items():
        out[name] = dict(entry)
        for key, value in entry.items():
            if internals.is_quantized(value):
                low[(name, key)] = value
                out[name][key] = internals.dequantized(value)
    return {**out, LOW_BIT: low} if low else out


def _low_bit_back(states: dict[str, Any], low: dict[tuple[str, str], torch.Tensor]) -> None:
    """After DCP has read the fp32 values of `_plain_states` into `states`: each written into the optimizer's own
    8-bit state in `low` (the same codes and scales it was saved with, on the same layout), which takes its place."""
    for (name, key), target in low.items():
        internals.requantize_into(target, states[name][key])
        states[name][key] = target


def resume_point(root: str | Path, *, rank: int, ctrl: Control) -> Path | None:
    """The checkpoint every rank resumes from (collective): rank 0 verifies and moves damaged ones aside,
    the others take its answer, so all ranks load the same step. None: start at step 0."""
    root, found, err = Path(root), -1.0, None  # -1: none; -2: complete ones, none intact
    signing.key()  # a malformed key stops every rank here, before rank 0 alone could meet it in `verify`
    if rank == 0:
        try:
            path = newest_intact(root, quarantine=True)
            found = -1.0 if path is None else float(STEP_NAME.match(path.name).group(1))  # type: ignore[union-attr]
        except DamagedCheckpoint as exc:
            found, err = -2.0, exc
    agreed = ctrl.all_reduce([found if rank == 0 else -3.0], "max")[0]
    if agreed == -2:
        raise err or DamagedCheckpoint(f"no intact checkpoint in {root} (rank 0's log names the damage)")
    return None if agreed == -1 else root / f"step-{int(agreed)}"


def expected_bytes(root: Path, model: torch.nn.Module, trainable_only: bool) -> int:
    """The bytes the next checkpoint will take: the newest complete one's, else the model's estimate."""
    newest = latest(root)
    return storage.directory_bytes(newest) if newest else storage.estimate_bytes(model, trainable_only)


def ensure_space(root: str | Path, model: torch.nn.Module, *, rank: int, ctrl: Control,
                 trainable_only: bool = False) -> None:  # fmt: skip
    """At start (collective): StorageError on every rank when the volume cannot hold the next checkpoint."""
    root = Path(root)
    _Phase(ctrl, rank, root, None).run(
        lambda: storage.check_space(root, expected_bytes(root, model, trainable_only)) if rank == 0 else None
    )


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
    fence: Callable[[], None] = lambda: None,
    attempt: str = "",
    is_oom: Callable[[BaseException], bool] = lambda _exc: False,
    rank_items: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint `step` (collective: every rank calls it); rank 0 adds `files` (name -> bytes) beside
    meta.json. Returns step-<N>'s path; StorageError on every rank when the volume cannot take it, CheckpointOOM
    on every rank when `is_oom` says a rank's error was the device running out of memory.

    `fence` runs on every rank before each phase, and on rank 0 right before the rename that publishes: it raises
    when this rank's gang has moved on without it (a rank frozen mid-save that wakes up later). `attempt` (the
    run's lease holder) names the temp dir: a woken rank of an earlier attempt can only write into its own
    attempt's temp dir, which no later attempt publishes and the next prune removes. `rank_items`: this rank's own
    items (plain tensors, strings), stored in its own shard as `jobspec.rank_items.<rank>.<name>` and handed back by
    `load` on the same rank (GRPO's batch in the middle of its num_iterations steps: runner/rl/rollout.py)."""
    t0 = time.perf_counter()
    root = Path(root)
    tmp, final = temp_dir(root, step, attempt), root / f"step-{step}"
    phase = _Phase(ctrl, rank, root, tmp, fence, is_oom)
    phase.need = phase.run(lambda: _prepare(root, tmp, expected_bytes(root, model, trainable_only)) if rank == 0 else 0)
    state = phase.run(lambda: _state(model, optimizer, trainable_only))  # 8-bit moments: fp32, one at a time
    state["optim"]["state"].pop(LOW_BIT, None)
    state[STEP_ITEM[0]] = {STEP_ITEM[1]: step, RANK_STEP: {str(rank): step}}  # the last: in this rank's own file
    if rank_items:
        state[STEP_ITEM[0]][RANK_ITEMS] = {str(rank): rank_items}
    entries = phase.run(lambda: _write_rank_files(tmp, state, rank, ctrl, fence))
    hashed = {name: e for part in ctrl.all_gather_object(entries) for name, e in part.items()}
    if rank == 0:
        meta = {**meta, "step": step, "format": FORMAT, OPTIMIZER_STEPS: optimizer_steps(state["optim"])}
        phase.run(lambda: _finish(tmp, final, step, meta, files or {}, hashed, keep, fence))
        log.info("checkpoint %s written in %.1f s", final, time.perf_counter() - t0)
    else:
        phase.run(lambda: None)
    return final


def temp_dir(root: Path, step: int, attempt: str) -> Path:
    """Where `save` writes step `step` of the attempt `attempt` before it publishes it."""
    return root / f".tmp-step-{step}{'-' + attempt[:12] if attempt else ''}"


class _Phase:
    """One phase of the save protocol on every rank: run this rank's part, then agree (all-reduce) whether a
    volume error hit any rank; if so every rank raises StorageError after rank 0 removed the temp dir. The
    all-reduce is also the barrier between phases."""

    def __init__(
        self, ctrl: Control, rank: int, root: Path, tmp: Path | None, fence: Callable[[], None] = lambda: None,
        is_oom: Callable[[BaseException], bool] = lambda _exc: False,
    ) -> None:
        self.ctrl, self.rank, self.root, self.tmp, self.fence = ctrl, rank, root, tmp, fence
        self.is_oom = is_oom
        self.need: int | None = None  # the checkpoint's expected bytes, for a "no space left" message

    def run(self, part: Callable[[], T]) -> T:
        problem: str | OSError | None = None
        oom = ""
        result = None
        self.fence()  # outside the agreement: a superseded rank leaves, the live ones never wait for it
        try:
            result = part()
        except StorageError as err:  # the pre-check
            problem = str(err)
        except (Exception, CheckpointException) as exc:  # CheckpointException (DCP) is a BaseException
            if _oom_in(exc, self.is_oom):
                oom = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
            else:
                problem = storage.volume_error(exc, self.root)
                if problem is None:
                    raise
        failed, ran_out = self.ctrl.all_reduce([float(problem is not None), float(bool(oom))], "max")
        if failed or ran_out:
            if self.rank == 0 and self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)  # the partial checkpoint; the previous one stays
            if ran_out and not failed:
                raise CheckpointOOM(oom or "out of memory writing the checkpoint on another rank (see its log)")
            if isinstance(problem, OSError):  # described after the cleanup: the free space it reports is real
                problem = storage.describe(problem, self.root, self.need)
            raise StorageError(problem or f"checkpoint write to {self.root} failed on another rank (see its log)")
        return result  # type: ignore[return-value]


def _clear(path: Path) -> None:
    """Remove what is at `path`: a directory's tree, or the name itself (a link is removed, never followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _prepare(root: Path, tmp: Path, need: int) -> int:
    """Rank 0: the temp dir, once the volume has room for `need` bytes (returned)."""
    root.mkdir(parents=True, exist_ok=True)
    _clear(tmp)  # left by a writer that was killed (or a name planted there)
    storage.check_space(root, need)
    tmp.mkdir()
    return need


def _write_rank_files(tmp: Path, state: dict[str, Any], rank: int, ctrl: Control,
                      fence: Callable[[], None] = lambda: None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """This rank's DCP shards and RNG state, fsynced; returns their manifest entries (hashed while cached). `fence`
    runs before each file and, at most every GUARD_S, before a write into a shard (`throttled`): a rank frozen
    in the middle of its shard stops writing once it wakes."""
    tmp.mkdir(parents=True, exist_ok=True)  # rank 0 made it; a node's own run dir (object store: remote.py) not
    writer = unpickle.SafeWriter(tmp, throttled(fence, GUARD_S))  # created exclusively, never through a link
    with warnings.catch_warnings():  # DCP warns that one process means one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.save(state, storage_writer=writer, process_group=ctrl.group, no_dist=not dist.is_initialized())
        except BaseException:
            if writer.stopped is not None:  # the fence's reason, not the errors DCP and torch.save wrapped it in
                raise writer.stopped from None
            raise
    fence()
    _write_durable(tmp / f"rng-{rank}.pt", rng.encode(rng_state()), fence)  # fenced again before its rename
    mine = [p for p in tmp.iterdir() if p.name.startswith(f"__{rank}_") or p.name == f"rng-{rank}.pt"]
    return manifest.hash_files(mine)


def throttled(check: Callable[[], None], seconds: float) -> Callable[[], None]:
    """`check`, run when `seconds` have passed since it last ran (or never ran): cheap enough to call before every
    write, and a process frozen for longer than `seconds` runs it on its first call after waking."""
    last = -math.inf

    def guard() -> None:
        nonlocal last
        if time.monotonic() - last >= seconds:
            check()
            last = time.monotonic()

    return guard


def _finish(tmp: Path, final: Path, step: int, meta: dict[str, Any], files: dict[str, bytes],
            hashed: dict[str, dict[str, Any]], keep: int, fence: Callable[[], None]) -> None:  # fmt: skip
    """Rank 0: the small files and the manifest (hashing what no rank hashed), then publish and prune."""
    for name, data in files.items():
        _write_durable(tmp / name, data, fence)
    _write_durable(tmp / META, json.dumps(meta, indent=1).encode(), fence)
    _write_durable(tmp / manifest.MANIFEST, manifest.write(tmp, step, hashed, skip=(DONE,)), fence)
    fsync_dir(tmp)
    fence()  # the last moment a rank 0 frozen since the agreement can find that its gang moved on
    _publish(tmp, final)
    prune(final.parent, keep)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished temp dir into place, then mark it complete."""
    if os.path.lexists(final):
        if verify(final) is None:  # this step is already saved (e.g. SIGTERM right after a periodic save)
            shutil.rmtree(tmp)
            return
        _clear(final)  # an incomplete or damaged step-<N> from an older attempt, or a name planted there
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
        m = STEP_NAME.match(p.name)
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
    """Restore model, optimizer and this rank's RNG from `path` (collective). Returns meta.json, with this rank's
    `rank_items` of `save` under RANK_ITEMS where it stored any.

    DCP reads through unpickle.SafeReader/SafeLoadPlanner (no pickle runs code, regular files only). A failure
    here, after `verify` passed (a file changed since, or tensors that do not fit the model), is
    DamagedCheckpoint: exit 2 naming the checkpoint, never a traceback."""
    state = _state(model, optimizer, trainable_only)  # also initialises Adam's state, for DCP to load into
    low_bit = state["optim"]["state"].pop(LOW_BIT, {})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            reader = unpickle.reader(path)
        except (OSError, ValueError) as err:
            raise _unloadable(path, str(err) if not isinstance(err, FileNotFoundError) else "no .metadata") from None
        mine = _rank_items(reader.metadata, rank)
        if mine:
            state[STEP_ITEM[0]] = {RANK_ITEMS: {str(rank): mine}}
        other = _other_optimizer(reader.metadata, optimizer)
        if other:  # a forced resume across training.optimizer (lineage.py refuses it otherwise)
            log.warning("checkpoint %s holds %s's state, not this run's optimizer's: its weights resume, the optimizer "
                        "starts afresh", path, other)  # fmt: skip
            del state["optim"]
        try:
            dcp.load(state, storage_reader=reader, planner=unpickle.SafeLoadPlanner(), process_group=ctrl.group,
                     no_dist=not dist.is_initialized())  # fmt: skip
        except (Exception, CheckpointException) as exc:  # CheckpointException (DCP) is a BaseException
            raise _unloadable(path, unpickle.load_failure(exc)) from None
    options = StateDictOptions(strict=not trainable_only)
    if other:
        set_model_state_dict(model, state["model"], options=options)
    else:
        _low_bit_back(state["optim"]["state"], low_bit)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)  # fmt: skip
    internals.keep_tensor_lr(optimizer)  # the groups' lr is saved as a float
    rng_file = path / f"rng-{rank}.pt"
    if not os.path.lexists(rng_file):  # more ranks than when it was written: rank 0's stream is the best guess
        log.warning("checkpoint %s has no RNG state for rank %d; using rank 0's", path, rank)
        rng_file = path / "rng-0.pt"
    try:
        set_rng_state(rng.read(rng_file))
    except (OSError, ValueError) as err:
        raise _unloadable(path, rng.problem(rng_file) or f"{rng_file.name}: {err}") from None
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as err:
        raise _unloadable(path, str(err) if isinstance(err, files.UnsafeFile) else f"{META}: {err}") from None
    return {**meta, RANK_ITEMS: mine} if mine else meta


def _rank_items(metadata: Any, rank: int) -> dict[str, Any]:
    """The template `load` reads rank `rank`'s own items into (`save`'s `rank_items`): an empty tensor of each stored
    tensor's size and dtype, a placeholder for each other value; {} when it stored none."""
    prefix = f"{STEP_ITEM[0]}.{RANK_ITEMS}.{rank}."
    out: dict[str, Any] = {}
    for fqn, item in (getattr(metadata, "state_dict_metadata", None) or {}).items():
        if fqn.startswith(prefix) and "." not in fqn[len(prefix) :]:
            name = fqn[len(prefix) :]
            if isinstance(item, TensorStorageMetadata):
                out[name] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
            else:
                out[name] = ""
    return out


def _other_optimizer(metadata: Any, optimizer: torch.optim.Optimizer) -> str:
    """The kind of optimizer whose state a checkpoint holds ("AdamW" or "SGD") when it is not `optimizer`'s, else "":
    told by the hyper-parameter only one of them has in its parameter groups (SGD's momentum, Adam's betas)."""
    sgd = isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.SGD)
    own = "momentum" if sgd else "betas"
    if f"optim.param_groups.0.{own}" in (getattr(metadata, "state_dict_metadata", None) or {}):
        return ""
    return "AdamW" if sgd else "SGD"


def _unloadable(path: Path, why: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(
        f"checkpoint {path} cannot be loaded ({why}). It changed after it was verified, or does not fit this "
        f"model: move {path} out of {path.parent} to resume from the one before it"
    )
