"""`data.text_overlap` in the spec: a bad value or a format it does not apply to is refused at its line, with the
field and the fix, exit 2 and no traceback; a good one loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobspec.spec.loader import load_spec
from tests.cli_helpers import refused_at_line

HEAD = """name: text
model:
  preset: tiny
training:
  global_batch: 8
  epochs: 1
hardware:
  vendor: cpu
data:
"""

BAD = {  # data section -> (field, line, words in the message)
    "negative": ("  format: text\n  text_overlap: -1\n", "data.text_overlap", 11, "greater than or equal to 0"),
    "the row": ("  format: text\n  max_seq_len: 64\n  text_overlap: 64\n", "data", 9,
                "must be below `data.max_seq_len: 64`"),
    "past the row": ("  format: text\n  text_overlap: 4096\n", "data", 9, "must be below `data.max_seq_len: 512`"),
    "not a number": ("  format: text\n  text_overlap: some\n", "data.text_overlap", 11, "integer"),
    "chat data": ("  format: messages\n  text_overlap: 8\n", "data", 9, "set `data.format: text`"),
    "auto": ("  text_overlap: 8\n", "data", 9, "applies to raw text only"),
}  # fmt: skip


def write(tmp_path: Path, data: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(HEAD + data)
    return path


@pytest.mark.parametrize("case", sorted(BAD), ids=str)
def test_a_bad_overlap_is_refused_with_the_field_and_the_fix(case, tmp_path, capsys):
    data, field, line, words = BAD[case]
    path = write(tmp_path, data)
    assert "text_overlap" in refused_at_line(path, field, line, words, capsys)


def test_good_overlaps_load(tmp_path):
    assert load_spec(write(tmp_path, "  format: text\n")).data.text_overlap == 0  # the default: cut, no overlap
    assert load_spec(write(tmp_path, "  format: text\n  max_seq_len: 64\n  text_overlap: 63\n")).data.text_overlap == 63
    mixed = "  sources:\n    - {path: a.jsonl, format: text}\n    - {path: b.jsonl}\n  text_overlap: 16\n"
    assert load_spec(write(tmp_path, mixed)).data.text_overlap == 16  # a text source among others
