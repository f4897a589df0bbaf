"""GRPO's loss on a micro-batch of sampled completions (runner/rl/rollout.py), as TRL's GRPOTrainer computes it.

TRL 1.16's defaults: loss_type `dapo`, num_iterations 1, importance_sampling_level `token`, epsilon 0.2, beta 0. Per
completion token, with logp its log-prob under the policy at the sampling temperature (logits / T) and A its
completion's advantage:

    ratio = exp(logp - old_logp)
    loss_t = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) + beta * kl_t
    kl_t = exp(ref - logp) - (ref - logp) - 1           (only with beta > 0; ref: the starting model's log-prob)

summed over the completion tokens and divided by the global step's completion tokens (the step's `scale`, as for
SFT's token mean). `training.grpo.loss_type` grpo takes each completion's token mean and divides by the step's
completions; dr_grpo divides the sum by the step's completions x max_completion_length (Objective.denominator).
With one pass per batch (`num_iterations` 1) old_logp is logp.detach(): the ratio is 1 (its gradient is that of
logp), so the clip never binds and TRL's clip ratios are 0, logged as computed. With `num_iterations` mu > 1 a
sampled batch is trained on mu steps in a row, and old_logp is each token's log-prob when it was sampled (scored by
runner/rl/rollout.py right after sampling, as TRL's `old_per_token_logps`): from the second step on the ratio moves
and the clip binds (eps = `epsilon`, eps_high = `epsilon_high`, DAPO's clip-higher). Metric sums (fp32, detached,
summed over ranks by the recipe): the KL term's sum, the completion tokens and the clipped ones (low: ratio below
1 - eps where A < 0; high: above 1 + eps_high where A > 0; region: either), for TRL's `kl` and `clip_ratio/low_mean`,
`high_mean`, `region_mean`, and the sum of each completion token's entropy over the vocabulary at the temperature,
for TRL's `entropy` (the chunked loss head takes it from each chunk's softmax while it exists: runner/train/loss.py).
TRL averages `entropy` and the clip ratios per micro-batch and then over them; here each is the step's mean over its
completion tokens, which the planner's micro-batch does not change; TRL's `clip_ratio/low_min` and `high_max` (the
least share of a completion's tokens clipped below, the largest above) are the step's over every rank's completions
(max-reduced: `CLIP_EXTREMES`), where TRL averages each micro-batch's. Not offered: TRL's two-sided `delta` clip,
sequence-level importance sampling and the loss types bnpo (a mean per micro-batch), luspo and vespo. `loss_type`
cispo (MiniMax-M1's CISPO) and sapo (SAPO's soft gate) are TRL's: `loss`.

Checked against TRL's own `GRPOTrainer._compute_loss` on the same batch in tests/runner/train/test_grpo.py.

`load` reads the prompts and the reward functions before anything is built (a reward file that does not load is
exit 2 then); `attach` gives a built `Stepper` its `Rollouts`, again after a tier step-down rebuilds it.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jobspec.spec.models import JobSpec
from runner.data.prompts import PromptData, load_prompts
from runner.data.tokens import IGNORE
from runner.model.build import eager_forwards
from runner.rl.rewards import Rewards
from runner.rl.rollout import Rollouts

if TYPE_CHECKING:
    from runner.train.step import Stepper

log = logging.getLogger("jobspec.runner")
EPSILON = 0.2  # TRL's clip range (training.grpo.epsilon); binds only after a batch's first pass (num_iterations > 1)
SAPO_TEMPERATURES = (1.0, 1.05)  # TRL's sapo_temperature_pos and _neg


def loss(token_losses: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor, ref_logps: torch.Tensor | None,
         beta: float, loss_type: str = "dapo", entropies: torch.Tensor | None = None,
         old_logps: torch.Tensor | None = None, epsilon: float = EPSILON, epsilon_high: float | None = None,
         sapo: tuple[float, float] = SAPO_TEMPERATURES) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(summed loss over the completion tokens, [kl sum, completion tokens, low, high and region clipped tokens,
    entropy sum] fp32 detached) from the (rows, T) fp32 token losses (minus each token's log-prob at the sampling
    temperature), the rows' `labels`, their (rows,) advantages, with `beta` > 0 the (rows, T) reference log-probs and
    the (rows, T) `entropies` of the policy at the temperature (0 without). `old_logps` (rows, T): the log-probs when
    the batch was sampled (`num_iterations` > 1), else the policy's own, detached (ratio 1); the ratio is clipped to
    [1 - epsilon, 1 + epsilon_high (None: epsilon)]. `loss_type`
    grpo sums each completion's token mean instead (the step then divides by its completions: Objective.denominator);
    dapo and dr_grpo sum the tokens (divided by the step's tokens, or its completions x max_completion_length).
    cispo: -min(ratio, epsilon_high).detach() * A * logp, summed as dapo (its clipped tokens: ratio above
    epsilon_high where A > 0, counted as `high`); sapo: -sigmoid(tau (ratio - 1)) 4 / tau * A with tau `sapo`'s
    (positive advantages, the others), summed as grpo (no clip counted)."""
    mask = (labels != IGNORE).float()
    logp = -token_losses
    old = logp.detach() if old_logps is None else old_logps.to(logp.device, torch.float32)
    ratio = torch.exp(logp - old)
    high_eps = epsilon if epsilon_high is None else epsilon_high  # TRL's epsilon_high
    low_edge, high_edge = 1 - epsilon, 1 + high_eps
    a = advantages.to(logp.device, torch.float32)[:, None]
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=high_eps).detach() * a * logp
    elif loss_type == "sapo":
        tau = torch.where(a > 0, sapo[0], sapo[1])
        per_token = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * a
    else:
        per_token = -torch.min(ratio * a, torch.clamp(ratio, low_edge, high_edge) * a)
    kl_sum = torch.zeros((), device=logp.device)
    if beta:
        if ref_logps is None:
            raise ValueError("a GRPO batch with a KL term but no reference log-probs (runner/rl/rollout.py)")
        delta = ref_logps.to(logp.device, torch.float32) - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        kl_sum = (kl.detach() * mask).sum()
    r, none = ratio.detach(), torch.zeros_like(mask)  # the clipped tokens, as TRL counts them for each loss type
    if loss_type == "sapo":  # a smooth gate: nothing clipped
        low, high = none, none
    elif loss_type == "cispo":  # the weight capped at epsilon_high itself
        low, high = none, ((r > high_eps) & (a > 0)).float() * mask
    else:
        low, high = ((r < low_edge) & (a < 0)).float() * mask, ((r > high_edge) & (a > 0)).float() * mask
    region = torch.maximum(low, high)
    entropy_sum = torch.zeros((), device=logp.device) if entropies is None else (entropies.float() * mask).sum()
    # each completion's share of its tokens clipped below / above (TRL's masked_seq_mean), for the step's extremes:
    # -min of the low shares and max of the high ones, so that both reduce by max (rows without tokens: -inf)
    tokens = mask.sum(-1)  # each completion's
    low_share, high_share = low.sum(-1) / tokens.clamp(min=1.0), high.sum(-1) / tokens.clamp(min=1.0)
    has, empty = tokens > 0, torch.tensor(-math.inf, device=logp.device)
    extremes = [torch.where(has, -low_share, empty).max(), torch.where(has, high_share, empty).max()]
    sums = torch.stack([kl_sum, mask.sum(), low.sum(), high.sum(), region.sum(), entropy_sum, *extremes])
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / tokens.clamp(min=1.0)).sum(), sums.float()
    return (per_token * mask).sum(), sums.float()


