"""Raw text for continued pretraining (`data.format: text`): each {"text"} record is <bos> document <eos>, every token
a target, packed by default with attention and positions confined to each document; the same files, cache, mixing and
streaming as SFT; and a tiny model's loss falls on it."""

from __future__ import annotations

import numpy as np
import pytest

from jobspec.contract import EXIT_OK
from jobspec.errors import ConfigError
from runner.data.dataset import encode_file, load_data
from runner.data.preference import load_preference
from runner.data.stream import load_stream
from runner.data.tokenizer import ByteTokenizer, HFTokenizer
from runner.data.tokens import IGNORE
from tests.runner.data.test_data_formats import WRITERS
from tests.runner.data.test_stream import reference_rows, same_rows, streamed
from tests.runner.train_helpers import records, tiny_spec, train_in_process, write_jsonl

B = ByteTokenizer


def documents(n: int = 40) -> list[dict]:
    words = ["red", "quick", "brown", "slow", "green"]
    return [{"text": f"the {words[i % 5]} fox {i} jumps over the lazy dog."[: 12 + (7 * i) % 40]} for i in range(n)]


def text_spec(tmp_path, path, **data):
    return tiny_spec(tmp_path / "run", data={"path": str(path), "format": "text", "max_seq_len": 64, **data})


def test_a_packed_batch_is_every_documents_tokens_each_scored_and_seeing_only_itself(tmp_path):
    docs = documents()
    spec = text_spec(tmp_path, write_jsonl(tmp_path / "t.jsonl", docs), eval_fraction=0)
    assert spec.data.packing  # the default with format text
    data = load_data(spec, B())
    assert data.train.packed and len(data.train) < len(docs)
    rows, seen = data.train, []
    for r in range(len(rows)):
        batch = data.collate([r])
        x, y, pos = (t[0].numpy() for t in (batch.input_ids, batch.labels, batch.position_ids))
        ks = rows.records[rows.groups[r] : rows.groups[r + 1]]
        docs_in_row = [rows.streams[int(k)][0] for k in ks]
        seen += docs_in_row
        tokens = np.concatenate(docs_in_row)
        n = len(tokens) - 1  # positions: token t is read at t and scored on token t+1
        starts = np.cumsum([0] + [len(d) for d in docs_in_row])[:-1]
        want_y = tokens[1:].copy()
        want_y[starts[1:] - 1] = IGNORE  # a document's first token is never the target of the one before
        assert np.array_equal(x[:n], tokens[:-1]) and np.array_equal(y[:n], want_y)
        assert (y[n:] == IGNORE).all()  # padding
        assert np.array_equal(pos[:n], np.concatenate([np.arange(len(d)) for d in docs_in_row])[:n])  # restart at 0
        assert batch.targets == n - (len(docs_in_row) - 1)
    want = [np.array([B.BOS, *d["text"].encode(), B.EOS]) for d in docs]  # every token of every document, in order
    assert len(seen) == len(want) and all(np.array_equal(a, b) for a, b in zip(seen, want, strict=True))


@pytest.mark.parametrize("writer", ["parquet", "dataset"])
def test_parquet_and_datasets_columns_give_the_jsonl_rows(tmp_path, writer):
    docs = [{**d, "id": i} for i, d in enumerate(documents(12))]
    a = load_data(text_spec(tmp_path, write_jsonl(tmp_path / "t.jsonl", docs)), B())
    b = load_data(text_spec(tmp_path, WRITERS[writer](tmp_path, docs)), B())
    assert len(a.train) == len(b.train) > 0
    assert all(np.array_equal(p[0], q[0]) and np.array_equal(p[1], q[1]) for p, q in zip(a.train, b.train, strict=True))


