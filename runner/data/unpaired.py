"""KTO's unpaired records in TRL's convention, as the two rows KTO scores of each: its own chat and its KL row.

TRL's KTOTrainer reads `{"prompt", "completion", "label"}`, so a data set made for it works unchanged:

- text: `prompt` and `completion` strings: the prompt a user turn, the completion the assistant's;
- conversational: `prompt` and `completion` message lists (a text prompt is a user turn put before the completion),
  the prompt's assistant turns rendered but never targets (`PROMPT_TURN`, as for preference pairs);
- `label`: a boolean, true for a desirable completion, false for an undesirable one. A record without one, or with
  another type (1, "yes"), is refused naming its file, line and field, and so is a training set of one label only:
  KTO weighs desirable against undesirable completions (TRL's KTOTrainer balances them by `desirable_weight` and
  `undesirable_weight`, and warns, as this log does, when their counts and weights disagree);
- a preference pair `{prompt, chosen, rejected}` (runner/data/pairs.py, implicit prompts too) is unpaired as TRL's
  `unpair_preference_dataset` unpairs it: two records, the chosen completion desirable, the rejected one not (here
  one after the other; TRL puts each map batch's chosen ones before its rejected ones, which only moves KL partners).

Each record is rendered with the chat template (runner/data/tokenizer.py) and its targets are the completion's
assistant turns, as for SFT and the preference pairs. Its KL row is the KL estimate's mismatched pair, built as TRL
builds it (`add_kl_completion_ids`: the completions shifted by one, so record i is paired with record i-1's, the first
with the last's), on tokens: record i's prompt (its tokens before its first target) followed by record i-1's
completion (the rest of that record, its targets kept), cut to max_seq_len + 1 tokens. TRL shifts within each
per-device batch of the unshuffled data and so needs sequential sampling; here the shift runs over the file, so the
pairing is fixed whatever the micro-batch, and the reference pass scores every KL row once
(runner/train/reference.py) as TRL precomputes its `ref_KL_logps`. The store holds both: record 2i the record's chat,
2i+1 its KL row, cached under a key of their own (the tokenized data's key with this layout's name).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec, TrainingSpec
from runner.data.cache import CacheKey, cache_key, cached_streams
from runner.data.dataset import _locate, check_text, clip_texts
from runner.data.pairs import CHOSEN, REJECTED, _kind, _prompt_turn, pair_chats
from runner.data.prepare import CHUNK_RECORDS, Chat, ChunkRenderer
from runner.data.records import TRAIN_SPLITS, as_message_list, read_records
from runner.data.tokenizer import Message, Tokenizer
from runner.data.tokens import Streams, StreamsBuilder
from runner.data.tools import with_tools

log = logging.getLogger("jobspec.runner")
COMPLETION, LABEL = "completion", "label"
LAYOUT = "kto-1: record, KL row (prompt + the completion of the record before)"


def unpaired_chat(record: dict, spec: DataSpec) -> list[Message]:
    """The chat of a KTO record (its prompt, then its completion); ValueError naming the field that is wrong."""
    prompt_field = spec.prompt_field
    prompt, completion = as_message_list(record.get(prompt_field)), as_message_list(record.get(COMPLETION))
    if isinstance(completion, str):
        if not isinstance(prompt, str):
            raise ValueError(f"{prompt_field!r} is {_kind(prompt)}: a text {COMPLETION!r} needs a text prompt")
        head: list[Message] = [{"role": "user", "content": prompt}] if prompt else []
        return [*head, {"role": "assistant", "content": completion}]
    if isinstance(completion, list):
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list):
            raise ValueError(f"{prompt_field!r} is {_kind(prompt)}: with a {COMPLETION!r} message list it must be a "
                             "message list or a text")  # fmt: skip
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in completion):
            raise ValueError(f"{COMPLETION!r} holds no assistant message: nothing to score")
        return [_prompt_turn(m) for m in prompt] + completion
    raise ValueError(f"{COMPLETION!r} is {_kind(completion)}: KTO's records (TRL's KTOTrainer) are {{{prompt_field!r}, "
                     f"{COMPLETION!r}, {LABEL!r}}}, prompt and completion both texts or both message lists")


def is_pair(record: dict) -> bool:
    """A preference pair given to KTO (unpaired as TRL unpairs it: see the module docstring)."""
    return record.get(COMPLETION) is None and record.get(CHOSEN) is not None and record.get(REJECTED) is not None


def record_chats(record: dict, spec: DataSpec) -> list[list[Message]]:
    """The chats of a record: its own, or a pair's chosen then rejected one."""
    chats = list(pair_chats(record, spec)) if is_pair(record) else [unpaired_chat(record, spec)]
    return [with_tools(chat, record) for chat in chats]  # a tool-calling chat: runner/data/tools.py


def read_labels(source: str | Path, spec: DataSpec, field: str, splits: Sequence[str] = TRAIN_SPLITS) -> np.ndarray:
    """Each record's `label` (bool), in file order (a pair's: true, false); a ConfigError at the first record without
    a boolean one."""
    labels = []
    for where, record in read_records(source, spec, field, splits):
        if isinstance(record, dict) and is_pair(record):
            labels += [True, False]
            continue
        label = record.get(LABEL) if isinstance(record, dict) else None
        if not isinstance(label, (bool, np.bool_)):
            raise ConfigError(
                f"{where}: {LABEL!r} is {_kind(label)}: KTO (TRL's KTOTrainer) needs a boolean {LABEL!r} in every "
                f"record beside {spec.prompt_field!r} and {COMPLETION!r}: true for a desirable completion, false for "
                "an undesirable one"
            )
        labels.append(bool(label))
    return np.asarray(labels, dtype=bool)


