"""`jobspec plan` over raw text (`data.format: text`): it counts records, and says that the runner's rows are not
them (a document longer than max_seq_len is several blocks), so its step count is not the runner's."""

from __future__ import annotations

from jobspec.plan.job_length import job_length
from jobspec.spec.loader import parse_spec
from tests.test_text_overlap import HEAD


def test_the_plan_says_raw_text_rows_are_not_the_records(tmp_path):
    docs = tmp_path / "t.jsonl"
    docs.write_text('{"text": "a document"}\n' * 40)
    text = job_length(parse_spec(HEAD + f"  path: {docs}\n  format: text\n  eval_fraction: 0\n"))
    assert text.steps == 5 and "several rows (blocks)" in text.how and "--rows" in text.how
    chat = job_length(parse_spec(HEAD + f"  path: {docs}\n  eval_fraction: 0\n"))
    assert chat.steps == 5 and "blocks" not in chat.how
