"""Whether a checkpoint can be trusted before anything of it is loaded, and the newest that can.

`verify` checks a step-N directory: its DONE marker, meta.json's step, every file against manifest.json
(runner/checkpoint/manifest.py), then the pickles it holds without running them (`.metadata` through the restricted
unpickler, the shards' byte items and the RNG states with weights_only: runner/checkpoint/unpickle.py, rng.py), and
that every rank's shard file holds this step and the optimizer's step counters add up to meta.json's
(`_shards_problem`). `newest_intact` walks the complete checkpoints newest first, moving damaged ones aside.
runner/checkpoint/store.py writes what these read; read it first.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from jobspec.errors import ConfigError
from jobspec.shared_dir import signing
from runner.checkpoint import files, manifest, rng, unpickle
from runner.checkpoint.steps import DONE, STEP_NAME, complete

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
OPTIMIZER_STEPS = "optimizer_steps"  # meta.json: the sum of every parameter's optimizer step counter at save


class DamagedCheckpoint(ConfigError):
    """Complete checkpoints exist but none verifies: resuming one would train on broken state."""


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
    meta, unread = files.read_or_problem(META, lambda: read_meta(path))
    if unread is not None:
        return unread
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