CLIP_RATIOS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
CLIP_EXTREMES = ("clip_ratio/low_min", "clip_ratio/high_max")
CISPO_CLIP = "cispo_clip_ratio"
SUMS = 6  # the values of `loss`'s metric vector summed over micro-batches and ranks; the rest reduce by max


def clip_names(loss_type: str) -> tuple[str, ...]:
    """The clip metrics TRL logs for `loss_type`: its clip ratios and their extremes; CISPO's one ratio; none for
    SAPO (no clip)."""
    return {"cispo": (CISPO_CLIP,), "sapo": ()}.get(loss_type, (*CLIP_RATIOS, *CLIP_EXTREMES))


def metrics(sums: list[float], beta: float, extremes: list[float] | None = None,
            loss_type: str = "dapo") -> dict[str, float]:  # fmt: skip
    """TRL's clip ratios (`clip_names`), `entropy` and, when the KL term is on, `kl`: means over the step's completion
    tokens; with `extremes` (the max over micro-batches and ranks of `loss`'s last two values) TRL's
    `clip_ratio/low_min` and `high_max`: the least share of a completion's tokens clipped below, the largest above."""
    kl, tokens, *clipped, entropy = sums[:SUMS]
    out: dict[str, float] = {}
    if loss_type == "cispo":
        out[CISPO_CLIP] = clipped[1] / max(tokens, 1.0)
    elif loss_type != "sapo":
        out = {name: value / max(tokens, 1.0) for name, value in zip(CLIP_RATIOS, clipped, strict=True)}
        if extremes is not None and all(math.isfinite(v) for v in extremes):
            out |= {CLIP_EXTREMES[0]: -extremes[0], CLIP_EXTREMES[1]: extremes[1]}
    return out | {"entropy": entropy / max(tokens, 1.0)} | ({"kl": kl / max(tokens, 1.0)} if beta else {})


