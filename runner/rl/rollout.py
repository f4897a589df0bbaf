"""A GRPO step's rows: each of this rank's prompts with its group of sampled completions, their rewards and advantages.

`Rollouts.batches(ids, micro_batch)` is what the step (runner/train/step.py) collates from when the objective is
GRPO. For a step's prompts it, once per step (a step redone after an OOM, at a smaller micro-batch, reuses them):

1. samples `num_generations` completions of each prompt with the model as it is (eval mode, no gradients, the
   adapter on), `micro_batch` prompts to a `generate` call, prompts padded on the left, each completion from its own
   seeded generator (runner/rl/sampling.py), until EOS (kept, as TRL keeps it) or `max_completion_length` tokens,
   with no other logits processor (the checkpoint's generation_config.json does not leak in);
   out of memory on any rank (agreed): that call again at half as many prompts, then the rest at that size;
2. scores them (runner/rl/rewards.py) and sums the rewards by weight;
3. takes the advantages as TRL's GRPOTrainer does (`scale_rewards`, multi_objective_aggregation
   `sum_then_normalize`): reward minus its group's mean, over the group's standard deviation (unbiased, as torch's
   std) plus 1e-4, or the whole step's (all ranks), or nothing; a completion no reward applies to (every one None)
   is left out of its group's mean and gets advantage 0;
4. with a KL term (beta > 0, LoRA), scores every completion token under the starting model (the adapter off);
5. counts TRL's metrics over the step's completions on all ranks: `reward`, `reward_std`, `frac_reward_zero_std`,
   `rewards/<name>/mean|std`, `completions/mean_length` (and min, max, `clipped_ratio`: no EOS within the limit;
   `mean_terminated_length`, min, max).

A row is the prompt's tokens then the completion's, scored on the completion's (`labels`), so a micro-batch of B
prompts is B x num_generations rows, its `targets` their completion tokens: the step's loss is a mean over the
global step's completion tokens (TRL's default loss_type, dapo).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from jobspec.spec.models import GrpoSpec
from runner.data.dataset import Batch, make_batch, micro_batches, pad_rows
from runner.data.prompts import PromptData
from runner.data.tokens import training_row
from runner.dist import Control
from runner.model.build import eager_forwards
from runner.oom.detect import guarded, release_memory
from runner.oom.shrink import StepOOM
from runner.rl.rewards import Rewards, TrainerState
from runner.rl.sampling import GumbelNoise, completion_seed

log = logging.getLogger("jobspec.runner")
ADVANTAGE_EPS = 1e-4  # TRL's


@dataclass(frozen=True)
class RolloutBatch(Batch):
    """A GRPO micro-batch: B prompts' groups, `advantages` (rows,) fp32 and, with a KL term, `ref_logps` (rows, T)
    fp32: each completion token's log-prob under the starting model (0 elsewhere)."""

    advantages: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None  # num_iterations > 1: each token's log-prob when it was sampled


@dataclass
class Group:
    """One prompt's completions: their rows, advantages and (KL term) reference log-probs per position."""

    completions: list[list[int]]  # token ids, EOS kept where it came
    rows: list[tuple[np.ndarray, np.ndarray]]
    advantages: np.ndarray
    ref: list[np.ndarray] | None = None
    old: list[np.ndarray] | None = None  # num_iterations > 1: the log-probs at sampling, per position


def group_advantages(rewards: np.ndarray, scale: str, step_std: float | None = None) -> tuple[np.ndarray, bool]:
    """(advantages, whether the group's std is 0) of one group's summed rewards (NaN: none applied), as TRL."""
    valid = rewards[~np.isnan(rewards)]
    mean = valid.mean() if len(valid) else np.nan
    std = valid.std(ddof=1) if len(valid) > 1 else np.nan
    out = rewards - mean
    if scale == "group":
        out = out / (std + ADVANTAGE_EPS)
    elif scale == "batch":
        out = out / ((step_std if step_std is not None else 0.0) + ADVANTAGE_EPS)
    return np.nan_to_num(out, nan=0.0), bool(np.isclose(std, 0.0)) if not np.isnan(std) else False


def sample_std(n: float, s: float, ss: float, empty: float = float("nan")) -> float:
    """The unbiased standard deviation (torch's std, TRL's nanstd) of n values from their sum and sum of squares,
    reduced over the ranks; `empty` for fewer than two."""
    return float(np.sqrt(max(ss - s * s / n, 0.0) / (n - 1))) if n > 1 else empty


