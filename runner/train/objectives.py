"""The preference objectives: how a micro-batch of B pairs becomes a loss and TRL's metrics, for DPO, IPO, SimPO and
ORPO (KTO's unpaired records: runner/train/kto.py).

Read after runner/train/dpo.py (sigmoid DPO and IPO against the cached reference). The step (runner/train/step.py) runs
the model once over the micro-batch's 2B rows (the B chosen chats, then the B rejected ones) and hands `Objective.loss`
each position's token loss (minus its log-prob; 0 where the labels say IGNORE). The completion's tokens are those the
batch's `labels` mark, so a row's summed log-prob is the sum over them, and its length-normalised one (SimPO, ORPO:
TRL's `average_log_prob=True`) that sum over their count. ORPO scores its chosen rows with `chosen_labels` instead,
every next token of the chat (TRL's ORPOTrainer: its NLL term covers the prompt too), and reads the completion's
log-probs from the same positions.

As TRL computes them (trl 1.16, `trl.experimental`; checked against its own trainers in
tests/runner/train/test_reference_free.py):

- SimPO, CPOTrainer with `loss_type="simpo"`, `cpo_alpha=0` (no NLL term), no label smoothing:
  `-logsigmoid(beta * (avg_c - avg_r) - gamma)`, rewards `beta * avg`.
- ORPO, ORPOTrainer: `nll - beta * logsigmoid(log_odds)` with `log_odds = (avg_c - avg_r) - (log(1 - e^avg_c) -
  log(1 - e^avg_r))`, the NLL the mean token cross-entropy of the chosen chats, rewards `beta * avg`.

Normalised over the global step, whatever the micro-batch: each pair's term by the step's pairs (the step's `scale`)
and ORPO's NLL by the step's chosen positions (`nll_scale` = pairs / chosen positions, set by the step), so a step of
one micro-batch is TRL's loss on that batch and a shrunk step is the same step. The metric sums (fp32, detached) are
all-reduced by the recipe and divided by the step's pairs (`metrics`), ORPO's `nll_loss` by its chosen positions.
`logits/chosen` and `logits/rejected`, for every objective, as TRL 1.16's DPOTrainer computes them: each completion
token's mean logit over the vocabulary (the loss head's by-product, runner/train/loss.py), averaged over the global
step's chosen (rejected) completion tokens. (TRL's CPO and ORPO trainers instead average their whole padded logits
tensor, padding and prompt included; that depends on their padding, so it is not copied.) Not logged: CPOTrainer's
`nll_loss`, always 0 for SimPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jobspec.spec.models import TrainingSpec
from runner.data.tokens import IGNORE
from runner.train import dpo, grpo, kto

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # fmt: skip
ORPO_EXTRA = ("nll_loss", "log_odds_ratio", "log_odds_chosen")
GRPO_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                "completions/min_terminated_length", "completions/max_terminated_length")  # TRL's; runner/rl/rollout.py
LOGITS = ("logits/chosen", "logits/rejected")  # the last 4 sums: chosen and rejected mean-logit sums and token counts


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation (branching at -ln 2, as TRL's ORPOTrainer does)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def simpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float,
               gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per pair from length-normalised log-probs: (loss, chosen reward, rejected reward), TRL's CPOTrainer.cpo_loss
    with loss_type simpo, alpha 0 and no label smoothing."""
    logits = (chosen - rejected) - gamma / beta
    return -F.logsigmoid(beta * logits), beta * chosen.detach(), beta * rejected.detach()


def odds_ratio_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, ...]:
    """Per pair from length-normalised log-probs, in fp32: (beta * logsigmoid(log odds), chosen reward, rejected
    reward, logsigmoid(log odds), log odds), TRL's ORPOTrainer.odds_ratio_loss (whose loss is the NLL minus the mean
    of the first) but per pair where TRL gives the last two's means."""
    chosen, rejected = chosen.float(), rejected.float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    return beta * ratio, beta * chosen.detach(), beta * rejected.detach(), ratio, log_odds