def load(spec: JobSpec, tokenizer: Any, base: Path) -> tuple[PromptData, Rewards]:
    """The prompts and the reward functions (`base`: the directory a reward file's relative path starts from)."""
    g = spec.training.grpo
    assert g is not None
    return load_prompts(spec, tokenizer), Rewards(g.rewards, base, g.max_completion_length)


def attach(stepper: Stepper, data: PromptData, rewards: Rewards, spec: JobSpec, tokenizer: Any) -> None:
    """Give the stepper its rollouts: sampled by the unwrapped model (FSDP2's hooks still gather; DDP's wrapper is
    not needed without gradients), every rank stepping together under FSDP over several ranks (`synced_gpus`)."""
    from runner.train.step import token_losses

    g = spec.training.grpo
    assert g is not None
    cap = g.epsilon if g.epsilon_high is None else g.epsilon_high
    if g.loss_type == "cispo" and cap < 1:
        log.warning("training.grpo.loss_type cispo weighs each token by its ratio clipped above at epsilon_high "
                    "itself (%g, not 1 + it): below 1 every token's weight is cut to it; ScaleRL recommends 5 "
                    "(TRL does the same)", cap)  # fmt: skip
    model = stepper.model
    unwrapped = stepper.accelerator.unwrap_model(model)
    configured = getattr(getattr(unwrapped, "generation_config", None), "eos_token_id", None)
    eos = [tokenizer.eos_id, *([] if configured is None else [configured] if isinstance(configured, int)
                               else list(configured))]  # fmt: skip
    reference = None
    if g.beta:

        def reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            """Each completion token's log-prob under the starting model: the adapter off, eval mode."""
            off = unwrapped.disable_adapter() if hasattr(unwrapped, "disable_adapter") else nullcontext()
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad(), eager_forwards(), off:
                    return -token_losses(model, stepper.head, x, y, temperature=g.temperature)
            finally:
                model.train(was_training)

    policy = None
    if g.num_iterations > 1:

        def policy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            """Each completion token's log-prob under the policy as it samples (TRL's old_per_token_logps: the model
            in training mode, no gradients)."""
            with torch.no_grad(), eager_forwards():
                return -token_losses(model, stepper.head, x, y, temperature=g.temperature)

    stepper.rollouts = Rollouts(model, unwrapped, data, rewards, g, stepper.ctrl, rank=stepper.rank,
                                seed=spec.training.seed, eos=eos, device=stepper.device,
                                synced=stepper.sharded_ranks, reference=reference, policy=policy,
                                decode=tokenizer.decode)  # fmt: skip
