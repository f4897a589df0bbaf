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

Resume (`resume_point`): rank 0 verifies the newest complete checkpoint (`verify`: DONE, meta.json's
step, the manifest's sizes and checksums, then the pickles it holds: `.metadata` through a restricted
unpickler and the shards' byte items and RNG states through torch.load(weights_only=True),
runner/checkpoint/unpickle.py and rng.py; then that every rank's shard file holds this step and the optimizer's
step counters add up to meta.json's: `_shards_problem`); a damaged one is logged, moved aside once an intact one is
found, and the next older one tried. Complete checkpoints but none intact: DamagedCheckpoint (exit 2).

Untrusted volume: no file of a checkpoint runs code when read, every one is opened as a regular file
(no link, FIFO or device: runner/checkpoint/files.py) and read within a bound, and a forged file is
damage like any other. With JOBSPEC_CHECKPOINT_KEY set the manifest is signed (jobspec/shared_dir/signing.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
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
from jobspec.errors import ConfigError
from jobspec.shared_dir import signing
from runner import internals
from runner.checkpoint import files, manifest, rng, storage, unpickle
from runner.checkpoint.rng import rng_state, set_rng_state
from runner.checkpoint.steps import DONE, STEP_NAME, complete, latest
from runner.checkpoint.steps import is_step_dir as is_step_dir  # re-exported: callers name store.is_step_dir
from runner.checkpoint.storage import StorageError
from runner.dist import Control

log = logging.getLogger("jobspec.runner")
META = "meta.json"
SPEC = "spec.yaml"
DCP_METADATA = unpickle.METADATA
META_MAX_BYTES = 16 * 2**20  # step, plan, lineage, loss: a few KB
_RNG = re.compile(r"^rng-\d+\.pt$")
FORMAT = 4  # meta.json "format": 2 and later have a manifest.json (a missing one is damage, not age); 3 and later
# hold their own step in the shards (STEP_ITEM): shards of another step under this one's manifest are damage; 4 and
# later hold it in every rank's shard file (RANK_STEP) and meta.json holds the sum of the optimizer's step counters
STEP_ITEM = ("jobspec", "step")  # {"jobspec": {"step": N}} beside "model" and "optim": DCP's item "jobspec.step"
RANK_STEP = "rank_step"  # {"jobspec": {"rank_step": {"<rank>": N}}}: item "jobspec.rank_step.<rank>", its own file
RANK_ITEMS = "rank_items"  # {"jobspec": {"rank_items": {"<rank>": {name: value}}}}: a rank's own items (`save`)
OPTIMIZER_STEPS = "optimizer_steps"  # meta.json: the sum of every parameter's optimizer step counter at save
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


class DamagedCheckpoint(ConfigError):
    """Complete checkpoints exist but none verifies: resuming one would train on broken state."""


def fsync_dir(path: Path) -> None:
    shared_dir.fsync_dir(path)


def _write_durable(path: Path, data: bytes) -> None:
    """`data` as the file `path`, fsynced: a temporary created exclusively, renamed over the name (a link planted
    there is replaced, never written through: jobspec.shared_dir)."""
    shared_dir.write_atomic(path, data)


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


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json of checkpoint `path` (a bounded read of a regular file); OSError or ValueError otherwise."""
    return files.read_json(path / META, META_MAX_BYTES, "checkpoint's meta.json")


def verify(path: str | Path, *, full: bool = False) -> str | None:
    """Why checkpoint `path` (a step-N directory) cannot be trusted, or None when it is intact.

    Checks the DONE marker, that meta.json reads and names the directory's step, every file against
    manifest.json (runner/checkpoint/manifest.py: sizes, checksums; files over manifest.FULL_CHECK_BYTES by sampled
    blocks unless `full`; signed when JOBSPEC_CHECKPOINT_KEY is set), then the pickles (`_pickles_problem`). A
    checkpoint from before manifests (meta.json without "format") is checked for its files' presence and
    its pickles."""
    path = Path(path)
    m = STEP_NAME.match(path.name)
    if m is None:
        return f"{path.name} is not a step-N checkpoint directory"
    if path.is_symlink():
        return f"{path.name} is a symbolic link, not a directory of its own (a checkpoint is never written as one)"
    if not (path / DONE).is_file():
        return f"no {DONE} marker (its writer stopped before finishing)"
    step = int(m.group(1))
    try:
        meta = read_meta(path)
    except FileNotFoundError:
        return f"{META} is missing"
    except files.UnsafeFile as err:
        return str(err)
    except (OSError, ValueError) as err:
        return f"{META} is unreadable ({err})"
    if not isinstance(meta, dict) or meta.get("step") != step:
        said = meta.get("step") if isinstance(meta, dict) else None
        return f"{META} says step {_short(said)}, but the directory is step-{step}"
    if not all(meta.get(k) is None or isinstance(meta[k], dict) for k in ("plan", "lineage")):
        return f"{META} is malformed (its plan or lineage is not a table)"
    required = (META, DCP_METADATA, "rng-0.pt")
    written_as = meta.get("format", 1)
    if type(written_as) is int and written_as < FORMAT and not os.path.lexists(path / manifest.MANIFEST):
        if signing.key() is not None:  # nothing to authenticate: a forger's easiest way round the MAC
            return f"{manifest.MANIFEST} is missing, but {signing.KEY_ENV} is set (signed checkpoints have one)"
        problems = [files.problem(path / name) for name in required]
        if any(problems):
            return next(p for p in problems if p)
    else:
        problem = manifest.check(path, step, required=required, full=full)
        if problem:
            return problem
    known = type(written_as) is int
    return _pickles_problem(path, step, known and written_as >= 3, meta if known and written_as >= 4 else None)


def _pickles_problem(path: Path, step: int, holds_step: bool, meta: dict[str, Any] | None = None) -> str | None:
    """Why the pickles of checkpoint `path` cannot be read without trusting them: `.metadata` (restricted
    unpickler, checked against the shards), every item in the shards (a torch.save zip that inflates
    nothing; the non-tensor ones read with weights_only=True) and every rank's RNG state (weights_only,
    checked for shape). The tensors' values are DCP's to read, with weights_only=True, at load. Then the step the
    shards say they hold (STEP_ITEM, `holds_step`: written since FORMAT 3) must be the directory's `step`, and with
    `meta` (meta.json, FORMAT 4 and later) every shard file's own (`_shards_problem`)."""
    try:
        metadata = unpickle.read_metadata(path)
    except FileNotFoundError:
        return f"{DCP_METADATA} is missing"
    except files.UnsafeFile as err:
        return str(err)
    except OSError as err:
        return f"{DCP_METADATA} cannot be read ({err.strerror or err})"
    except ValueError as err:
        return str(err)
    problem = unpickle.items_problem(path, metadata) or _step_problem(path, metadata, step, holds_step)
    if problem is None and meta is not None:
        problem = _shards_problem(path, step, meta, metadata)
    if problem:
        return problem
    for name in sorted(n for n in os.listdir(path) if _RNG.match(n)):
        problem = rng.problem(path / name)
        if problem:
            return problem
    return None


def _step_problem(path: Path, metadata: Any, step: int, holds_step: bool) -> str | None:
    """Why the shards of checkpoint `path` are not those of step `step` (their STEP_ITEM says another), or None."""
    fqn = ".".join(STEP_ITEM)
    try:
        held = unpickle.read_bytes_item(path, metadata, fqn)
    except KeyError:
        return f"the shards do not say which step they hold ({META} says format 3 or later)" if holds_step else None
    except (OSError, ValueError) as err:
        return f"the shards' step cannot be read ({err})"
    if type(held) is not int or held != step:
        return f"the shards hold step {_short(held)}, not step {step} (shards of another checkpoint under this one)"
    return None


def _shards_problem(path: Path, step: int, meta: dict[str, Any], metadata: Any = None) -> str | None:
    """Why the shard files of checkpoint `path` (FORMAT 4 or later, its pickles already checked) are not all of step
    `step`: each file must hold its writer's RANK_STEP item saying `step`, and the optimizer's step counters stored
    across the files must add up to meta.json's OPTIMIZER_STEPS. One rank's file of an older step, copied under this
    step's .metadata and manifest, fails both (a forger who can also rewrite the counters needs the key: the
    manifest's MAC, jobspec/shared_dir/signing.py). `metadata`: the checkpoint's .metadata, already read and checked
    (`_pickles_problem`); read here when not given."""
    metadata = unpickle.read_metadata(path) if metadata is None else metadata
    prefix = f"{STEP_ITEM[0]}.{RANK_STEP}."
    held: dict[str, Any] = {}
    counters: list[Any] = []
    files_with_items: set[str] = set()
    for index, info in (metadata.storage_data or {}).items():
        files_with_items.add(info.relative_path)
        if index.fqn.startswith(prefix):
            held[info.relative_path] = index.fqn
        elif index.fqn.startswith("optim.state.") and index.fqn.endswith(".step"):
            counters.append((index, info))
    for name in sorted(files_with_items):
        fqn = held.get(name)
        if fqn is None:
            return f"{name} does not say which step it holds ({META} says format {FORMAT} or later)"
        try:
            value = unpickle.read_bytes_item(path, metadata, fqn)
        except (KeyError, OSError, ValueError) as err:
            return f"the step of {name} cannot be read ({err})"
        if type(value) is not int or value != step:
            return f"{name} holds step {_short(value)}, not step {step} (a shard of another checkpoint under this one)"
    want = meta.get(OPTIMIZER_STEPS)
    if type(want) is not int:
        return f"{META} has no integer {OPTIMIZER_STEPS} (format {FORMAT} or later always has one)"
    try:
        total = sum(_counter(path, index, info) for index, info in counters)
    except (OSError, ValueError) as err:
        return f"the optimizer's step counters cannot be read ({err})"
    if total != want:
        return (f"the optimizer's step counters in the shards add up to {total}, {META} says {want} "
                "(shards of another checkpoint under this one)")  # fmt: skip
    return None


def _counter(path: Path, index: Any, info: Any) -> int:
    """One optimizer step counter (a 0-d tensor item) read from the shards, bounded and with weights_only."""
    with files.open_regular(path / info.relative_path) as f:
        f.seek(info.offset)
        if info.length > 2**16:
            raise ValueError(f"{index.fqn} takes {info.length} bytes (a step counter takes a few hundred)")
        value = unpickle.weights_only_load(files.read_at_most(f, info.length))
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not torch.isfinite(value).all():
        raise ValueError(f"{index.fqn} is not a finite step counter")
    number = float(value.reshape(()).item())
    if not number.is_integer() or not 0 <= number < 2**53:
        raise ValueError(f"{index.fqn} is {number}, not a step count")
    return int(number)


def optimizer_steps(optim_state: dict[str, Any]) -> int:
    """The sum of every parameter's optimizer step counter in an optimizer state dict (Adam's "step"): recorded in
    meta.json at save, checked against the shards at resume (`_shards_problem`)."""
    total = 0
    for entry in (optim_state.get("state") or {}).values():
        step = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(step, torch.Tensor):
            local = step.to_local() if hasattr(step, "to_local") else step  # a replicated DTensor holds it whole
            total += int(local.detach().reshape(()).item()) if local.numel() == 1 else 0
        elif isinstance(step, int | float):
            total += int(step)
    return total


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def newest_intact(root: str | Path, *, quarantine: bool = False) -> Path | None:
    """The newest complete checkpoint that verifies, or None when there is no complete one. Each newer
    damaged one is logged with its problem (and, with `quarantine`, renamed to step-N.damaged so that no
    later save or prune mistakes it for a good one). DamagedCheckpoint when none verifies."""
    root, damaged = Path(root), []
    for _, path in reversed(complete(root)):
        problem = verify(path)
        if problem is None:
            for bad, why in damaged:
                aside = _move_aside(bad) if quarantine else bad
                log.warning("checkpoint %s is damaged (%s): skipped%s; resuming from %s", bad, why,
                            f", moved to {aside.name}" if aside != bad else "", path.name)  # fmt: skip
            return path
        damaged.append((path, problem))
    if damaged:
        listed = "; ".join(f"{p.name}: {why}" for p, why in damaged)
        raise DamagedCheckpoint(
            f"no intact checkpoint in {root} ({listed}). Restore the damaged files from a copy, or start over "
            f"from step 0 by moving the step-N directories out of {root}"
        )
    return None


def _move_aside(path: Path) -> Path:
    aside, n = path.with_name(f"{path.name}.damaged"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{n}")
    try:
        os.rename(path, aside)
    except OSError as err:  # a read-only volume: the save that follows reports it
        log.warning("cannot move the damaged checkpoint %s aside: %s", path, err)
        return path
    return aside


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
    _write_durable(tmp / f"rng-{rank}.pt", rng.encode(rng_state()))
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
        _write_durable(tmp / name, data)
    _write_durable(tmp / META, json.dumps(meta, indent=1).encode())
    _write_durable(tmp / manifest.MANIFEST, manifest.write(tmp, step, hashed, skip=(DONE,)))
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