def check_balance(labels: np.ndarray, training: TrainingSpec, where: str) -> None:
    """A ConfigError when the training records are of one label; TRL's warning when the weights do not balance the
    counts (its Eq. 8 range, from the KTO paper)."""
    desirable = int(labels.sum())
    if desirable in (0, len(labels)):
        kind = "true (desirable)" if desirable else "false (undesirable)"
        raise ConfigError(f"{where}: all {len(labels)} records have {LABEL!r} {kind}: KTO (TRL's KTOTrainer) learns "
                          "from desirable and undesirable completions both; add records of the other label")
    undesirable, w_d, w_u = len(labels) - desirable, training.desirable_weight, training.undesirable_weight
    if desirable == undesirable:
        return
    d_range = (round(undesirable * w_u / desirable, 2), round(undesirable * w_u / desirable * 1.33, 2))
    u_range = (round(desirable * w_d / undesirable / 1.33, 2), round(desirable * w_d / undesirable, 2))
    if not (d_range[0] <= w_d <= d_range[1] or u_range[0] <= w_u <= u_range[1]):
        log.warning("%s: %d desirable and %d undesirable records: TRL recommends EITHER training.desirable_weight in "
                    "[%g, %g] or training.undesirable_weight in [%g, %g] (not both); they are %g and %g", where,
                    desirable, undesirable, *d_range, *u_range, w_d, w_u)  # fmt: skip


def with_kl_rows(streams: Streams, max_seq_len: int, vocab_size: int) -> Streams:
    """2N records from N: record i's own, then its KL row (its prompt, record i-1's completion; see the module
    docstring), each at most max_seq_len + 1 tokens."""
    starts = []  # each record's first target: where its completion starts (its length when it has none)
    for k in range(len(streams)):
        _, flags = streams[k]
        hit = np.flatnonzero(flags)
        starts.append(int(hit[0]) if len(hit) else len(flags))
    out = StreamsBuilder(vocab_size)
    for k in range(len(streams)):
        ids, flags = streams[k]
        before_ids, before_flags = streams[k - 1]  # k = 0: the last record's completion
        cut = starts[k - 1]
        out.add(ids, flags)
        kl_ids = np.concatenate([ids[: starts[k]], before_ids[cut:]])[: max_seq_len + 1]
        kl_flags = np.concatenate([np.zeros(starts[k], dtype=bool), before_flags[cut:]])[: max_seq_len + 1]
        out.add(kl_ids, kl_flags)
    return out.build()


def _render(source: str | Path, spec: DataSpec, tokenizer: Tokenizer, field: str, splits: Sequence[str]) -> Streams:
    """Every record's chat tokenized (truncated to max_seq_len + 1 tokens), then the KL rows (`with_kl_rows`)."""
    out = StreamsBuilder(tokenizer.vocab_size)
    reach = spec.max_seq_len + 2
    chars = reach * tokenizer.max_token_chars
    chats: list[Chat] = []
    places: list[object] = []
    with ChunkRenderer(tokenizer, spec.max_seq_len + 1) as renderer:

        def collect(drain: bool = False) -> None:
            for tag, chunk in renderer.ready(drain):
                if isinstance(chunk, ValueError):
                    _locate(tag, tokenizer, chunk, "kto")
                ids, flags, lengths = chunk
                for a, b in itertools.pairwise(np.concatenate(([0], np.cumsum(lengths))).tolist()):
                    out.add(ids[a:b], flags[a:b])

        for where, record in read_records(source, spec, field, splits):
            try:
                clipped = [clip_texts(chat, chars, reach)[0] for chat in record_chats(record, spec)]
                for messages in clipped:
                    check_text(messages)
            except ValueError as err:
                raise ConfigError(f"{where}: {err} (KTO records)") from None
            chats += clipped
            places += [where] * len(clipped)
            if len(chats) >= CHUNK_RECORDS:
                renderer.put(chats, (places, chats))
                chats, places = [], []
                collect()
        if chats:
            renderer.put(chats, (places, chats))
        collect(drain=True)
    log.info("data %s: %d KTO records (a preference pair is two), each with its KL row", source, len(out))
    return with_kl_rows(out.build(), spec.max_seq_len, tokenizer.vocab_size)


def encode_unpaired(source: str | Path, spec: DataSpec, tokenizer: Tokenizer, field: str,
                    splits: Sequence[str] = TRAIN_SPLITS, *,
                    cache_dir: Path | None = None) -> tuple[Streams, np.ndarray, CacheKey | None]:  # fmt: skip
    """(2N records: each record's chat and its KL row, the N labels, the cache key of the rows: None when not cached).
    The labels are read first, so a missing one fails before any tokenizing."""
    labels = read_labels(source, spec, field, splits)
    if not len(labels):
        raise ConfigError(f"{field} {source}: no records (KTO reads {{prompt, completion, label}} records)")
    build = lambda: _render(source, spec, tokenizer, field, splits)  # noqa: E731
    base = None if cache_dir is None else cache_key(source, spec, tokenizer, field, splits, stamps=Path(cache_dir))
    if base is None:
        return build(), labels, None
    parts = base.parts | {"records": LAYOUT}
    key = replace(base, digest=hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest(), parts=parts)
    streams = cached_streams(Path(cache_dir), key, build)  # type: ignore[arg-type]
    if len(streams) != 2 * len(labels):
        raise ConfigError(f"{field} {source}: {len(labels)} labels but {len(streams) // 2} records tokenized; the file "
                          "changed while it was read: start again")  # fmt: skip
    return streams, labels, key