def _reward_sums(chosen: torch.Tensor, rejected: torch.Tensor, r_chosen: torch.Tensor,
                 r_rejected: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
    wins = (r_chosen > r_rejected).float()
    return [r_chosen.sum(), r_rejected.sum(), (r_chosen - r_rejected).sum(), wins.sum(), chosen.detach().sum(),
            rejected.detach().sum()]  # fmt: skip


@dataclass(frozen=True)
class Objective:
    """A preference objective (`training.objective`) with its parameters; see the module docstring."""

    name: str  # dpo | ipo | simpo | orpo | kto | grpo
    beta: float
    gamma: float = 0.0  # SimPO's target margin
    weights: tuple[float, float] = (1.0, 1.0)  # KTO's desirable and undesirable weights
    rewards: tuple[str, ...] = ()  # GRPO's reward names (its metrics)
    temperature: float = 1.0  # GRPO's sampling temperature, at which its completions are scored
    loss_type: str = "dapo"  # GRPO's token-loss average (`training.grpo.loss_type`)
    generations: int = 1  # GRPO's completions per prompt
    completion_length: int = 0  # GRPO's max_completion_length (dr_grpo's constant)
    clip: tuple[float, float | None] = (0.2, None)  # GRPO's epsilon and epsilon_high (the ratio's clip)
    sapo: tuple[float, float] = (1.0, 1.05)  # GRPO's SAPO temperatures (positive, other advantages)

    @classmethod
    def of(cls, training: TrainingSpec) -> Objective | None:
        """The spec's preference or RL objective; None for sft."""
        if training.objective == "sft":
            return None
        if training.objective == "grpo":
            g = training.grpo
            assert g is not None
            return cls("grpo", g.beta, rewards=tuple(r.label for r in g.rewards), temperature=g.temperature,
                       loss_type=g.loss_type, generations=g.num_generations,
                       completion_length=g.max_completion_length, clip=(g.epsilon, g.epsilon_high),
                       sapo=(g.sapo_temperature_pos, g.sapo_temperature_neg))  # fmt: skip
        return cls(training.objective, training.beta, training.gamma if training.objective == "simpo" else 0.0,
                   (training.desirable_weight, training.undesirable_weight))  # fmt: skip

    def denominator(self, targets: float, samples: int) -> float:
        """What a step's summed loss is divided by, given its target tokens and its samples (all ranks): the tokens,
        but for GRPO's grpo loss its completions (each already its token mean: runner/train/grpo.py) and for
        dr_grpo its completions x max_completion_length."""
        if self.name != "grpo" or self.loss_type in ("dapo", "cispo"):
            return targets
        rows = samples * self.generations
        return float(rows if self.loss_type in ("grpo", "sapo") else rows * self.completion_length)

    @property
    def metric_names(self) -> tuple[str, ...]:
        if self.name == "kto":
            return kto.METRICS
        if self.name == "grpo":
            return (*GRPO_METRICS[:3], *(f"rewards/{n}/{m}" for n in self.rewards for m in ("mean", "std")),
                    *GRPO_METRICS[3:], *grpo.clip_names(self.loss_type), *(("kl",) if self.beta else ()))  # fmt: skip
        return (REWARDS + ORPO_EXTRA if self.name == "orpo" else REWARDS) + LOGITS

    @property
    def scores_chosen_chat(self) -> bool:
        """Whether the chosen rows are scored on every next token (`chosen_labels`): ORPO's NLL term."""
        return self.name == "orpo"

    def loss(self, token_losses: torch.Tensor, labels: torch.Tensor, *, reference: torch.Tensor | None = None,
             chosen_labels: torch.Tensor | None = None, nll_scale: float = 1.0, mean_logits: torch.Tensor | None = None,
             desirable: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(summed loss over the B pairs, the sums behind `metrics`: fp32, detached) from the (2B, T) fp32 token
        losses of the micro-batch's rows and their completion `labels` (2B, T); `reference`: DPO's (B, 2) log-probs.
        ORPO: the chosen rows were scored at `chosen_labels` (B, T), and their NLL's sum times `nll_scale` (the step's
        pairs over its chosen positions) joins the loss. `mean_logits` (2B, T): each position's mean logit, summed
        over the completion tokens into the last 4 sums (0 without it). KTO: runner/train/kto.py, its rows the records
        then their KL rows, `desirable` their (B,) labels."""
        if self.name == "kto":
            return kto.loss(token_losses, labels, reference, desirable, mean_logits, self.beta, self.weights)
        loss, sums = self._loss(token_losses, labels, reference, chosen_labels, nll_scale)
        completion = (labels != IGNORE).float()
        pairs = len(labels) // 2
        if mean_logits is None:
            logit = torch.zeros(4, device=sums.device)
        else:
            m = mean_logits.detach().float() * completion
            logit = torch.stack([m[:pairs].sum(), completion[:pairs].sum(), m[pairs:].sum(), completion[pairs:].sum()])
        return loss, torch.cat([sums.float(), logit.to(sums.device)])

    def _loss(self, token_losses: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor | None,
              chosen_labels: torch.Tensor | None, nll_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        completion = labels != IGNORE
        logps = -(token_losses * completion).sum(1)  # (2B,) summed completion log-probs
        if self.name in ("dpo", "ipo"):
            if reference is None:
                raise ValueError(f"a {self.name} batch without its reference log-probs (runner/train/reference.py)")
            tokens = completion.sum(1) if self.name == "ipo" else None  # IPO's length average
            return dpo.preference_loss(logps, reference, self.beta, tokens)
        pairs = len(logps) // 2
        avg = logps / completion.sum(1).clamp(min=1)  # length-normalised; a pair with an empty member is dropped
        chosen, rejected = avg[:pairs], avg[pairs:]
        if self.name == "simpo":
            losses, r_chosen, r_rejected = simpo_loss(chosen, rejected, self.beta, self.gamma)
            return losses.sum(), torch.stack(_reward_sums(chosen, rejected, r_chosen, r_rejected)).float()
        if chosen_labels is None:
            raise ValueError("an ORPO batch without its chosen chats' labels (runner/data/preference.py)")
        losses, r_chosen, r_rejected, ratio, log_odds = odds_ratio_loss(chosen, rejected, self.beta)
        nll = token_losses[:pairs].sum()  # the chosen rows hold every next token's loss (`scores_chosen_chat`)
        loss = nll * nll_scale - losses.sum()
        positions = (chosen_labels != IGNORE).sum().float()  # nll_loss's denominator (a metric)
        extra = [nll.detach(), ratio.detach().sum(), log_odds.detach().sum(), positions]
        return loss, torch.stack(_reward_sums(chosen, rejected, r_chosen, r_rejected) + extra).float()

    def metrics(self, sums: list[float], pairs: float, extremes: list[float] | None = None) -> dict[str, float]:
        """TRL's metric names, each the mean over the global step's `pairs` of the all-reduced sums; ORPO's nll_loss
        the mean over its chosen positions; KTO's from its own sums (runner/train/kto.py)."""
        if self.name == "kto":
            return kto.metrics(sums)
        if self.name == "grpo":
            return grpo.metrics(sums, self.beta, extremes, self.loss_type)
        sums, (chosen_sum, chosen_n, rejected_sum, rejected_n) = sums[:-4], sums[-4:]
        logits = {"logits/chosen": chosen_sum / max(chosen_n, 1.0),
                  "logits/rejected": rejected_sum / max(rejected_n, 1.0)}  # fmt: skip
        if self.name in ("dpo", "ipo"):
            return dpo.metrics(sums, pairs) | logits
        out = {name: value / max(pairs, 1.0) for name, value in zip(REWARDS, sums, strict=False)}
        if self.name == "orpo":
            nll, ratio, log_odds, positions = sums[len(REWARDS) :]
            out |= {"nll_loss": nll / max(positions, 1.0), "log_odds_ratio": ratio / max(pairs, 1.0),
                    "log_odds_chosen": log_odds / max(pairs, 1.0)}  # fmt: skip
        return out | logits
