"""Raw text longer than max_seq_len is cut into blocks, never truncated (issue 45): every token of every document after
its first (which nothing predicts) is a target exactly once, counted against the source tokenized by the same
tokenizer; with `data.text_overlap`, later blocks re-read that many tokens of context without scoring them again; with
packing, the blocks are packed as records are; streaming gives the same rows; the train/eval split is by document."""

from __future__ import annotations

import numpy as np
import pytest

from runner.data.dataset import load_data
from runner.data.stream import load_stream
from runner.data.tokenizer import ByteTokenizer, HFTokenizer
from runner.data.tokens import IGNORE, Blocks, block_spans
from tests.runner.data.test_stream import same_rows, streamed
from tests.runner.train_helpers import tiny_spec, write_jsonl

B = ByteTokenizer
SEQ = 64


def long_documents(n: int = 24) -> list[dict]:
    """Documents of 5 to ~400 characters: most longer than a row of 64 byte tokens, some exactly at its edges."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "seven", "red", "hens"]
    docs = [{"text": " ".join(words[(i + j) % len(words)] for j in range(1 + (i * 37) % 80))[: 5 + (i * 53) % 400]}
            for i in range(n)]  # fmt: skip
    edges = [SEQ - 2, SEQ - 1, SEQ, 2 * SEQ - 1]  # with BOS and EOS: 64, 65 (one row), 66 (two blocks), ...
    return docs + [{"text": ("x" * k)} for k in edges]


def source_targets(tokenizer, docs: list[dict]) -> list[np.ndarray]:
    """What training must score: each document tokenized alone, every token after its first."""
    return [ids[1:] for ids, _ in tokenizer.render_texts([d["text"] for d in docs])]


def trained_targets(rows) -> np.ndarray:
    """The labels of every row that carry a loss, row after row."""
    return np.concatenate([y[y != IGNORE] for _, y in rows])


def text_spec(tmp_path, path, **data):
    return tiny_spec(tmp_path / "run", data={"path": str(path), "format": "text", "max_seq_len": SEQ,
                                             "eval_fraction": 0, **data})  # fmt: skip


@pytest.mark.parametrize("overlap", [0, 1, 16, SEQ - 1])
@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
def test_every_token_of_every_document_is_trained_once(tmp_path, packing, overlap):
    docs = long_documents()
    want = source_targets(B(), docs)
    assert sum(len(t) + 1 > SEQ + 1 for t in want) >= 15  # most documents are longer than a row
    data = load_data(text_spec(tmp_path, write_jsonl(tmp_path / "t.jsonl", docs), packing=packing,
                               text_overlap=overlap), B())  # fmt: skip
    rows = data.train
    assert isinstance(rows.streams, Blocks) and rows.packed == packing
    assert all(len(x) <= SEQ for x, _ in rows)  # no row past max_seq_len positions
    got = trained_targets(rows)
    # The count the issue asks for, and more: the very tokens, in file order (rows keep the order of the blocks).
    assert len(got) == sum(len(t) for t in want)
    assert np.array_equal(got, np.concatenate(want))
    assert sum(data.collate([r]).targets for r in range(len(rows))) == len(got)  # what the loss divides by
    if not packing:  # each block after a document's first re-reads `overlap` tokens before its first target
        blocks = rows.streams
        later = blocks.context > 0
        assert (blocks.context[later] == overlap + 1).all() and later.sum() > 15
        for b in np.flatnonzero(later)[:10].tolist():
            _, y = rows[b]
            assert (y[:overlap] == IGNORE).all() and y[overlap] != IGNORE  # context not scored again
            tokens, before = blocks[b][0], blocks[b - 1][0]
            assert np.array_equal(tokens[: overlap + 1], before[len(before) - overlap - 1 :])  # read again


def test_packed_blocks_restart_positions_and_never_score_across_a_boundary(tmp_path):
    docs = long_documents(8)
    data = load_data(text_spec(tmp_path, write_jsonl(tmp_path / "t.jsonl", docs), text_overlap=8), B())
    rows = data.train
    for r in range(len(rows)):
        lengths = rows.record_lengths(r)
        batch = data.collate([r])
        pos, y = batch.position_ids[0].numpy(), batch.labels[0].numpy()
        starts = np.cumsum(lengths)[:-1]
        assert (pos[starts] == 0).all() and pos[0] == 0  # each block numbered from 0, as alone
        assert (y[starts - 1] == IGNORE).all()  # a block's first token is never the target of the one before


def test_a_hugging_face_tokenizer_and_the_cache(tmp_path, caplog):
    hf = HFTokenizer(B().to_hf(), "bytes-hf")  # no BOS of its own: a document's first byte is only read
    docs = long_documents(12)
    path = write_jsonl(tmp_path / "t.jsonl", docs)
    spec = text_spec(tmp_path, path, cache_dir=str(tmp_path / "cache"), text_overlap=5)
    first = load_data(spec, hf)
    want = np.concatenate(source_targets(hf, docs))
    assert np.array_equal(trained_targets(first.train), want)
    with caplog.at_level("INFO", logger="jobspec.runner"):
        caplog.clear()
        again = load_data(spec, hf)  # from the cache: whole documents, cut again when loaded
    assert "tokens from the cache" in caplog.text
    assert np.array_equal(trained_targets(again.train), want)
    other = load_data(text_spec(tmp_path, path, cache_dir=str(tmp_path / "cache"), text_overlap=0), hf)
    assert np.array_equal(trained_targets(other.train), want)  # the same entry, another overlap: still every token
    assert len(other.train) < len(again.train)  # fewer blocks without overlap


def test_the_eval_split_is_by_document(tmp_path):
    docs = long_documents(40)
    data = load_data(text_spec(tmp_path, write_jsonl(tmp_path / "t.jsonl", docs), eval_fraction=0.25,
                               packing=False), B())  # fmt: skip
    train, held = data.train.streams, data.eval.streams
    assert isinstance(train, Blocks) and isinstance(held, Blocks)
    assert not set(train.record.tolist()) & set(held.record.tolist())  # no document on both sides
    assert len(set(train.record.tolist()) | set(held.record.tolist())) == len(docs)
    scored = len(trained_targets(data.train)) + len(trained_targets(data.eval))
    assert scored == sum(len(t) for t in source_targets(B(), docs))


@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
def test_streamed_blocks_are_the_prepared_rows_and_resume_inside_a_document(tmp_path, packing):
    docs = long_documents()
    path = write_jsonl(tmp_path / "t.jsonl", docs)
    prepared = load_data(text_spec(tmp_path, path, packing=packing, text_overlap=4), B()).train
    stream = {"streaming": True, "shuffle_buffer": 0, "packing": packing, "text_overlap": 4}
    spec = tiny_spec(tmp_path / "run", data={"path": str(path), "format": "text", "max_seq_len": SEQ, **stream},
                     training={"global_batch": 4, "steps": 50})  # fmt: skip
    steps = len(prepared) // 4
    data = load_stream(spec, B())
    try:
        same_rows(streamed(data, range(steps)), list(prepared)[: 4 * steps])
    finally:
        data.close()
    # A restart at a step whose first sample starts inside a document: read from the index, the same rows.
    from runner.data import stream as stream_mod

    every = stream_mod.INDEX_EVERY
    try:
        stream_mod.INDEX_EVERY = 1  # an entry for every sample: most start at a block after a document's first
        data = load_stream(spec, B())
        try:
            streamed(data, range(steps))  # writes the index
        finally:
            data.close()
        data = load_stream(spec, B())
        try:
            late = range(steps // 2, steps)
            same_rows(streamed(data, late), list(prepared)[4 * late.start : 4 * steps])
        finally:
            data.close()
    finally:
        stream_mod.INDEX_EVERY = every


def test_block_spans_cover_each_target_once():
    for n in [2, 64, 65, 66, 129, 130, 500]:
        for overlap in [0, 3, 63]:
            record, start, end, context = block_spans(np.array([n]), SEQ, overlap)
            assert ((end - start) <= SEQ + 1).all() and (record == 0).all()
            scored = np.concatenate([np.arange(a + max(c, 1), b) for a, b, c in zip(start, end, context, strict=True)])
            assert np.array_equal(scored, np.arange(1, n))  # targets 1..n-1, once each, in order
    with pytest.raises(ValueError, match="leaves no new token"):
        block_spans(np.array([200]), SEQ, SEQ)
