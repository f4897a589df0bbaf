"""How long a job is: optimizer steps and tokens per step, from the spec (and the data, when it is here).

`jobspec plan` turns this into a duration per tier; the runner counts steps the same way
(runner/data/dataset.py: `DataOrder`, `total_steps`), over its rows: a record each, unless packed, and raw text
(`data.format: text`) cut into blocks of max_seq_len, which only a tokenizer can count (the plan says so).
A preference pair is two rows (chosen and rejected), so its step has twice the tokens; a KTO record is two rows
too, its completion and its KL row (the prompt with another record's completion, scored without gradients: TRL's KL
pass doubles the forward). The reference pass of DPO, IPO and KTO, once before training, runs the starting model
forward over every pair's (record's) two rows of the data (and of `data.eval_path`): `reference_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from importlib.util import find_spec
from pathlib import Path

from jobspec.spec.models import REFERENCE_OBJECTIVES, JobSpec


@dataclass(frozen=True)
class JobLength:
    """The optimizer steps a job runs, and the tokens each takes (rows of max_seq_len tokens)."""

    steps: int | None  # None: epochs over data this machine cannot count
    tokens_per_step: int
    how: str  # where `steps` comes from, or why it is unknown
    # DPO, IPO, KTO: the tokens of the reference pass (every pair's two rows, full length; None: the pairs cannot be
    # counted here) and where they come from; None and "" for the other objectives
    reference_tokens: int | None = None
    reference_how: str = ""


def rows_per_sample(spec: JobSpec) -> int:
    """Sequences one sample of the global batch is: a preference pair (dpo, ipo, simpo, orpo) is 2, chosen and
    rejected in one micro-batch; a KTO record is 2, its completion and its KL row. SimPO and ORPO have no reference
    pass; DPO's, IPO's and KTO's runs once before training. A GRPO prompt is its group of num_generations
    completions, each a row of prompt and completion trained in one micro-batch."""
    t = spec.training
    if t.objective == "grpo":
        return t.grpo.num_generations if t.grpo is not None else 8
    return 1 if t.objective == "sft" else 2


ROW_COUNT_LIMIT = 1024**3  # bytes of JSON lines `plan` counts rows in (about a second); beyond: --rows


def count_rows(spec: JobSpec) -> tuple[int | None, str]:
    """(records, where) of the training data when it is JSON-lines files here (or the bundled set): every
    source of `data.sources` counted, None when any cannot be."""
    return _total(source_rows(spec))


def _total(counts: list[tuple[int | None, str]]) -> tuple[int | None, str]:
    if any(n is None for n, _ in counts):
        return None, next(where for n, where in counts if n is None)
    if len(counts) == 1:
        return counts[0]
    return sum(n or 0 for n, _ in counts), f"{len(counts)} data.sources"


def source_rows(spec: JobSpec) -> list[tuple[int | None, str]]:
    """(records, where) of each training source: `data.sources`, or `data.path` (the bundled set when unset); a
    stream (`data.streaming`) is not counted: its length is `training.steps`, and it may be larger than this disk."""
    if spec.data.streaming:
        return [(None, "a stream (data.streaming: its length is training.steps)")]
    if spec.data.sources is None:
        return [_count_file(spec.data.path, "data.path")]
    return [_count_file(s.path, f"data.sources[{i}].path") for i, s in enumerate(spec.data.sources)]


def _count_file(source: str | None, field: str) -> tuple[int | None, str]:
    if source is None:
        runner = find_spec("runner")
        where = "the bundled set"
        folders = list(runner.submodule_search_locations or []) if runner else []
        if not folders:
            return None, f"{where} (the runner is not installed)"
        path = Path(folders[0]) / "data" / "sft_synthetic.jsonl"
    else:
        path, where = Path(source), f"{field} {source}"
    if path.suffix not in (".jsonl", ".ndjson") or not path.is_file():
        return None, f"{where} is not a JSON-lines file on this machine"
    if path.stat().st_size > ROW_COUNT_LIMIT:
        return None, f"{where} is over {ROW_COUNT_LIMIT // 1024**3} GiB"
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip()), where


def job_length(spec: JobSpec, rows: int | None = None) -> JobLength:
    """`training.steps`, else epochs over the rows (counted here, or `rows`: all sources together), as the runner
    counts them: eval_fraction held out (of each source), an epoch's last partial batch dropped, epochs x steps
    per epoch rounded up."""
    length = _steps(spec, rows)
    if spec.training.objective not in REFERENCE_OBJECTIVES:
        return length
    tokens, how = reference_tokens(spec, rows)
    return replace(length, reference_tokens=tokens, reference_how=how)


def reference_tokens(spec: JobSpec, rows: int | None = None) -> tuple[int | None, str]:
    """(tokens, where from) of the reference pass (DPO, IPO, KTO): every pair (KTO: record) of the training source
    (the held-out ones too: they share its records; `rows`: that source's pairs, as --rows gives them) and of
    `data.eval_path`, each pair two rows of max_seq_len tokens (an upper bound, as for the steps); None when the pairs
    cannot be counted here."""
    pairs, where = (rows, "--rows") if rows is not None else count_rows(spec)
    counts = [(pairs, where)]
    if spec.data.eval_path:
        counts.append(_count_file(spec.data.eval_path, "data.eval_path"))
    total, where = _total(counts)
    if total is None:
        return None, f"pairs unknown ({where}): pass --rows N"
    what = "records x 2 rows (with the KL row)" if spec.training.objective == "kto" else "pairs x 2 rows"
    return 2 * total * spec.data.max_seq_len, f"{total:,} {what} x {spec.data.max_seq_len} tokens"


def _steps(spec: JobSpec, rows: int | None) -> JobLength:
    tr = spec.training
    tokens = tr.global_batch * rows_per_sample(spec) * spec.data.max_seq_len
    if tr.steps is not None:
        return JobLength(tr.steps, tokens, f"training.steps {tr.steps:,}")
    where, held = "--rows", None
    if tr.objective == "grpo":  # every prompt is trained on: GRPO holds none out for eval (runner/data/prompts.py)
        held = 0
    if rows is None:
        counts = source_rows(spec)
        rows, where = _total(counts)
        if rows is not None and not spec.data.eval_path and held is None:  # the runner holds out int(n x fraction)
            held = sum(int((n or 0) * spec.data.eval_fraction) for n, _ in counts)
    epochs = tr.epochs or 1.0
    if rows is None:
        return JobLength(None, tokens, f"{epochs:g} epoch(s), rows unknown ({where}): pass --rows N")
    if held is None:
        held = 0 if spec.data.eval_path else int(rows * spec.data.eval_fraction)
    train = rows - held
    batches = train // tr.global_batch
    if batches < 1:
        few = f"{train:,} training rows ({where}) are fewer than global batch {tr.global_batch}"
        return JobLength(None, tokens, few)
    # GRPO's num_iterations: each batch of prompts trained that many steps (runner/data/dataset.py RepeatedOrder)
    repeat = tr.grpo.num_iterations if tr.objective == "grpo" and tr.grpo is not None else 1
    per_epoch = batches * repeat
    steps = max(1, math.ceil(epochs * per_epoch))
    note = _text_rows(spec) + (f", each batch {repeat} steps: training.grpo.num_iterations" if repeat > 1 else "")
    how = f"{epochs:g} epoch(s) x {per_epoch:,} steps ({train:,} training rows of {where} / global batch{note})"
    return JobLength(steps, tokens, how)


def _text_rows(spec: JobSpec) -> str:
    """What the row count misses for raw text: the runner cuts a document longer than max_seq_len into blocks (and
    packs them), so its rows are not the records counted here, and counting tokens needs the tokenizer."""
    d = spec.data
    if "text" not in (d.format, *(s.format for s in d.sources or [])):
        return ""
    return (f"; raw text: a document longer than max_seq_len {d.max_seq_len} is several rows (blocks) when loaded"
            f"{', then packed' if d.packing else ''}, so the runner's rows (logged at start) are not these records: "
            "pass --rows N with its count")  # fmt: skip
