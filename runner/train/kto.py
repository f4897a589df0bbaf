"""KTO (Ethayarajh et al. 2024) as TRL 1.16's KTOTrainer computes it (loss_type "kto", precomputed reference
log-probs), and its metrics' names.

A micro-batch of B unpaired records is 2B rows (runner/data/preference.py): the B records' chats, then their B KL
rows (each record's prompt with another record's completion: runner/data/unpaired.py), scored by the step without
gradients (TRL's KL pass). With pi and ref the summed completion log-probs under the policy and the reference
(runner/train/reference.py scores every record and KL row once):

    kl     = max(0, mean over the B KL rows of (pi - ref)), detached   (TRL: per micro-batch, clamped at 0)
    loss_i = desirable_weight   * (1 - sigmoid(beta * ((pi_i - ref_i) - kl)))   for a desirable record (label true)
             undesirable_weight * (1 - sigmoid(beta * (kl - (pi_i - ref_i))))   for an undesirable one

and TRL's loss is their mean over the micro-batch; here their sum, which the step divides by the global step's
records (so a step of one micro-batch is TRL's loss on that batch). On several ranks TRL averages each micro-batch's
kl over the ranks before clamping; here each rank's micro-batch has its own (no collective inside a micro-step: the
OOM agreement needs none there). The metrics, TRL's names: `rewards/chosen` and `logps/chosen` (beta (pi - ref) and
pi, means over the step's desirable records), `rewards/rejected` and `logps/rejected` (over the undesirable ones),
`rewards/margins` (chosen minus rejected, when the step has both), `kl` (the mean of the micro-batches' kl) and
`logits/chosen|rejected` (each completion token's mean logit, averaged over the desirable (undesirable) records'
completion tokens). A metric whose records the step lacks is left out, as TRL leaves it out.
"""

from __future__ import annotations

import torch

from runner.data.tokens import IGNORE

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl",
           "logits/chosen", "logits/rejected")  # fmt: skip
# the sums behind them (fp32, all-reduced by the recipe): rewards, log-probs, record counts and completion-token mean
# logits and counts of the desirable then the undesirable records; the micro-batches' kl and their count
SUMS = 12


def kto_loss(policy: torch.Tensor, reference: torch.Tensor, kl_policy: torch.Tensor, kl_reference: torch.Tensor,
             desirable: torch.Tensor, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per record (B,): (weighted loss, reward beta (pi - ref) detached), and the micro-batch's kl estimate (detached,
    clamped at 0) from the (B,) summed log-probs of the records and of their KL rows under the policy and the
    reference, and the (B,) bool labels."""
    kl = (kl_policy - kl_reference).mean().detach().clamp(min=0)
    ratio = policy - reference
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(desirable, chosen, rejected), beta * ratio.detach(), kl


def loss(token_losses: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor | None,
         desirable: torch.Tensor | None, mean_logits: torch.Tensor | None, beta: float,
         weights: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(summed loss over the B records, the SUMS: fp32, detached) from the (2B, T) fp32 token losses of the records'
    rows then their KL rows, their completion `labels`, the (B, 2) reference log-probs (record, KL row), the (B,)
    labels and the (B, T) mean logits of the records' rows (None: logits sums 0)."""
    if reference is None or desirable is None:
        raise ValueError("a KTO batch without its reference log-probs or labels (runner/data/preference.py)")
    completion = (labels != IGNORE).float()
    logps = -(token_losses * completion).sum(1)  # (2B,) summed completion log-probs
    records = len(logps) // 2
    ref = reference.to(device=logps.device, dtype=logps.dtype)
    good = desirable.to(device=logps.device, dtype=torch.bool)
    losses, rewards, kl = kto_loss(logps[:records], ref[:, 0], logps[records:].detach(), ref[:, 1], good, beta,
                                   *weights)  # fmt: skip
    chosen, bad = good.float(), (~good).float()
    policy = logps[:records].detach()
    mine = completion[:records]
    if mean_logits is None:  # each record's summed mean logit over its completion tokens
        logit = torch.zeros(records, device=logps.device)
    else:
        logit = (mean_logits[:records].detach().float() * mine).sum(1)
    tokens = mine.sum(1)
    sums = [(rewards * chosen).sum(), (policy * chosen).sum(), chosen.sum(), (logit * chosen).sum(),
            (tokens * chosen).sum(), (rewards * bad).sum(), (policy * bad).sum(), bad.sum(), (logit * bad).sum(),
            (tokens * bad).sum(), kl, torch.ones((), device=logps.device)]  # fmt: skip
    return losses.sum(), torch.stack([v.float() for v in sums])


def metrics(sums: list[float]) -> dict[str, float]:
    """TRL's metric names from the all-reduced SUMS of a step (see the module docstring)."""
    r_c, lp_c, n_c, logit_c, tok_c, r_r, lp_r, n_r, logit_r, tok_r, kl, steps = sums
    out = {"kl": kl / max(steps, 1.0)}
    if n_c:
        out |= {"rewards/chosen": r_c / n_c, "logps/chosen": lp_c / n_c}
    if n_r:
        out |= {"rewards/rejected": r_r / n_r, "logps/rejected": lp_r / n_r}
    if n_c and n_r:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    if tok_c:
        out["logits/chosen"] = logit_c / tok_c
    if tok_r:
        out["logits/rejected"] = logit_r / tok_r
    return out
