"""Preference data for DPO, IPO, SimPO and ORPO: pairs of tokenized chats kept together (DPO, IPO: their reference
log-probs beside them); and KTO's unpaired records, each kept with its KL row the same way (runner/data/unpaired.py).

Each preference record is two consecutive records of the tokenized store (runner/data/pairs.py): chosen, rejected.
`PreferenceData` is `SFTData` whose sample ids are pairs: train row 2i is pair i's chosen chat and 2i+1 its rejected
one, each alone in its row (never packed: a pair's members are scored as separate sequences, and no other record
joins them). A pair is dropped whole when either member keeps no target token within max_seq_len. A micro-batch of
B pairs is 2B rows, the B chosen chats then the B rejected ones (TRL's concatenated layout), its `targets` the B
pairs (the step's loss is the mean over the global step's pairs) and its `reference` the (B, 2) reference
log-probs of those pairs, once `set_reference` has them (runner/train/reference.py computes them once; DPO only),
and its `chosen_labels` the chosen chats' every next token, prompt included (ORPO's NLL term, as TRL scores it).
For KTO a sample is a record: row 2i its chat, 2i+1 its KL row, so a micro-batch of B records is the B chats then
their B KL rows, its `reference` the (B, 2) reference log-probs of both and its `desirable` the B labels (`KTOBatch`);
a record is dropped when its own chat keeps no target within max_seq_len (its KL row may have none: it scores 0, as
in TRL).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec, JobSpec
from runner.data.cache import CacheKey, usable_root
from runner.data.dataset import BUNDLED, Batch, SFTData, _split, encode_keyed, make_batch, pad_rows
from runner.data.records import EVAL_SPLITS
from runner.data.tokenizer import Tokenizer
from runner.data.tokens import IGNORE, Rows, Streams
from runner.data.unpaired import check_balance, encode_unpaired

log = logging.getLogger("jobspec.runner")
Split = Literal["train", "eval"]


@dataclass(frozen=True)
class KTOBatch(Batch):
    """A KTO micro-batch: B records' chats then their B KL rows, and the records' labels."""

    desirable: torch.Tensor | None = None  # (B,) bool: each record's label (true: a desirable completion)


def pair_rows(streams: Streams, pairs: np.ndarray, spec: DataSpec, what: str) -> Rows:
    """One row per record of the `pairs` (indices, in order) whose two members both keep a target: chosen, rejected."""
    kept = pairs[streams.trainable[2 * pairs] & streams.trainable[2 * pairs + 1]]
    if len(kept) < len(pairs):
        log.info("%s: dropped %d of %d pairs with a member left without a completion token within max_seq_len %d",
                 what, len(pairs) - len(kept), len(pairs), spec.max_seq_len)  # fmt: skip
    records = np.stack([2 * kept, 2 * kept + 1], axis=1).reshape(-1)
    return Rows(streams, records, np.arange(len(records) + 1))


class PreferenceData(SFTData):
    """Train and eval pairs (see the module docstring); `keys[split]`: the cache entry of its records (None: none)."""

    def __init__(self, train: Rows, eval_rows: Rows, pad_id: int, max_seq_len: int,
                 keys: dict[Split, CacheKey | None]):  # fmt: skip
        super().__init__(train, eval_rows, pad_id, max_seq_len)
        self.offsets = np.array([0, len(train) // 2], dtype=np.int64)  # sample ids are pairs
        self.keys = keys
        self.reference: dict[Split, np.ndarray | None] = {"train": None, "eval": None}  # (pairs, 2) per split
        self.labels: dict[Split, np.ndarray | None] = {"train": None, "eval": None}  # KTO: each store record's label

    def rows(self, split: Split) -> Rows:
        return self.train if split == "train" else self.eval  # type: ignore[return-value]

    def eval_order(self) -> list[int]:
        return list(range(len(self.eval) // 2))

    def set_reference(self, split: Split, per_record: np.ndarray) -> None:
        """The reference log-probs of every record of the split's store (`per_record[k]`: record k), taken per pair."""
        rows = self.rows(split)
        self.reference[split] = np.asarray(per_record, dtype=np.float64)[rows.records].reshape(-1, 2)

    def chosen_positions(self, ids: Sequence[int], split: str = "train") -> int:
        """Positions of the pairs' chosen chats, prompt included: the tokens ORPO's NLL term is a mean over."""
        rows = self.rows("train" if split == "train" else "eval")
        return int(rows.lengths[2 * np.asarray(ids, dtype=np.int64)].sum()) if len(ids) else 0

    def collate(self, ids: list[int] | tuple[int, ...], split: str = "train") -> Batch:  # type: ignore[override]
        rows_of = self.rows("train" if split == "train" else "eval")
        rows = [rows_of[2 * i] for i in ids] + [rows_of[2 * i + 1] for i in ids]
        x, y = pad_rows(rows, self.pad_id, self.max_seq_len)
        batch = make_batch(x, y, rows, ids, None)
        reference = self.reference["train" if split == "train" else "eval"]
        ref = None if reference is None else torch.from_numpy(reference[np.asarray(ids, dtype=np.int64)])
        chosen = np.full((len(ids), x.shape[1]), IGNORE, dtype=np.int64)
        for b, i in enumerate(ids):  # a row of n tokens scores tokens 1..n-1: all of them, the prompt's too
            tokens = rows_of.streams[int(rows_of.records[2 * i])][0][1:]
            chosen[b, : len(tokens)] = tokens
        out = replace(batch, targets=len(ids), pairs=True, reference=ref, chosen_labels=torch.from_numpy(chosen))
        labels = self.labels["train" if split == "train" else "eval"]
        if labels is None:
            return out
        records = rows_of.records[2 * np.asarray(ids, dtype=np.int64)] // 2  # each sample's record in the file
        return KTOBatch(**{f: getattr(out, f) for f in out.__dataclass_fields__}, desirable=torch.from_numpy(
            labels[records]))  # fmt: skip