@contextmanager
def root_unsharded(model: torch.nn.Module) -> Iterator[None]:
    """The FSDP2 root's own parameters (embeddings, final norm, output layer) gathered while it is open. peft's
    `generate` calls the inner model's forward, past the root's pre-forward hook that would gather them; the blocks
    are FSDP units of their own and gather themselves. Nothing to do for any other model."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


@contextmanager
def generation_defaults(model: torch.nn.Module, config: Any) -> Iterator[None]:
    """`config` as the model's own generation config while it is open. transformers fills every field a passed
    config leaves unset from the model's (a checkpoint's generation_config.json: Qwen's repetition_penalty 1.05, a
    `suppress_tokens` list...), and those processors would bend the sampled distribution away from
    softmax(logits / T); TRL sets its sampling fields itself the same way."""
    owners = [m for m in model.modules() if getattr(m, "generation_config", None) is not None]
    kept = [m.generation_config for m in owners]
    for m in owners:
        m.generation_config = config
    try:
        yield
    finally:
        for m, own in zip(owners, kept, strict=True):
            m.generation_config = own


class Rollouts:
    """This rank's GRPO rows, step by step (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, generator: Any, data: PromptData, rewards: Rewards, grpo: GrpoSpec,
                 ctrl: Control, *, rank: int, seed: int, eos: Sequence[int], device: torch.device, synced: bool,
                 reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 policy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 decode: Callable[[Sequence[int]], str]):  # fmt: skip
        self.model, self.generator, self.data, self.rewards, self.grpo = model, generator, data, rewards, grpo
        self.ctrl, self.rank, self.seed, self.device, self.synced = ctrl, rank, seed, device, synced
        self.eos = sorted(set(int(e) for e in eos))
        self.reference, self.policy, self.decode = reference, policy, decode
        self.step = 0  # the optimizer step the next `batches` is for (set by the recipe)
        self.max_steps = 0  # the run's steps (set by the recipe): the reward functions' trainer_state
        self.gen_prompts: int | None = None  # prompts a generate call after an OOM in one (kept for later steps)
        # (first step of the batch's num_iterations steps, its prompts, their groups): sampled once, trained on
        # num_iterations steps in a row
        self.made: tuple[int, tuple[int, ...], dict[int, Group]] | None = None
        self.metrics: dict[str, float] = {}  # the last sampled batch's, all ranks

    # --- the step's rows ---------------------------------------------------------------------------------

    @property
    def sampled_at(self) -> int:
        """The step the current step's batch is sampled at: the first of its `num_iterations` steps."""
        return self.step - self.step % self.grpo.num_iterations

    def batches(self, ids: Sequence[int], micro_batch: int) -> list[RolloutBatch]:
        key = (self.sampled_at, tuple(ids))
        if self.made is None or self.made[:2] != key:
            if self.step != self.sampled_at:  # a resume in the middle of the iterations, without their batch
                log.warning("GRPO step %d: its batch, sampled at step %d, is not at hand: sampled again now",
                            self.step, self.sampled_at)  # fmt: skip
            self.made = (*key, self._make(list(ids), micro_batch))
        groups = self.made[2]
        return [self._collate(chunk, groups) for chunk in micro_batches(list(ids), micro_batch)]

    def _collate(self, ids: list[int], groups: dict[int, Group]) -> RolloutBatch:
        rows = [row for i in ids for row in groups[i].rows]
        x, y = pad_rows(rows, self.data.pad_id, self.data.max_seq_len)
        batch = make_batch(x, y, rows, ids, None)
        advantages = torch.from_numpy(np.concatenate([groups[i].advantages for i in ids]).astype(np.float32))

        def per_position(kind: str) -> torch.Tensor | None:
            if any(getattr(groups[i], kind) is None for i in ids):
                return None
            out = np.zeros(x.shape, dtype=np.float32)
            for r, values in enumerate(v for i in ids for v in getattr(groups[i], kind)):
                out[r, : len(values)] = values
            return torch.from_numpy(out)

        return RolloutBatch(**{f: getattr(batch, f) for f in batch.__dataclass_fields__}, advantages=advantages,
                            ref_logps=per_position("ref"), old_logps=per_position("old"))  # fmt: skip

    def _make(self, ids: list[int], micro_batch: int) -> dict[int, Group]:
        start = time.perf_counter()
        completions = self._sample(ids, micro_batch)
        sampled = time.perf_counter() - start
        g = self.grpo.num_generations
        prompts = [self.data.prompts[i] for i in ids for _ in range(g)]
        texts = [self.decode(c) for c in completions]
        shown = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                 for p, t in zip(prompts, texts, strict=True)]  # fmt: skip
        columns = [self.data.columns[i] for i in ids for _ in range(g)]
        per_fn = self.rewards.score(prompts, shown, completions, columns, TrainerState(self.sampled_at,
                                                                                      self.max_steps))
        total = self.rewards.total(per_fn).reshape(len(ids), g)
        step_std = self._step_std(total) if self.grpo.scale_rewards == "batch" else None
        groups, zero_std = {}, 0
        for k, i in enumerate(ids):
            advantages, flat = group_advantages(total[k], self.grpo.scale_rewards, step_std)
            zero_std += flat
            mine = completions[k * g : (k + 1) * g]
            groups[i] = Group(mine, [self._row(i, c) for c in mine], advantages)
        if self.reference is not None:
            self._score(ids, groups, micro_batch, self.reference, "ref")
        if self.policy is not None:
            self._score(ids, groups, micro_batch, self.policy, "old")
        self.metrics = self._metrics(per_fn, total, completions, zero_std, len(ids))
        log.debug("GRPO step %d: %d completions sampled in %.1f s, scored in %.1f s", self.step, len(completions),
                  sampled, time.perf_counter() - start - sampled)  # fmt: skip
        return groups

    def _row(self, i: int, completion: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Prompt `i`'s tokens then the completion's, scored on the completion's."""
        prompt = self.data.prompt_ids(i)
        tokens = np.concatenate([prompt, np.asarray(completion, dtype=np.int64)])
        flags = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(completion), bool)])
        return training_row(tokens, flags, np.array([len(tokens)]))

    # --- the batch across a checkpoint (num_iterations > 1) ------------------------------------------------

    def saved(self, next_step: int) -> dict[str, Any] | None:
        """This rank's batch for a checkpoint written after `next_step` steps, when that step still trains on it (in
        the middle of its num_iterations steps): its prompts, completions, advantages and per-position log-probs as
        tensors, its metrics as JSON (runner/checkpoint/store.py `save`'s `rank_items`); None otherwise."""
        mu = self.grpo.num_iterations
        if self.made is None or next_step % mu == 0 or self.made[0] != next_step - next_step % mu:
            return None
        start, ids, groups = self.made
        completions = [c for i in ids for c in groups[i].completions]
        out: dict[str, Any] = {
            "start": torch.tensor([start], dtype=torch.int64),
            "ids": torch.tensor(ids, dtype=torch.int64),
            "lengths": torch.tensor([len(c) for c in completions], dtype=torch.int64),
            "tokens": torch.tensor([t for c in completions for t in c], dtype=torch.int64),
            "advantages": torch.from_numpy(np.concatenate([groups[i].advantages for i in ids]).astype(np.float32)),
            "metrics": json.dumps(self.metrics),
        }
        for kind in ("ref", "old"):
            if all(getattr(groups[i], kind) is not None for i in ids):
                values = [v for i in ids for v in getattr(groups[i], kind)]
                out[kind] = torch.from_numpy(np.concatenate(values).astype(np.float32))
        return out

    def restore(self, items: dict[str, Any]) -> None:
        """The batch `saved` wrote, back as this rank's current one; ValueError naming what does not fit this run's
        prompts and settings (a checkpoint of another data or world size)."""
        g, n = self.grpo.num_generations, len(self.data.prompts)
        try:
            start = int(items["start"].reshape(-1)[0])
            ids = [int(i) for i in items["ids"].tolist()]
            lengths = [int(v) for v in items["lengths"].tolist()]
            tokens = items["tokens"].tolist()
            advantages = items["advantages"].numpy().astype(np.float32)
            metrics = json.loads(items["metrics"])
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            raise ValueError(f"its GRPO batch is incomplete ({type(err).__name__}: {err})") from None
        if not all(0 <= i < n for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"its GRPO batch names prompts outside this run's {n}")
        if len(lengths) != len(ids) * g or len(advantages) != len(lengths) or min(lengths, default=1) < 0 \
                or sum(lengths) != len(tokens) or max(lengths, default=0) > self.grpo.max_completion_length:
            raise ValueError(f"its GRPO batch does not hold {g} completions of at most "
                             f"{self.grpo.max_completion_length} tokens per prompt")  # fmt: skip
        if not isinstance(metrics, dict) or not all(isinstance(v, int | float) for v in metrics.values()):
            raise ValueError("its GRPO batch's metrics are not numbers")
        cuts = np.cumsum([0, *lengths])
        completions = [tokens[cuts[r] : cuts[r + 1]] for r in range(len(lengths))]
        groups = {}
        for k, i in enumerate(ids):
            mine = completions[k * g : (k + 1) * g]
            groups[i] = Group(mine, [self._row(i, c) for c in mine], advantages[k * g : (k + 1) * g])
        widths = [len(row[0]) for i in ids for row in groups[i].rows]
        for kind in ("ref", "old"):
            if kind not in items:
                continue
            values = items[kind].numpy().astype(np.float32)
            if len(values) != sum(widths):
                raise ValueError(f"its GRPO batch's {kind} log-probs do not cover its rows")
            cuts = np.cumsum([0, *widths])
            for k, i in enumerate(ids):
                setattr(groups[i], kind, [values[cuts[k * g + j] : cuts[k * g + j + 1]] for j in range(g)])
        self.made, self.metrics = (start, tuple(ids), groups), metrics

    # --- sampling ------------------------------------------------------------------------------------------

    def _sample(self, ids: list[int], micro_batch: int) -> list[list[int]]:
        """Each prompt's num_generations completions (token ids, EOS kept), in order; OOM halves the prompts a call."""
        size = min(micro_batch, self.gen_prompts or micro_batch)
        out: list[list[int]] = []
        pending = list(ids)
        was_training = self.model.training
        self.model.eval()
        try:
            while pending:
                chunk = pending[:size]
                done = guarded(partial(self._generate, chunk))
                if not self.ctrl.any(done.oom):
                    out += done.value  # type: ignore[operator]
                    pending = pending[size:]
                    continue
                release_memory()
                if size == 1:
                    raise StepOOM(f"out of memory sampling one prompt's {self.grpo.num_generations} completions "
                                  f"({done.reason or 'on another rank'})", self.rank)  # fmt: skip
                log.warning("GRPO sampling: %d -> %d prompts a generate call after an OOM (%s)", size, size // 2,
                            done.reason or "on another rank")  # fmt: skip
                size = self.gen_prompts = size // 2
        finally:
            self.model.train(was_training)
        return out

    @torch.no_grad()
    @eager_forwards()
    def _generate(self, ids: list[int]) -> list[list[int]]:
        g, limit = self.grpo.num_generations, self.grpo.max_completion_length
        prompts = [self.data.prompt_ids(i) for i in ids]
        width = max(len(p) for p in prompts)
        pad = self.data.pad_id
        x = torch.full((len(ids) * g, width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids) * g, width), dtype=torch.long)
        seeds = []
        for k, (i, p) in enumerate(zip(ids, prompts, strict=True)):
            for j in range(g):
                x[k * g + j, width - len(p) :] = torch.from_numpy(p)
                mask[k * g + j, width - len(p) :] = 1
                seeds.append(completion_seed(self.seed, self.sampled_at, i, j))
        from transformers import GenerationConfig, LogitsProcessorList

        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=limit, min_new_tokens=0,
                                  eos_token_id=self.eos, pad_token_id=pad, use_cache=True,
                                  repetition_penalty=1.0)  # fmt: skip
        noise = GumbelNoise(seeds, self.grpo.temperature, self.device, top_k=self.grpo.top_k, top_p=self.grpo.top_p,
                            min_p=self.grpo.min_p, repetition_penalty=self.grpo.repetition_penalty)  # fmt: skip
        with root_unsharded(self.model), generation_defaults(self.generator, config):
            out = self.generator.generate(input_ids=x.to(self.device), attention_mask=mask.to(self.device),
                                          generation_config=config, logits_processor=LogitsProcessorList([noise]),
                                          synced_gpus=self.synced)  # fmt: skip
        completions = []
        eos = set(self.eos)
        for row in out[:, width:].tolist():
            cut = next((t + 1 for t, token in enumerate(row) if token in eos), len(row))
            completions.append(row[:cut])
        return completions

    def _score(self, ids: list[int], groups: dict[int, Group], micro_batch: int,
               scorer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], kind: str) -> None:  # fmt: skip
        """Each completion token's log-prob, `micro_batch` prompts a call, into each group's `kind`: under the starting
        model (`ref`: the adapter off), or under the policy as it samples (`old`: num_iterations > 1)."""
        for chunk in micro_batches(ids, micro_batch):
            rows = [row for i in chunk for row in groups[i].rows]
            x, y = pad_rows(rows, self.data.pad_id, self.data.max_seq_len)
            logps = scorer(torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device))
            values = logps.float().cpu().numpy()
            g = self.grpo.num_generations
            for k, i in enumerate(chunk):
                setattr(groups[i], kind, [values[k * g + j, : len(rows[k * g + j][0])] for j in range(g)])

    # --- metrics -------------------------------------------------------------------------------------------

    def _step_std(self, total: np.ndarray) -> float:
        valid = total[~np.isnan(total)]
        n, s, ss = self.ctrl.all_reduce([float(len(valid)), float(valid.sum()), float((valid**2).sum())])
        return sample_std(n, s, ss, empty=0.0)

    def _metrics(self, per_fn: np.ndarray, total: np.ndarray, completions: list[list[int]], zero_std: int,
                 prompts: int) -> dict[str, float]:  # fmt: skip
        """TRL's rollout metrics over every rank's completions of this step."""
        lengths = np.array([len(c) for c in completions], dtype=np.float64)
        eos = set(self.eos)
        ended = np.array([bool(c) and c[-1] in eos for c in completions])
        columns = [total.reshape(-1), *per_fn.T]
        sums: list[float] = []
        for values in columns:  # count, sum, sum of squares of the non-NaN values
            v = values[~np.isnan(values)]
            sums += [float(len(v)), float(v.sum()), float((v**2).sum())]
        term = lengths[ended]
        sums += [float(len(lengths)), float(lengths.sum()), float((~ended).sum()), float(len(term)), float(term.sum()),
                 float(zero_std), float(prompts)]  # fmt: skip
        big = 1e18
        highs = [lengths.max(initial=-big), -lengths.min(initial=big), term.max(initial=-big), -term.min(initial=big)]
        sums = self.ctrl.all_reduce(sums)
        highs = self.ctrl.all_reduce(highs, "max")
        out: dict[str, float] = {}
        names = ["reward", *(f"rewards/{n}" for n in self.rewards.names)]
        for k, name in enumerate(names):
            n, s, ss = sums[3 * k : 3 * k + 3]
            mean = s / n if n else float("nan")
            std = sample_std(n, s, ss)
            if k == 0:
                out |= {"reward": mean, "reward_std": std}
            else:
                out |= {f"{name}/mean": mean, f"{name}/std": std}
        count, length_sum, clipped, terminated, term_sum, flat, groups = sums[3 * len(names) :]
        out |= {"frac_reward_zero_std": flat / max(groups, 1.0), "completions/mean_length": length_sum / count,
                "completions/min_length": -highs[1], "completions/max_length": highs[0],
                "completions/clipped_ratio": clipped / count}  # fmt: skip
        if terminated:
            out |= {"completions/mean_terminated_length": term_sum / terminated,
                    "completions/min_terminated_length": -highs[3], "completions/max_terminated_length": highs[2]}
        else:  # TRL: zeros when no completion ended
            out |= dict.fromkeys(("completions/mean_terminated_length", "completions/min_terminated_length",
                                  "completions/max_terminated_length"), 0.0)  # fmt: skip
        out = self._logged() | out  # a built-in metric's name keeps the built-in value
        return {k: v for k, v in out.items() if np.isfinite(v)}  # TRL's NaN (no reward applied): left out

    def _logged(self) -> dict[str, float]:
        """The metrics the reward functions logged this step (`log_metric`): each the mean of its values on every
        rank, as TRL averages them; the names agreed first (a function may log one on some ranks only)."""
        logged = self.rewards.take_logged()
        if not self.rewards.custom:
            return {}
        names = sorted({n for part in self.ctrl.all_gather_object(sorted(logged)) for n in part})  # type: ignore[attr-defined]
        sums = self.ctrl.all_reduce([x for n in names for x in (sum(logged.get(n, [])), len(logged.get(n, [])))])
        return {n: sums[2 * k] / sums[2 * k + 1] for k, n in enumerate(names) if sums[2 * k + 1]}
