"""GRPO's prompts: TRL's prompt-only records, `{"prompt": ..., <other columns>}`, as the ids completions are sampled
after and the columns the reward functions read.

TRL's GRPOTrainer reads a `prompt` (the field `data.prompt_field` names) that is either a text, tokenized as it is (a
base model's continuation; no chat template), or a message list, rendered with the chat template and its generation
prompt (runner/data/tokenizer.py `generation_prompt`). Every other field of the record is a column handed to the
reward functions by its name (`answer`, `solution`, `tests`...), as TRL hands them (runner/rl/rewards.py).

A prompt longer than data.max_seq_len - training.grpo.max_completion_length keeps its last tokens (TRL truncates
prompts on the left), and the log counts them. A record without a usable prompt is refused naming its file, line
and field. `PromptData` is `SFTData` whose sample ids are prompts: the data order, the lineage and the step's share
of each rank work as for any other data; a step's rows are made from them by sampling (runner/rl/rollout.py), never
collated from the file. GRPO holds nothing out: its loss is measured on completions it samples, and each step's
rewards are its metrics.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from jobspec.errors import ConfigError
from jobspec.spec.models import JobSpec
from runner.data.dataset import BUNDLED, SFTData, check_text
from runner.data.pairs import _kind
from runner.data.records import as_message_list, read_records
from runner.data.tokenizer import Message
from runner.data.tokens import Rows, Streams, StreamsBuilder

log = logging.getLogger("jobspec.runner")


class PromptData(SFTData):
    """The train prompts (see the module docstring): `prompts[i]` the prompt of sample i (text or messages),
    `columns[i]` its other fields, `streams[i]` its generation-prompt ids (left-truncated)."""

    def __init__(self, streams: Streams, prompts: list[str | list[Message]], columns: list[dict[str, Any]],
                 pad_id: int, max_seq_len: int):  # fmt: skip
        train = Rows(streams, np.arange(len(streams)), np.arange(len(streams) + 1))
        empty = Rows(streams, np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
        super().__init__(train, empty, pad_id, max_seq_len)
        self.streams, self.prompts, self.columns = streams, prompts, columns

    def prompt_ids(self, i: int) -> np.ndarray:
        return np.asarray(self.streams[i][0], dtype=np.int64)


def prompt_of(record: dict, field: str) -> str | list[Message]:
    """The record's prompt, a text or a message list; ValueError naming the field when it is neither."""
    prompt = as_message_list(record.get(field))
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{field!r} is empty: nothing to sample a completion after")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        check_text(prompt)  # type: ignore[arg-type]
        if prompt[-1].get("role") == "assistant":
            raise ValueError(f"{field!r} ends with an assistant message: a GRPO prompt ends where the model replies "
                             "(a user turn, or a system and a user turn)")  # fmt: skip
        return prompt  # type: ignore[return-value]
    raise ValueError(f"{field!r} is {_kind(prompt)}: GRPO's records (TRL's GRPOTrainer) are prompt-only, "
                     f"{{{field!r}: a text or a message list, ...columns the rewards read}}")


def load_prompts(spec: JobSpec, tokenizer: Any) -> PromptData:
    """The prompts of `data.path` (one source: jobspec/spec/rules.py)."""
    d, grpo = spec.data, spec.training.grpo
    assert grpo is not None
    source = d.train_sources(str(BUNDLED))[0]
    field = "data.path" if d.sources is None else "data.sources[0].path"
    keep = d.max_seq_len - grpo.max_completion_length  # the prompt's share of a row
    builder = StreamsBuilder(tokenizer.vocab_size)
    prompts: list[str | list[Message]] = []
    columns: list[dict[str, Any]] = []
    cut = 0
    for where, record in read_records(source.path, d, field):
        try:
            prompt = prompt_of(record, d.prompt_field)
        except ValueError as err:
            raise ConfigError(f"{field} {where}: {err}") from None
        try:
            ids = np.asarray(tokenizer.generation_prompt(prompt), dtype=np.int64)
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError) as err:  # a template that refuses the chat
            raise ConfigError(f"{field} {where}: the prompt cannot be rendered ({type(err).__name__}: {err})") from None
        if len(ids) > keep:
            ids, cut = ids[-keep:], cut + 1
        builder.add(ids, np.ones(len(ids), dtype=bool))
        prompts.append(prompt)
        columns.append({k: v for k, v in record.items() if k != d.prompt_field})
    if not prompts:
        raise ConfigError(f"{field} {source.path}: no prompts")
    if cut:
        log.info("data: %d of %d prompts longer than data.max_seq_len - max_completion_length = %d tokens keep their "
                 "last %d (TRL truncates prompts on the left)", cut, len(prompts), keep, keep)  # fmt: skip
    log.info("data: %d prompts, %d completions sampled for each", len(prompts), grpo.num_generations)
    return PromptData(builder.build(), prompts, columns, tokenizer.pad_id, d.max_seq_len)
