"""Preference pairs in TRL's layouts, the implicit prompt included (runner/data/pairs.py), checked against TRL."""

from __future__ import annotations

import numpy as np
import pytest

from runner.data.pairs import implicit_prompt
from runner.data.preference import load_preference
from runner.data.tokenizer import ByteTokenizer
from tests.runner.train.test_dpo import dpo
from tests.runner.train_helpers import write_jsonl

HH = [  # Anthropic HH-RLHF's layout: whole dialogues, the prompt implicit in both
    {"chosen": f"\n\nHuman: colour {i}?\n\nAssistant: blue {i}.",
     "rejected": f"\n\nHuman: colour {i}?\n\nAssistant: no."}
    for i in range(6)
]


@pytest.mark.parametrize("chosen, rejected", [
    (HH[0]["chosen"], HH[0]["rejected"]), ("The sky is blue.", "The sky is green."), ("abc", "xyz"),
    ("same answer here", "same answer there"), ("a b", "a bc"),
])  # fmt: skip
def test_the_implicit_prompt_is_split_as_trl_splits_it(chosen, rejected):
    extract_prompt = pytest.importorskip("trl.data_utils").extract_prompt
    trl = extract_prompt({"chosen": chosen, "rejected": rejected})
    assert implicit_prompt(chosen, rejected) == (trl["prompt"], trl["chosen"], trl["rejected"])


def test_implicit_prompt_pairs_load_like_explicit_ones(tmp_path):
    explicit = [dict(zip(("prompt", "chosen", "rejected"), implicit_prompt(r["chosen"], r["rejected"]), strict=True))
                for r in HH]  # fmt: skip
    tok = ByteTokenizer()
    a = load_preference(dpo(tmp_path / "a", write_jsonl(tmp_path / "hh.jsonl", HH)), tok)
    b = load_preference(dpo(tmp_path / "b", write_jsonl(tmp_path / "explicit.jsonl", explicit)), tok)
    assert len(a.train) == len(b.train) > 0
    for k in range(len(a.train)):
        ids_a, labels_a = a.train[k][:2]
        ids_b, labels_b = b.train[k][:2]
        assert np.array_equal(ids_a, ids_b) and np.array_equal(labels_a, labels_b)


def test_a_text_prompt_beside_dialogues_is_taken_once(tmp_path):
    """UltraFeedback-binarized's layout: `prompt` as text, `chosen`/`rejected` whole dialogues that open with it; and a
    text prompt beside answer-only lists, which it is put before."""
    user = [{"role": "user", "content": "colour?"}]
    uf = [{"prompt": "colour?", "chosen": [*user, {"role": "assistant", "content": f"blue {i}"}],
           "rejected": [*user, {"role": "assistant", "content": "no"}], "score_chosen": 8.0} for i in range(6)]
    bare = [{"prompt": "colour?", "chosen": [{"role": "assistant", "content": f"blue {i}"}],
             "rejected": [{"role": "assistant", "content": "no"}]} for i in range(6)]
    listed = [{"prompt": user, "chosen": r["chosen"], "rejected": r["rejected"]} for r in bare]  # fmt: skip
    tok = ByteTokenizer()
    loaded = [load_preference(dpo(tmp_path / name, write_jsonl(tmp_path / f"{name}.jsonl", rows)), tok)
              for name, rows in (("uf", uf), ("bare", bare), ("listed", listed))]  # fmt: skip
    for other in loaded[1:]:
        assert len(other.train) == len(loaded[0].train) > 0
        for k in range(len(other.train)):
            assert all(np.array_equal(a, b) for a, b in zip(loaded[0].train[k][:2], other.train[k][:2], strict=True))


def _turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


@pytest.mark.parametrize("chosen, rejected", [
    ([_turn("user", "sky?"), _turn("assistant", "blue")], [_turn("user", "sky?"), _turn("assistant", "green")]),
    ([_turn("user", "a"), _turn("assistant", "b"), _turn("user", "c"), _turn("assistant", "d")],
     [_turn("user", "a"), _turn("assistant", "b"), _turn("user", "c"), _turn("assistant", "e")]),
    ([_turn("assistant", "x")], [_turn("assistant", "y")]),
    ([_turn("user", "q"), _turn("assistant", "same")], [_turn("user", "q"), _turn("assistant", "same"),
                                                       _turn("user", "more"), _turn("assistant", "z")]),
])  # fmt: skip
def test_the_implicit_prompt_of_dialogues_is_split_as_trl_splits_it(chosen, rejected):
    from runner.data.pairs import implicit_turns

    extract_prompt = pytest.importorskip("trl.data_utils").extract_prompt
    trl = extract_prompt({"chosen": chosen, "rejected": rejected})
    assert implicit_turns(chosen, rejected) == (trl["prompt"], trl["chosen"], trl["rejected"])


def test_a_multi_turn_prompts_replies_are_not_scored(tmp_path):
    """hh-rlhf's conversational layout: the prompt holds earlier turns, replies of the assistant among them. TRL scores
    only the completion: the prompt's replies are no targets, so a pair's log-probs, SimPO's average and ORPO's NLL
    are the completion's. Dialogues with the prompt implicit (no `prompt`) load the same."""
    history = [_turn("user", "hi"), _turn("assistant", "hello there"), _turn("user", "sky?")]
    explicit = [{"prompt": history, "chosen": [_turn("assistant", f"blue {i}")],
                 "rejected": [_turn("assistant", "green")]} for i in range(6)]  # fmt: skip
    implicit = [{"chosen": [*history, *r["chosen"]], "rejected": [*history, *r["rejected"]]} for r in explicit]
    tok = ByteTokenizer()
    loaded = [load_preference(dpo(tmp_path / name, write_jsonl(tmp_path / f"{name}.jsonl", rows)), tok)
              for name, rows in (("explicit", explicit), ("implicit", implicit))]  # fmt: skip
    for k in range(len(loaded[0].train)):
        ids, labels = loaded[0].train[k][:2]
        scored = bytes(int(t) for t in ids[labels >= 0] if t < 256).decode()  # the byte tokenizer's text tokens
        assert "hello there" not in scored and ("blue" in scored or "green" in scored), scored
        assert all(np.array_equal(a, b) for a, b in zip(loaded[0].train[k][:2], loaded[1].train[k][:2], strict=True))
