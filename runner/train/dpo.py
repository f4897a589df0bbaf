"""The DPO objective (sigmoid, Rafailov et al. 2023) and IPO (Azar et al. 2023) as TRL's DPOTrainer computes them
(loss_type "sigmoid" and "ipo"), and their metrics' names.

`preference_loss` takes the summed completion log-probs of a micro-batch's 2B rows (the B chosen chats, then the B
rejected ones: runner/data/preference.py) and the pairs' reference log-probs, computed once before training
(runner/train/reference.py), and returns the summed per-pair loss with the sums behind TRL's metrics
(`rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`, `logps/chosen`, `logps/rejected`),
which the recipe all-reduces and divides by the global step's pairs (`metrics`). IPO (trl 1.16, DPOTrainer's
`_compute_loss`) squares the distance of the length-averaged log-ratio margin from 1 / (2 beta): each member's
log-ratio divided by its completion tokens (at least 1); its rewards and logps are DPO's, on the summed log-probs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # fmt: skip


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per pair: (loss, chosen reward, rejected reward), TRL's sigmoid loss without label smoothing:
    -log sigmoid(beta ((pi_c - pi_r) - (ref_c - ref_r))); a reward is beta (pi - ref), detached."""
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = -F.logsigmoid(beta * logits)
    return losses, beta * (policy_chosen - ref_chosen).detach(), beta * (policy_rejected - ref_rejected).detach()


def ipo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, chosen_tokens: torch.Tensor,
             rejected_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per pair: (loss, chosen reward, rejected reward), TRL's IPO: ((lr_c / n_c - lr_r / n_r) - 1 / (2 beta))^2 with
    lr the summed log-ratio and n the completion's tokens (at least 1); the rewards DPO's, beta (pi - ref), detached."""
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
    losses = (delta - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def preference_loss(logps: torch.Tensor, reference: torch.Tensor, beta: float,
                    tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(summed loss over the B pairs, the sums of the METRICS over them: a (6,) fp32 tensor, detached) from the (2B,)
    summed log-probs of the chosen rows then the rejected rows and the (B, 2) reference log-probs; given the (2B,)
    completion token counts `tokens`, IPO's loss, else DPO's."""
    pairs = len(reference)
    chosen, rejected = logps[:pairs], logps[pairs:]
    ref = reference.to(device=logps.device, dtype=logps.dtype)
    if tokens is None:
        losses, r_chosen, r_rejected = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta)
    else:
        n = tokens.to(device=logps.device, dtype=logps.dtype)
        losses, r_chosen, r_rejected = ipo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta, n[:pairs], n[pairs:])
    wins = (r_chosen > r_rejected).float()
    sums = torch.stack([r_chosen.sum(), r_rejected.sum(), (r_chosen - r_rejected).sum(), wins.sum(),
                        chosen.detach().sum(), rejected.detach().sum()])  # fmt: skip
    return losses.sum(), sums


def metrics(sums: list[float], pairs: float) -> dict[str, float]:
    """TRL's metric names, each a mean over `pairs` (the global step's) of the all-reduced sums."""
    return {name: value / max(pairs, 1.0) for name, value in zip(METRICS, sums, strict=True)}
