"""GRPO's sampling: the Gumbel-max draw of each completion's generator is a draw from softmax(logits / T), its seed
is the completion's own, and the generation prompt is what TRL's GRPOTrainer samples after."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.data.tokenizer import ByteTokenizer, HFTokenizer
from runner.rl.sampling import GumbelNoise, completion_seed, penalize, truncate
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


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(5, 1.0, None), (0, 0.9, None), (0, 1.0, 0.1),
                                                       (20, 0.8, 0.05), (1, 0.5, 0.5), (3, 1.0, None)])
def test_top_k_top_p_and_min_p_leave_out_what_transformers_warpers_do(top_k, top_p, min_p):
    """The tokens left out (at -inf) are those transformers' TopK, TopP and MinP warpers, in generate's order after
    the temperature, leave out: on random scores with ties (rounded to a tenth), rows of 50 tokens."""
    from transformers import LogitsProcessorList, MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(top_k + int(top_p * 10))
    scores = (torch.randn(64, 50, generator=g) * 3).round(decimals=1)
    warpers = LogitsProcessorList([w for w in (TopKLogitsWarper(top_k) if top_k else None,
                                               TopPLogitsWarper(top_p) if top_p < 1 else None,
                                               MinPLogitsWarper(min_p) if min_p else None) if w])  # fmt: skip
    theirs = warpers(torch.zeros(64, 1, dtype=torch.long), scores.clone())
    ours = truncate(scores, top_k, top_p, min_p)
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert torch.equal(ours[~ours.isinf()], scores[~ours.isinf()])
    drawn = GumbelNoise(list(range(64)), 1.0, torch.device("cpu"), top_k=top_k, top_p=top_p, min_p=min_p)(
        torch.zeros(64, 1, dtype=torch.long), scores.clone()).argmax(-1)  # fmt: skip
    assert not theirs.gather(1, drawn[:, None]).isinf().any()  # every draw is a token the warpers keep


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_the_repetition_penalty_is_transformers_and_comes_before_the_temperature_and_filters(penalty):
    """Scores of the tokens a row already holds (repeated ones, padding included) are what transformers'
    RepetitionPenaltyLogitsProcessor makes; in the sampler the penalty precedes the temperature and top-k, as
    generate's processors precede its warpers."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,  # fmt: skip
    )

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(8, 40, generator=g) * 3
    ids = torch.randint(0, 40, (8, 12), generator=g)
    ids[:, :3] = 0  # left padding: id 0, penalised like any other token, as transformers does
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores.clone())
    torch.testing.assert_close(penalize(scores, ids, penalty), theirs, rtol=0, atol=0)
    assert torch.equal(penalize(scores, ids, 1.0), scores)
    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(0.7),
                                 TopKLogitsWarper(5)])  # fmt: skip
    kept = chain(ids, scores.clone())
    noise = GumbelNoise(list(range(8)), 0.7, torch.device("cpu"), top_k=5, repetition_penalty=penalty)
    ours = noise(ids, scores.clone())
    assert torch.equal(ours.isinf(), kept.isinf())
    drawn = ours.argmax(-1)
    assert not kept.gather(1, drawn[:, None]).isinf().any()


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


def test_the_sampling_filters_join_the_lineage_only_where_set(tmp_path):
    """A GRPO run from before top_k, top_p and min_p existed resumes as it was (they are left out at their defaults);
    set, they are part of training.grpo's lineage, which a resume must find unchanged."""
    from runner.checkpoint.lineage import lineage

    def grpo(**extra):
        data = th.write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1"}])
        sampling = {"num_generations": 2, "max_completion_length": 8, "rewards": [{"kind": "length"}], **extra}
        return th.tiny_spec(tmp_path / "run", data={"path": str(data), "max_seq_len": 40},
                            training={"objective": "grpo", "grpo": sampling})  # fmt: skip

    plain = lineage(grpo(), [])["training.grpo"]
    assert not {"top_k", "top_p", "min_p"} & set(plain)
    assert not {"top_k", "top_p", "min_p", "repetition_penalty"} & set(plain)
    assert lineage(grpo(top_k=20, top_p=0.95), [])["training.grpo"] == {**plain, "top_k": 20, "top_p": 0.95}
    assert lineage(grpo(repetition_penalty=1.1), [])["training.grpo"] == {**plain, "repetition_penalty": 1.1}
