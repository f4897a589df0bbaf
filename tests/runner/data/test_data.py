"""Data: tokenizers, record formats, prompt masking, truncation, packing, eval split and step order."""

from __future__ import annotations

import numpy as np
import pytest

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec
from runner.data.dataset import (
    BUNDLED,
    IGNORE,
    DataOrder,
    encode_file,
    load_data,
    micro_batches,
    pack,
    rank_slice,
    total_steps,
)
from runner.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.runner.train_helpers import CHAT, save_test_tokenizer, tiny_spec, write_jsonl


def test_byte_tokenizer_targets_are_the_replies_and_their_eos():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    segments = tok.render(CHAT)
    targets = [ids for ids, is_target in segments if is_target]
    assert targets == [[*b"yo", tok.EOS], [*b"ok", tok.EOS]]
    prompt = [t for ids, is_target in segments if not is_target for t in ids]
    assert prompt[0] == tok.BOS and tok.ASSISTANT in prompt and tok.EOS not in prompt


def test_rows_are_shifted_and_masked_on_the_prompt(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "abc", "response": "XY"}])
    spec = DataSpec(path=str(path), max_seq_len=64)
    ids, flags = encode_file(path, spec, ByteTokenizer())[0]
    x, y = ids[:-1], np.where(flags[1:], ids[1:], IGNORE)
    # <bos> a b c <assistant> X Y <eos>: the model is scored on predicting X, Y and <eos> only
    assert ByteTokenizer().decode(ids) == "abcXY"
    assert [int(t) for t in y if t != IGNORE] == [*b"XY", ByteTokenizer.EOS]
    assert len(x) == len(y) == len(ids) - 1


def test_format_detection_and_errors_name_the_line(tmp_path):
    tok = ByteTokenizer()
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    assert len(encode_file(chat, DataSpec(), tok)) == 1
    custom = write_jsonl(tmp_path / "qa.jsonl", [{"q": "1+1", "a": "2"}])
    assert len(encode_file(custom, DataSpec(prompt_field="q", response_field="a"), tok)) == 1
    with pytest.raises(ConfigError, match=r"qa.jsonl:1: cannot tell the record format"):
        encode_file(custom, DataSpec(), tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        encode_file(bad, DataSpec(), tok)
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": "a", "response": 3}])
    with pytest.raises(ConfigError, match=r"wrong.jsonl:2: .*must both be strings"):
        encode_file(wrong, DataSpec(), tok)


def test_truncation_drops_records_without_targets(tmp_path):
    rows = [{"prompt": "p" * 100, "response": "lost"}, {"prompt": "short", "response": "kept"}] * 8
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    spec = tiny_spec(tmp_path, data={"path": str(path), "max_seq_len": 32, "eval_fraction": 0.0})
    data = load_data(spec, ByteTokenizer())
    assert len(data.train) == 8  # the long prompts leave no response token within 32 positions
    assert all(len(x) <= 32 for x, _ in data.train)


def test_packing_keeps_every_target_and_the_length_limit(tmp_path):
    tok = ByteTokenizer()
    streams = encode_file(BUNDLED, DataSpec(max_seq_len=64), tok)[:200]
    rows = pack(streams, 64)
    assert len(rows) < len(streams) / 2  # short records: several per row
    assert all(len(x) == len(y) <= 64 for x, y in rows)
    targets = sum(int(f[1:].sum()) for _, f in streams)
    assert sum(int((y != IGNORE).sum()) for _, y in rows) == targets


def test_eval_split_is_seeded_and_disjoint(tmp_path):
    spec = tiny_spec(tmp_path, data={"eval_fraction": 0.1})
    a, b = load_data(spec, ByteTokenizer()), load_data(spec, ByteTokenizer())
    assert len(a.eval) == 400 and len(a.train) == 3600
    assert all(np.array_equal(x1, x2) for (x1, _), (x2, _) in zip(a.eval, b.eval, strict=True))
    train = {x.tobytes() for x, _ in a.train}
    assert not any(x.tobytes() in train for x, _ in a.eval)  # the bundled set has no duplicate records
    other = load_data(tiny_spec(tmp_path, data={"eval_fraction": 0.1}, training={"seed": 7}), ByteTokenizer())
    assert not all(np.array_equal(x1, x2) for (x1, _), (x2, _) in zip(a.eval, other.eval, strict=True))


def test_collate_pads_right_to_a_multiple_of_8(tmp_path):
    data = load_data(tiny_spec(tmp_path), ByteTokenizer())
    batch = data.collate([0, 1, 2])
    longest = max(len(data.train[i][0]) for i in range(3))
    assert batch.input_ids.shape == (3, -(-longest // 8) * 8)
    assert batch.targets == int((batch.labels != IGNORE).sum())
    assert batch.tokens == sum(len(data.train[i][0]) for i in range(3))
    assert (batch.labels[0, len(data.train[0][0]) :] == IGNORE).all()


def test_step_samples_is_a_pure_function_of_seed_epoch_and_step():
    order = DataOrder(num_rows=100, global_batch=8, seed=3)
    assert order.steps_per_epoch == 12
    late = order.step_samples(30)  # asked out of order, from a fresh object: the same answer
    assert DataOrder(100, 8, 3).step_samples(30) == late
    epoch0 = [i for s in range(12) for i in order.step_samples(s)]
    assert len(set(epoch0)) == 96  # no row twice in an epoch; the last 4 are dropped
    assert order.step_samples(12) != order.step_samples(0)  # a new permutation each epoch
    assert DataOrder(100, 8, 4).step_samples(0) != order.step_samples(0)
    ids = order.step_samples(5)
    shares = [rank_slice(ids, r, 2) for r in range(2)]
    assert shares[0] + shares[1] == ids
    chunks = micro_batches(shares[0], 2)
    assert len(chunks) == 2 and chunks[0] + chunks[1] == shares[0]
    with pytest.raises(ConfigError, match="larger than the 5 training rows"):
        DataOrder(5, 8, 0)


def test_epochs_set_the_number_of_steps(tmp_path):
    spec = tiny_spec(tmp_path, training={"steps": None, "epochs": 0.5, "warmup_steps": 0})
    assert total_steps(spec, DataOrder(100, 8, 0)) == 6


def test_hf_tokenizer_from_a_local_dir_uses_its_chat_template(tmp_path):
    save_test_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path), model_vocab=1000)
    assert isinstance(tok, HFTokenizer) and tok.has_template
    segments = tok.render(CHAT)
    text = [tok.tok.decode(ids) for ids, target in segments if target]
    assert [t.replace(" ", "") for t in text] == ["yo<|end|>", "ok<|end|>"]
