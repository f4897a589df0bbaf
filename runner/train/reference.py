"""DPO's reference log-probs: one pass of the starting model over the pairs before training, cached beside the rows.

`attach_reference` runs before any checkpoint is loaded into the freshly built model (runner/train/recipe.py), so the
model it scores with is the starting one, at a restart too; with LoRA, the base with the adapter disabled. For each
store of tokenized records (the train source, and `data.eval_path`'s when given) it gives every record its summed
completion log-prob (no gradients, the model in eval mode, the training step's loss head: runner/train/step.py
`sequence_logps`), and the data takes them per pair (runner/data/preference.py). Training then holds one model.

Where the records are cached (runner/data/cache.py), the log-probs are stored beside their entry as
`<entry>.reference-<model>.npy`: one float64 per record, keyed by the entry (data, tokenizer, template, max_seq_len)
and by the model (`model.*` but LoRA, precision, 4-bit base, seed). Every rank and every restart reads them; one that
fails a check (not a regular file, not a float64 array of one value per record, not finite) is logged and computed
again. Every rank computes when any lacks them (the forwards are collective under FSDP); rank 0 writes. Not sharded
over ranks yet: each rank scores every record. An OOM halves the rows a forward (`score_records`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobspec import shared_dir
from jobspec.errors import ConfigError
from jobspec.spec.models import JobSpec
from jobspec.untrusted import open_regular
from runner.data.cache import CacheKey, usable_root
from runner.data.dataset import pad_rows
from runner.data.preference import PreferenceData, Split
from runner.data.tokens import Rows, Streams
from runner.oom.detect import guarded, release_memory
from runner.train.step import Stepper, sequence_logps

log = logging.getLogger("jobspec.runner")
VERSION = 1  # of the stored layout and of what the model key holds


def model_key(spec: JobSpec, precision: str, quantize: str | None) -> str:
    """What decides the starting model's log-probs, hashed: the model section (LoRA aside: its adapter is off),
    the precision, the 4-bit base and the seed (a preset's weights are drawn from it)."""
    model = spec.model.model_dump(mode="json", exclude={"attention", "hub_cache", "hub_token", "lora"})
    parts = {"version": VERSION, "model": model, "precision": precision, "quantize": quantize,
             "seed": spec.training.seed}  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def reference_path(root: Path | None, key: CacheKey | None, model: str) -> Path | None:
    return None if root is None or key is None else root / f"{key.digest}.reference-{model}.npy"


def read_reference(path: Path, records: int) -> np.ndarray | None:
    """The stored log-probs of `records` records; None (logged when there is a file) when absent or damaged."""
    try:
        with open_regular(path, what="reference log-probs", root=path.parent, follow=False) as f:
            values = np.load(f, allow_pickle=False)
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


def write_reference(path: Path, values: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, values.astype(np.float64), allow_pickle=False)
    try:
        shared_dir.write_atomic(path, buffer.getvalue())
    except OSError as err:  # a read-only or full cache volume: the next start computes them again
        log.warning("DPO reference %s not written (%s): a restart computes it again", path, err)


def score_records(stepper: Stepper, streams: Streams, pad_id: int, max_seq_len: int, micro_batch: int) -> np.ndarray:
    """Each record's summed completion log-prob under the model as it is (float64; 0 for a record with no target),
    with the adapter off under LoRA, in eval mode and without gradients, `micro_batch` rows at a time. Out of memory
    on any rank (every rank agrees after each forward): that forward again at half as many rows, and the rest at that
    size; a ConfigError when even one row at a time runs out."""
    model = stepper.model
    unwrapped: Any = stepper.accelerator.unwrap_model(model)
    adapter_off = unwrapped.disable_adapter() if hasattr(unwrapped, "disable_adapter") else nullcontext()
    rows = Rows(streams, np.arange(len(streams)), np.arange(len(streams) + 1))
    out = np.zeros(len(streams), dtype=np.float64)

    def score(ks: list[int]) -> np.ndarray:
        padded = pad_rows([rows[k] for k in ks], pad_id, max_seq_len)
        x, y = (torch.from_numpy(a).to(stepper.device) for a in padded)
        return sequence_logps(model, stepper.head, x, y).double().cpu().numpy()

    pending, size = np.flatnonzero(streams.trainable).tolist(), micro_batch
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), adapter_off:
            while pending:
                ks = pending[:size]
                done = guarded(partial(score, ks))
                if not stepper.ctrl.any(done.oom):
                    out[ks], pending = done.value, pending[size:]
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
    return out


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
            if stepper.ctrl.any(values is None):  # every rank scores when any must: FSDP's forwards are collective
                start = time.perf_counter()
                values = score_records(stepper, streams, data.pad_id, data.max_seq_len, 2 * micro_batch)
                log.info("DPO reference: %d records scored by the starting model in %.1f s%s", len(streams),
                         time.perf_counter() - start, f", stored in {path}" if path and is_main else "")  # fmt: skip
                if path is not None and is_main:
                    write_reference(path, values)
            else:
                log.info("DPO reference: %d records' log-probs from %s", len(streams), path)
            done[id(streams)] = values
        data.set_reference(split_, values)
