"""GRPO's sampling: the Gumbel-max draw of each completion's generator is a draw from softmax(logits / T), its seed
is the completion's own, and the generation prompt is what TRL's GRPOTrainer samples after."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.data.tokenizer import ByteTokenizer, HFTokenizer
from runner.rl.sampling import GumbelNoise, completion_seed
from tests.runner import train_helpers as th


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gumbel_max_draws_follow_the_tempered_softmax(temperature):
    """4,000 rows, each its own generator, over 5 tokens: every token's frequency within 3 standard errors of
    softmax(logits / T); a token at -inf never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    n = 4000
    noise = GumbelNoise([completion_seed(7, 0, i, 0) for i in range(n)], temperature, torch.device("cpu"))
    drawn = noise(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, -1).clone()).argmax(-1)
    freq = torch.bincount(drawn, minlength=5).double() / n
    p = torch.softmax(logits.double() / temperature, 0)
    se = torch.sqrt(p * (1 - p) / n)
    assert freq[4] == 0
    assert torch.all((freq - p).abs() <= 3 * se + 1e-9), (freq, p)


def test_each_completion_has_its_own_seed_and_its_own_stream():
    seeds = {completion_seed(42, s, p, g) for s in range(3) for p in range(20) for g in range(8)}
    assert len(seeds) == 3 * 20 * 8 and all(0 <= s < 2**63 for s in seeds)
    scores = torch.zeros(2, 50)
    a = GumbelNoise([11, 12], 1.0, torch.device("cpu"))(torch.zeros(2, 1), scores)
    b = GumbelNoise([12, 11], 1.0, torch.device("cpu"))(torch.zeros(2, 1), scores)
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0])  # a row's noise is its seed's, wherever it sits


def test_the_generation_prompt_is_trls(tmp_path):
    """A chat through the template with its generation prompt (what `apply_chat_template(add_generation_prompt=True)`
    gives); a text as it is, with the tokenizer's own special tokens; the byte tokenizer ends a chat on its assistant
    token."""
    from transformers import AutoTokenizer

    th.save_test_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    ours = HFTokenizer(tok, str(tmp_path / "tok"))
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 2?"}]
    want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ours.generation_prompt(chat) == list(want)
    assert ours.generation_prompt("Question: 2 + 2 =") == tok("Question: 2 + 2 =")["input_ids"]
    b = ByteTokenizer()
    ids = b.generation_prompt([{"role": "user", "content": "hi"}])
    assert ids == [b.BOS, b.USER, *b"hi", b.ASSISTANT]
    assert b.generation_prompt("hi") == [b.BOS, *b"hi"]
    assert np.array_equal(b.decode([*b"ok", b.EOS]), "ok")
