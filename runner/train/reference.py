"""DPO's reference log-probs: one pass of the starting model over the pairs before training, cached beside the rows.

`attach_reference` runs before any checkpoint is loaded into the freshly built model (runner/train/recipe.py), so the
model it scores with is the starting one, at a restart too; with LoRA, the base with the adapter disabled. For each
store of tokenized records (the train source, and `data.eval_path`'s when given) it gives every record its summed
completion log-prob (no gradients, the model in eval mode, the training step's loss head: runner/train/step.py
`sequence_logps`), and the data takes them per pair (runner/data/preference.py). Training then holds one model.

Where the records are cached (runner/data/cache.py), the log-probs are stored beside their entry as
`<entry>.reference-<model>.npy`: one float64 per record, keyed by the entry (data, tokenizer, template, max_seq_len)
and by the model (`model_key`: `model.*` but LoRA, precision, 4-bit base, seed, and the weights themselves: a hub
snapshot's commit, or each file of a local model directory by name, size and sampled blocks, so new weights written
to the same `model.path` make a new entry). Every rank and every restart reads them; one that fails a check (not a
regular file, not a float64 array of one value per record, not finite; with JOBSPEC_CHECKPOINT_KEY set, no signed
sidecar `<name>.json` whose SHA-256 is the file's) is logged and computed again. With or without the key, a few
records chosen at random are scored again at every start and must match (`spot_check`): a file rewritten in a
shared cache, or another job's under this name, is computed again instead of training against wrong references.

When any rank lacks them every rank computes (the forwards are collective under FSDP), each its own share: the
trainable records dealt round-robin over the ranks, padded to the same count so that every rank runs as many
forwards; the shares are summed over the ranks (each record scored once, zeros elsewhere) and rank 0 writes. An OOM
on any rank halves the rows a forward on every rank (`score_records`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import secrets
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobspec import shared_dir
from jobspec.errors import ConfigError
from jobspec.shared_dir import signing
from jobspec.spec.hub import hub_origin
from jobspec.spec.models import JobSpec
from jobspec.untrusted import json_loads, open_regular, read_bounded
from runner.data.cache import CacheKey, sampled_digest, usable_root
from runner.data.dataset import pad_rows
from runner.data.preference import PreferenceData, Split
from runner.data.tokens import Rows, Streams
from runner.model.build import eager_forwards
from runner.oom.detect import guarded, release_memory
from runner.train.step import Stepper, sequence_logps

log = logging.getLogger("jobspec.runner")
VERSION = 1  # of the stored layout and of what the model key holds


WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".gguf")  # what a model directory loads
MAX_WEIGHT_FILES = 10_000


def model_key(spec: JobSpec, precision: str, quantize: str | None) -> str:
    """What decides the starting model's log-probs, hashed: the model section (LoRA aside: its adapter is off),
    the precision, the 4-bit base, the seed (a preset's weights are drawn from it) and the weights (`weights_identity`).
    """
    model = spec.model.model_dump(mode="json", exclude={"attention", "hub_cache", "hub_token", "lora"})
    parts = {"version": VERSION, "model": model, "precision": precision, "quantize": quantize,
             "seed": spec.training.seed, "weights": weights_identity(spec.model.path)}  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def weights_identity(path: str | None) -> str | None:
    """Which weights `model.path` holds now: None for a preset (the seed draws them), `repo@commit` for a hub snapshot
    (its directory names the commit), and for any other local directory a SHA-256 over each file it loads from (name,
    size and the sampled blocks runner/data/cache.py binds data files with: about 1 MiB read per file, so a 100 GB
    model costs milliseconds, and a fine-tuned checkpoint written over the old one is another model). A path that is
    not a local directory (a hub id the runner resolves elsewhere) is its own identity."""
    if not path:
        return None
    origin = hub_origin(path)
    if origin is not None:
        return f"{origin[0]}@{origin[1]}"
    root = Path(path)
    if not root.is_dir():
        return path
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(root) if n.endswith(WEIGHT_FILES))[:MAX_WEIGHT_FILES]
    for name in names:
        h.update(name.encode("utf-8", "surrogateescape") + b"\0")
        try:
            with open_regular(root / name, what="model file", root=root, follow=False) as f:
                h.update(sampled_digest(f, os.fstat(f.fileno()).st_size).encode())
        except (ConfigError, OSError) as err:  # not a regular file, unreadable: the model's loader reports it
            h.update(f"unreadable: {type(err).__name__}".encode())
    return h.hexdigest()


def reference_path(root: Path | None, key: CacheKey | None, model: str) -> Path | None:
    return None if root is None or key is None else root / f"{key.digest}.reference-{model}.npy"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_reference(path: Path, records: int) -> np.ndarray | None:
    """The stored log-probs of `records` records; None (logged when there is a file) when absent or damaged."""
    try:
        data = read_bounded(path, 8 * records + 2**16, what="reference log-probs", root=path.parent, follow=False)
        secret = signing.key()
        if secret is not None and (unsigned := _signature_problem(path, data, secret)):
            log.warning("DPO reference %s not usable, computing it again: %s", path, unsigned)
            return None
        values = np.load(io.BytesIO(data), allow_pickle=False)
    except ConfigError as err:
        if "does not exist" not in str(err):
            log.warning("DPO reference %s not usable, computing it again: %s", path, err)
        return None
    except (OSError, ValueError, EOFError) as err:
        log.warning("DPO reference %s damaged (%s): computing it again", path, err)
        return None
    if values.dtype != np.float64 or values.shape != (records,) or not np.isfinite(values).all():
        log.warning("DPO reference %s damaged (%s%s, %d records expected, or not finite): computing it again", path,
                    values.dtype, list(values.shape), records)  # fmt: skip
        return None
    return values


def _signature_problem(path: Path, data: bytes, secret: bytes) -> str | None:
    """Why the signed sidecar of `path` does not vouch for `data` (its SHA-256 under a valid MAC), or None."""
    sidecar = _sidecar(path)
    try:
        record = json_loads(read_bounded(sidecar, 4096, what="reference signature", root=path.parent, follow=False))
    except (ConfigError, OSError, ValueError) as err:
        return f"no readable signature {sidecar.name} ({err}), and {signing.KEY_ENV} is set"
    if not isinstance(record, dict) or (problem := signing.problem(record, secret, sidecar.name)):
        return problem or f"{sidecar.name} is not a signature"
    if record.get("sha256") != hashlib.sha256(data).hexdigest():
        return f"{sidecar.name} vouches for other bytes"
    return None


def write_reference(path: Path, values: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, values.astype(np.float64), allow_pickle=False)
    try:
        secret = signing.key()
        if secret is not None:
            record = signing.sign({"sha256": hashlib.sha256(buffer.getvalue()).hexdigest()}, secret)
            shared_dir.write_atomic(_sidecar(path), json.dumps(record).encode())
        shared_dir.write_atomic(path, buffer.getvalue())
    except OSError as err:  # a read-only or full cache volume: the next start computes them again
        log.warning("DPO reference %s not written (%s): a restart computes it again", path, err)


def score_records(stepper: Stepper, streams: Streams, pad_id: int, max_seq_len: int, micro_batch: int,
                  only: list[int] | None = None) -> np.ndarray:  # fmt: skip
    """Each record's summed completion log-prob under the model as it is (float64; 0 for a record with no target, or
    outside `only` when given: the records to score, the same list on every rank),
    with the adapter off under LoRA, in eval mode and without gradients, `micro_batch` rows at a time. Out of memory
    on any rank (every rank agrees after each forward): that forward again at half as many rows, and the rest at that
    size; a ConfigError when even one row at a time runs out."""
    model = stepper.model
    unwrapped: Any = stepper.accelerator.unwrap_model(model)
    adapter_off = unwrapped.disable_adapter() if hasattr(unwrapped, "disable_adapter") else nullcontext()
    rows = Rows(streams, np.arange(len(streams)), np.arange(len(streams) + 1))
    out = np.zeros(len(streams), dtype=np.float64)
    chosen = np.flatnonzero(streams.trainable).tolist() if only is None else only
    mine, padding = share(chosen, stepper.rank, stepper.world_size)

    def score(ks: list[int]) -> np.ndarray:
        padded = pad_rows([rows[k] for k in ks], pad_id, max_seq_len)
        x, y = (torch.from_numpy(a).to(stepper.device) for a in padded)
        return sequence_logps(model, stepper.head, x, y).double().cpu().numpy()

    pending, size = mine + padding, micro_batch
    scored = len(mine)  # positions of `pending` past this are padding: scored, never kept
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), eager_forwards(), adapter_off:
            while pending:
                ks = pending[:size]
                done = guarded(partial(score, ks))
                if not stepper.ctrl.any(done.oom):
                    keep = max(0, min(len(ks), scored))
                    out[ks[:keep]], pending, scored = done.value[:keep], pending[size:], scored - len(ks)
                    continue
                release_memory()
                if size == 1:
                    raise ConfigError(
                        f"DPO reference pass: out of memory one sequence at a time ({done.reason or 'on another rank'})"
                        "; lower data.max_seq_len or choose a memory tier that shards the model"
                    )
                log.warning("DPO reference pass: %d -> %d rows a forward after an OOM (%s)", size, size // 2,
                            done.reason or "on another rank")  # fmt: skip
                size //= 2
    finally:
        model.train(was_training)
    if stepper.world_size > 1:  # each record scored by one rank, zeros elsewhere: the sum is every rank's answer
        out = np.asarray(stepper.ctrl.all_reduce(out.tolist()), dtype=np.float64)
    return out


SPOT_RECORDS = 8  # records scored again at every start to vouch for a stored reference
# How far a record scored again may be from its stored value: the same weights and records, in other micro-batches
# (padding to another length moves a 16-bit forward's rounding); another model's or a rewritten file is off by nats.
SPOT_TOLERANCE = {"fp32": (1e-3, 1e-4), "bf16": (0.25, 1e-2), "fp16": (0.25, 1e-2)}  # (absolute, relative)


def spot_check(stepper: Stepper, streams: Streams, data: PreferenceData, values: np.ndarray,
               precision: str) -> str | None:  # fmt: skip
    """Why the stored `values` are not this starting model's log-probs, or None: a few trainable records, chosen at
    random by rank 0 (no one who plants a file can know which), scored again and compared (collective: every rank
    scores its share). A file in a shared cache can be rewritten or copied from another job; with
    JOBSPEC_CHECKPOINT_KEY its signature vouches for it, without one this is what does."""
    trainable = np.flatnonzero(streams.trainable).tolist()
    if not trainable:
        return None
    k = min(SPOT_RECORDS, len(trainable))
    picked = secrets.SystemRandom().sample(trainable, k) if stepper.rank == 0 else [0] * k
    sample = [int(v) for v in stepper.ctrl.all_reduce([float(v) for v in picked])]  # rank 0's, on every rank
    fresh = score_records(stepper, streams, data.pad_id, data.max_seq_len, k, only=sample)
    atol, rtol = SPOT_TOLERANCE.get(precision, SPOT_TOLERANCE["bf16"])
    off = [i for i in sample if not abs(fresh[i] - values[i]) <= atol + rtol * abs(fresh[i])]
    if not stepper.ctrl.any(bool(off)):
        return None
    if not off:
        return "another rank's copy differs"
    i = off[0]
    return f"{len(off)} of {k} records scored again differ, record {i}: stored {values[i]:.4g}, now {fresh[i]:.4g}"


def share(records: list[int], rank: int, world_size: int) -> tuple[list[int], list[int]]:
    """(this rank's records, dealt round-robin; padding that makes every rank's count the largest one's). The padding
    repeats a record so a rank with fewer still runs each collective forward the others run."""
    mine = records[rank::world_size]
    most = -(-len(records) // world_size)
    return mine, [records[0]] * (most - len(mine)) if records else []


def attach_reference(stepper: Stepper, data: PreferenceData, spec: JobSpec, *, precision: str, quantize: str | None,
                     micro_batch: int, is_main: bool) -> None:  # fmt: skip
    """Reference log-probs for both splits of `data` (see the module docstring); a split that has them keeps them."""
    root, model = usable_root(spec), model_key(spec, precision, quantize)
    done: dict[int, np.ndarray] = {}  # by the store: held-out eval pairs share the train records' values
    for split in ("train", "eval"):
        split_: Split = split  # type: ignore[assignment]
        rows = data.rows(split_)
        if data.reference[split_] is not None or not len(rows):
            continue
        streams = rows.streams
        values = done.get(id(streams))
        if values is None:
            path = reference_path(root, data.keys[split_], model)
            values = read_reference(path, len(streams)) if path is not None else None
            if not stepper.ctrl.any(values is None) and (why := spot_check(stepper, streams, data, values, precision)):
                log.warning("DPO reference %s does not hold this model's log-probs (%s): computing it again", path,
                            why)  # fmt: skip
                values = None
            if stepper.ctrl.any(values is None):  # every rank scores when any must: FSDP's forwards are collective
                start = time.perf_counter()
                values = score_records(stepper, streams, data.pad_id, data.max_seq_len, 2 * micro_batch)
                mine = len(share(np.flatnonzero(streams.trainable).tolist(), stepper.rank, stepper.world_size)[0])
                log.info("DPO reference: %d records scored by the starting model in %.1f s (%d on this rank of %d)%s",
                         len(streams), time.perf_counter() - start, mine, stepper.world_size,
                         f", stored in {path}" if path and is_main else "")  # fmt: skip
                if path is not None and is_main:
                    write_reference(path, values)
            else:
                log.info("DPO reference: %d records' log-probs from %s", len(streams), path)
            done[id(streams)] = values
        data.set_reference(split_, values)