def test_detected_named_by_field_packing_can_be_turned_off_and_bad_records_refused(tmp_path):
    auto = tiny_spec(tmp_path / "run", data={"path": str(write_jsonl(tmp_path / "a.jsonl", documents(6))),
                                             "eval_fraction": 0, "packing": False})  # fmt: skip
    assert not auto.data.packing
    rows = load_data(auto, B()).train  # format auto: a record with only a text is text; one row per document
    assert len(rows) == 6 and (rows[0][1] != IGNORE).all()
    body = write_jsonl(tmp_path / "b.jsonl", [{"body": d["text"]} for d in documents(6)])
    named = load_data(text_spec(tmp_path, body, text_field="body", eval_fraction=0, packing=False), B()).train
    assert all(np.array_equal(p[0], q[0]) for p, q in zip(rows, named, strict=True))
    bad = write_jsonl(tmp_path / "bad.jsonl", [documents(1)[0], {"text": 3}])
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: 'text' is of type int: .* must be a string \(format text\)"):
        load_data(text_spec(tmp_path, bad), B())
    with pytest.raises(ConfigError, match=r"chat\.jsonl:1: 'text' is missing"):
        load_data(text_spec(tmp_path, write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "a", "response": "b"}])), B())
    with pytest.raises(ConfigError, match="needs preference pairs"):
        load_preference(tiny_spec(tmp_path / "run", data={"path": str(body), "format": "text", "text_field": "body"},
                            training={"objective": "dpo"}), B())  # fmt: skip


def test_cached_mixed_and_streamed_like_sft(tmp_path, caplog):
    text = write_jsonl(tmp_path / "t.jsonl", documents(60))
    chat = write_jsonl(tmp_path / "c.jsonl", [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(30)])
    cache = str(tmp_path / "cache")
    first = load_data(text_spec(tmp_path, text, cache_dir=cache), B())
    with caplog.at_level("INFO", logger="jobspec.runner"):
        caplog.clear()  # the first load's lines too, where an earlier test left the logger at INFO
        again = load_data(text_spec(tmp_path, text, cache_dir=cache), B())
    assert "tokens from the cache" in caplog.text and "tokenizing once" not in caplog.text
    same_rows(list(first.train), list(again.train))
    # several sources: a text source beside a chat one, each by its own format, mixed by weight
    sources = [{"path": str(text), "format": "text", "weight": 3}, {"path": str(chat), "weight": 1}]
    mixed = load_data(tiny_spec(tmp_path / "run", data={"sources": sources, "max_seq_len": 64, "packing": True}), B())
    lo, hi = mixed.offsets[:2]
    texts = [mixed.train[i] for i in range(lo, hi)]
    assert all((y[: len(y) - 1] != IGNORE).sum() >= len(y) - 8 for _, y in texts)  # nearly every token a target
    assert any((y == IGNORE).sum() > 2 for _, y in (mixed.train[i] for i in range(hi, mixed.offsets[2])))  # prompts
    # streamed: the prepared path's packed rows, in order
    streaming = {"path": str(text), "format": "text", "streaming": True, "max_seq_len": 64, "shuffle_buffer": 0}
    spec = tiny_spec(tmp_path / "run", data=streaming, training={"global_batch": 4, "steps": 5})
    ref = reference_rows(spec)
    data = load_stream(spec, B())
    try:
        same_rows(streamed(data, range(3)), ref[:12])
    finally:
        data.close()
    assert len(encode_file(text, spec.data, B())) == 60


def test_a_hugging_face_tokenizer_adds_its_specials_and_one_eos():
    hf = HFTokenizer(B().to_hf(), "bytes-hf")
    (ids, flags), (end, _) = hf.render_texts(["ab", "c<|eos|>"])
    assert ids.tolist() == [97, 98, B.EOS] and flags.all()
    assert end.tolist() == [99, B.EOS]  # a document that ends with EOS keeps one


def test_continued_pretraining_on_cpu_lowers_the_loss(tmp_path):
    spec = tiny_spec(tmp_path / "run", data={"path": str(write_jsonl(tmp_path / "t.jsonl", documents())),
                                             "format": "text", "max_seq_len": 64},
                     training={"steps": 10, "global_batch": 4, "learning_rate": 3e-3})  # fmt: skip
    assert train_in_process(spec)[0] == EXIT_OK
    losses = [r["loss"] for r in records(tmp_path / "run")]
    assert losses[-1] < 0.75 * losses[0], losses
