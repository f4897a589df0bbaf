"""The stream's position index as another job may leave it (issue 32, items 2 and 3): a forged entry that points at
other samples, one that leads the reader past the file or into the middle of a line, an entry of another index,
deep nesting and numbers past any bound are logged and the stream replayed from the start: the resumed samples are
the uninterrupted run's, never a stop that blames the data file, never a traceback."""

from __future__ import annotations

import json
import logging

import pytest

from jobspec.shared_dir import signing
from runner.data.stream import load_stream
from runner.data.tokenizer import ByteTokenizer
from tests.runner.data.test_stream import GB, chat_rows, same_rows, stream_spec, streamed
from tests.runner.train_helpers import write_jsonl

KEY = "stream-" + "0123456789abcdef" * 4


@pytest.fixture
def indexed(tmp_path):
    """(spec, the uninterrupted rows of steps 0..39, the index path, its entries) of a 400-record stream."""
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(400))
    spec = stream_spec(tmp_path, path, packing=True, shuffle_buffer=0)
    full = load_stream(spec, ByteTokenizer())
    want = streamed(full, range(40))
    full.close()
    index = full.streams[0].index.path
    entries = [json.loads(line) for line in index.read_text().splitlines()]
    assert len(entries) >= 2 and all(e["i"] == index.stem and len(e["h"]) == 16 for e in entries)
    return spec, want, index, entries


def _resumed(spec, want, caplog) -> str:
    again = load_stream(spec, ByteTokenizer(), write_index=False)
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        try:
            same_rows(streamed(again, range(35, 40)), want[35 * GB :])
        finally:
            again.close()
    return caplog.text


def _forged(entries, **change):
    return [entries[0], {**entries[1], **change}]


@pytest.mark.parametrize(
    ("change", "logged"),
    [({"q": 1}, "does not match the data"), ({"off": 10**9}, "does not match the data"),
     ({"off": 7}, "does not match the data"), ({"h": "0" * 16}, "does not match the data"),
     ({"i": "another"}, "not its own"), ({"w": 1 << 60}, ""), ({"line": 10**15}, "")],
    ids=["other-place", "past-the-file", "mid-line", "other-tokens", "foreign", "out-of-bounds", "line-only"],
)  # fmt: skip
def test_a_forged_or_foreign_entry_replays_the_stream(indexed, caplog, change, logged):
    """The forger keeps the entry's token count and digest; the samples resumed are the run's own whatever the entry
    says (an out-of-bounds number drops the entry; a wrong line number only words an error message)."""
    spec, want, index, entries = indexed
    index.write_text("".join(json.dumps(e) + "\n" for e in _forged(entries, **change)))
    assert logged in _resumed(spec, want, caplog)


def test_an_entry_copied_from_sample_0s_under_another_sample_number_replays_the_stream(indexed, caplog):
    """Sample 0's entry (its place, token count and digest) copied with a later sample number: its digest held the
    tokens only, so the check passed and the stream resumed there at the wrong sample. The digest binds the sample
    number and place now."""
    spec, want, index, entries = indexed
    first = entries[0]
    assert first["c"] == 0
    copied = {**first, "c": entries[1]["c"]}
    index.write_text("".join(json.dumps(e) + "\n" for e in (first, copied)))
    assert "does not match the data" in _resumed(spec, want, caplog)


def test_a_stale_index_is_noticed_and_the_stream_replayed(indexed, caplog):
    spec, want, index, entries = indexed
    stale = {**entries[1], "n": entries[1]["n"] + 1}  # the row there no longer has this length
    index.write_text("\n".join([json.dumps(entries[0]), json.dumps(stale), "{torn"]) + "\n")
    assert "does not match the data" in _resumed(spec, want, caplog)


@pytest.mark.parametrize(
    "junk",
    ["[" * 100_000 + "]" * 100_000, '{"c":' * 5000 + "1" + "}" * 5000, '{"c": ' + "9" * 5000 + "}",
     '{"c": 1e999, "e": 0}', "\x00\xff" * 1000, "[]\n" * 10_000],
)  # fmt: skip
def test_a_damaged_index_is_skipped_line_by_line_never_a_traceback(indexed, caplog, junk):
    spec, want, index, entries = indexed
    index.write_text(junk + "\n" + json.dumps(entries[0]) + "\n", errors="surrogateescape")
    _resumed(spec, want, caplog)


def test_with_a_key_index_entries_are_signed_and_unsigned_ones_ignored(indexed, caplog, monkeypatch):
    spec, want, index, _ = indexed  # written without the key
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    assert "not its own" in _resumed(spec, want, caplog)
    index.unlink()
    full = load_stream(spec, ByteTokenizer())
    streamed(full, range(40))
    full.close()
    signed = [json.loads(line) for line in index.read_text().splitlines()]
    assert all(signing.FIELD in e for e in signed)
    caplog.clear()
    assert "not its own" not in _resumed(spec, want, caplog)
    forged = {**signed[1], "q": signed[1]["q"] + 1}  # a signed entry changed without the key
    index.write_text("".join(json.dumps(e) + "\n" for e in (signed[0], forged)))
    caplog.clear()
    assert "not its own" in _resumed(spec, want, caplog)
