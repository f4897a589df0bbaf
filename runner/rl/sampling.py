"""Sampling whose draws belong to the completion, not to the batch it was generated in.

`torch.multinomial` over a batch draws from one random stream: a completion's tokens would depend on which other
prompts shared its batch, so a step redone at another micro-batch (an OOM shrink, a tier step-down) or after a
restart would train on other completions. Here every completion has a generator of its own, seeded from (training
seed, step, prompt, completion index), and samples by the Gumbel-max trick: argmax(logits / T + G) with G = -log(-log
U), U uniform from that generator, is a draw from softmax(logits / T). transformers' `generate` runs greedy
(`do_sample=False`) with `GumbelNoise` as its logits processor, so its argmax is the sample; every other part of
generation (the KV cache, stopping at EOS, synced ranks under FSDP) is transformers' own.

`top_k`, `top_p` and `min_p` (`training.grpo`) leave out tokens before the noise is added, as transformers' warpers
do after the temperature (in that order, each keeping at least one token): the argmax then draws from the
renormalised rest (`truncate`; tests/runner/rl/test_sampling.py checks it against transformers' own warpers).
`repetition_penalty` comes first, as transformers' processors come before its warpers (`penalize`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def completion_seed(seed: int, step: int, prompt: int, index: int) -> int:
    """A 63-bit seed for completion `index` of `prompt` at optimizer step `step` (numpy's SeedSequence hash)."""
    state = np.random.SeedSequence([seed, step, prompt, index]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


class GumbelNoise:
    """A transformers logits processor: each row's scores over T plus Gumbel noise from that row's generator."""

    def __init__(self, seeds: Sequence[int], temperature: float, device: torch.device, *, top_k: int = 0,
                 top_p: float = 1.0, min_p: float | None = None, repetition_penalty: float = 1.0):  # fmt: skip
        self.temperature, self.device = temperature, device
        self.top_k, self.top_p, self.min_p = top_k, top_p, min_p
        self.repetition_penalty = repetition_penalty
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"{scores.shape[0]} rows of scores for {len(self.generators)} completions")
        vocab = scores.shape[-1]
        u = torch.stack([torch.rand(vocab, generator=g, device=self.device, dtype=torch.float32)
                         for g in self.generators])  # fmt: skip
        gumbel = -torch.log(-torch.log(u.clamp_(min=1e-20, max=1.0 - 1e-7)))
        scores = penalize(scores.float(), input_ids, self.repetition_penalty)
        return truncate(scores / self.temperature, self.top_k, self.top_p, self.min_p) + gumbel


def penalize(scores: torch.Tensor, input_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """`scores` (rows, vocab) with every token of the row's `input_ids` (its prompt, padding included, and what was
    sampled so far) divided by `penalty` where positive and multiplied where negative: transformers'
    RepetitionPenaltyLogitsProcessor (CTRL's penalty), once per distinct token. `scores` itself at 1.0."""
    if penalty == 1.0:
        return scores
    seen = torch.gather(scores, 1, input_ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return scores.scatter(1, input_ids, seen)


def truncate(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float | None = None) -> torch.Tensor:
    """`scores` (rows, vocab) with the tokens top-k, top-p (nucleus) and min-p leave out at -inf, in transformers'
    order and by its rules: top-k keeps every token tied with the k-th; top-p drops the tokens whose ascending
    cumulative probability stays within 1 - top_p; min-p those under min_p x the likeliest's probability."""
    out = scores
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(out, dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[..., -1] = False  # the likeliest token always stays
        out = out.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p is not None and min_p > 0:
        probs = out.softmax(dim=-1)
        out = out.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return out