def load_preference(spec: JobSpec, tokenizer: Tokenizer) -> PreferenceData:
    """Train pairs of `data.path` (one source: jobspec/spec/rules.py) and eval pairs: `data.eval_path`, or
    `eval_fraction` of the pairs held out by seed."""
    if spec.training.objective == "kto":
        return load_unpaired(spec, tokenizer)
    d, cache = spec.data, usable_root(spec)
    if d.packing:
        log.info("data.packing off for training.objective %s: each chosen and rejected chat is a row of its own",
                 spec.training.objective)  # fmt: skip
    source = d.train_sources(str(BUNDLED))[0]
    field = "data.path" if d.sources is None else "data.sources[0].path"
    fmt = d if source.format is None else d.model_copy(update={"format": source.format})
    streams, key = encode_keyed(source.path, fmt, tokenizer, field, cache_dir=cache, pairs=True)
    fraction = 0.0 if d.eval_path else d.eval_fraction
    train, held = _split(len(streams) // 2, fraction, [spec.training.seed, 0x5EED])
    train_rows = pair_rows(streams, train, d, "train")
    eval_rows, eval_key = pair_rows(streams, held, d, "eval"), key
    if d.eval_path:
        held_out, eval_key = encode_keyed(d.eval_path, d, tokenizer, "data.eval_path", EVAL_SPLITS, cache_dir=cache,
                                          pairs=True)  # fmt: skip
        eval_rows = pair_rows(held_out, np.arange(len(held_out) // 2), d, "eval")
    if not len(train_rows):
        raise ConfigError(f"{field} {source.path}: no training pairs left (every pair held out or dropped)")
    log.info("data: %d training pairs, %d eval pairs (chosen and rejected in one micro-batch)", len(train_rows) // 2,
             len(eval_rows) // 2)  # fmt: skip
    return PreferenceData(train_rows, eval_rows, tokenizer.pad_id, d.max_seq_len, {"train": key, "eval": eval_key})


def unpaired_rows(streams: Streams, records: np.ndarray, spec: DataSpec, what: str) -> Rows:
    """The rows of the KTO `records` (indices, in order) whose own chat keeps a target: its chat, then its KL row."""
    kept = records[streams.trainable[2 * records]]
    if len(kept) < len(records):
        log.info("%s: dropped %d of %d KTO records left without a completion token within max_seq_len %d", what,
                 len(records) - len(kept), len(records), spec.max_seq_len)  # fmt: skip
    rows = np.stack([2 * kept, 2 * kept + 1], axis=1).reshape(-1)
    return Rows(streams, rows, np.arange(len(rows) + 1))


def load_unpaired(spec: JobSpec, tokenizer: Tokenizer) -> PreferenceData:
    """KTO's train records of `data.path` (one source: jobspec/spec/rules.py) with their KL rows and labels, and eval
    records: `data.eval_path`, or `eval_fraction` of the records held out by seed (runner/data/unpaired.py)."""
    d, cache = spec.data, usable_root(spec)
    if d.packing:
        log.info("data.packing off for training.objective kto: each record and its KL row are rows of their own")
    source = d.train_sources(str(BUNDLED))[0]
    field = "data.path" if d.sources is None else "data.sources[0].path"
    streams, labels, key = encode_unpaired(source.path, d, tokenizer, field, cache_dir=cache)
    fraction = 0.0 if d.eval_path else d.eval_fraction
    train, held = _split(len(labels), fraction, [spec.training.seed, 0x5EED])
    check_balance(labels[train], spec.training, f"{field} {source.path}")
    train_rows = unpaired_rows(streams, train, d, "train")
    eval_rows, eval_key, eval_labels = unpaired_rows(streams, held, d, "eval"), key, labels
    if d.eval_path:
        held_out, eval_labels, eval_key = encode_unpaired(d.eval_path, d, tokenizer, "data.eval_path", EVAL_SPLITS,
                                                          cache_dir=cache)  # fmt: skip
        eval_rows = unpaired_rows(held_out, np.arange(len(eval_labels)), d, "eval")
    if not len(train_rows):
        raise ConfigError(f"{field} {source.path}: no training records left (every record held out or dropped)")
    log.info("data: %d training records (%d desirable), %d eval records (each with its KL row in one micro-batch)",
             len(train_rows) // 2, int(labels[train_rows.records[::2] // 2].sum()), len(eval_rows) // 2)  # fmt: skip
    data = PreferenceData(train_rows, eval_rows, tokenizer.pad_id, d.max_seq_len, {"train": key, "eval": eval_key})
    data.labels = {"train": labels, "eval": eval_labels}
    return data
