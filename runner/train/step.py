"""One optimizer step, evaluation, the LR schedule and the stop flag: the mechanics under the loop.

`Stepper.train_step(sample_ids, micro_batch, lr)` is the unit the OOM ladder (issue 5) redoes: it
takes this rank's samples of one optimizer step, cuts them into micro-batches of `micro_batch`,
accumulates gradients, clips, and steps. The loss of
every micro-batch is its summed token cross-entropy divided by the target tokens of the WHOLE global
step (all ranks, all-reduced first) and multiplied by the world size (DDP and FSDP average gradients
over ranks), so the gradient is the global per-token mean whatever the micro-batch size.

Out of memory: after every micro-step all ranks agree on [stop, oom] in one all-reduce (the stop check
did one anyway); when any rank ran out, every rank raises `StepOOM` with the weights untouched and
`runner.oom.shrink.run_step` redoes the step at a smaller micro-batch. DDP over several ranks exchanges
gradients after that agreement (`all_reduce_grads`), never inside a backward one rank may not finish;
FSDP over several ranks keeps its gathers and reduce-scatters inside forward and backward, and the
same agreement runs before each of them (runner/oom/fsdp.py).
"""

from __future__ import annotations

import logging
import math
import signal
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from jobspec.plan.memory import LossKernel
from runner import internals
from runner.data.dataset import IGNORE, Batch, SFTData, micro_batches
from runner.data.loader import Prefetcher
from runner.dist import Control
from runner.model.build import eager_forwards, router_aux_coef
from runner.model.packing import packed_inputs
from runner.oom import fsdp
from runner.oom.detect import Guarded, Headroom, allocated_bytes, guarded, headroom, release_memory
from runner.oom.shrink import RankOOM, StepOOM, agreement, raise_agreed, reset_wrapper
from runner.rl.rollout import RolloutBatch, Rollouts
from runner.train import grpo
from runner.train.loss import ChunkedLossHead, install_chunked_loss
from runner.train.objectives import Objective
from runner.train.update import APPLY_TRIES, PREPARE_TRIES, Update

log = logging.getLogger("jobspec.runner")
T = TypeVar("T")


class Preempted(Exception):
    """Every rank agreed to stop (SIGTERM/SIGINT) before finishing the current step or evaluation."""


def packs_records(position_ids: torch.Tensor | None) -> bool:
    """Whether some row of a packed batch holds more than one record (its positions restart inside it), read on the
    host copy the loader made (no device sync): rows of one record each (long records, the last rows) train as
    unpacked rows, positions and all."""
    if position_ids is None:
        return False
    if position_ids.device.type != "cpu":  # already on the device: reading it would sync; transformers' mask then
        return True
    return bool((position_ids.numpy()[:, 1:] == 0).any())  # numpy's comparison: no torch op, nothing to dispatch


def summed_loss(
    model: torch.nn.Module,
    head: ChunkedLossHead | None,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    router: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Summed token cross-entropy of a micro-batch, in fp32: chunked inside the output layer when the `head` is
    installed (the fp32 logits never whole), else from the logits upcast ((B, T, V) fp32). The step's loss and the
    memory trace's (runner/train/trace.py) are this one function.

    `position_ids` (B, T): a packed batch, whose records restart at 0; given with no attention mask and no cache,
    they make transformers confine attention to each record (runner/model/packing.py). None: as without packing.
    `router`: a mixture-of-experts model's load-balancing loss, as transformers computes it from this forward's
    router logits (`output_router_logits`), is appended to it (unweighted: `Stepper` weights it)."""
    kwargs: dict[str, Any] = {}
    if position_ids is not None:  # no cache either: transformers reads packed positions only without one
        input_ids, labels, kwargs["position_ids"] = packed_inputs(model, input_ids, labels, position_ids)
        kwargs["use_cache"] = False
    if router is not None:
        kwargs["output_router_logits"] = True
    rows = internals.packed_search(position_ids is not None)  # no host sync in the forward
    if head is not None:
        with head.targets(labels, summed=True), rows:  # summed below: backward needs no host sync
            out = model(input_ids=input_ids, **kwargs)  # .logits (B, T, 1): each token's loss, 0 at IGNORE
        summed = out.logits.float().sum()  # FSDP2 may have cast it to its output dtype: sum in fp32
    else:
        with rows:
            out = model(input_ids=input_ids, **kwargs)
        summed = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                 reduction="sum")  # fmt: skip
    if router is not None and getattr(out, "aux_loss", None) is not None:
        router.append(out.aux_loss.float())
    return summed


def token_losses(model: torch.nn.Module, head: ChunkedLossHead | None, input_ids: torch.Tensor,
                 labels: torch.Tensor, router: list[torch.Tensor] | None = None,
                 means: list[torch.Tensor] | None = None, temperature: float = 1.0,
                 entropies: list[torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """(B, T) fp32: each position's token cross-entropy (minus the log-prob of its label), 0 at IGNORE, by the same
    loss head as `summed_loss`; `router` as there. `means`: each position's mean logit over the vocabulary (B, T)
    fp32, detached, is appended to it (TRL's `mean_logits`, for `logits/chosen|rejected`). `temperature`: of the
    logits over it (GRPO scores its completions at the temperature it sampled them). `entropies`: each position's
    entropy of the softmax at that temperature (B, T) fp32, detached, is appended to it (GRPO's `entropy`)."""
    kwargs: dict[str, Any] = {"output_router_logits": True} if router is not None else {}
    unpacked = internals.packed_search(False)  # rows of one record each: no host sync in the forward
    if head is not None:
        found: list[torch.Tensor] | None = None if means is None else []
        spread: list[torch.Tensor] | None = None if entropies is None else []
        with head.targets(labels, found, temperature=temperature, entropies=spread), unpacked:
            out = model(input_ids=input_ids, use_cache=False, **kwargs)
        losses = out.logits.float().flatten(1)  # (B, T, 1) -> (B, T), 0 at IGNORE
        if means is not None and found:
            means.append(found[-1].detach().reshape(labels.shape))
        if entropies is not None and spread:
            entropies.append(spread[-1].detach().reshape(labels.shape))
    else:
        with unpacked:
            out = model(input_ids=input_ids, use_cache=False, **kwargs)
        logits = out.logits.float() / temperature if temperature != 1.0 else out.logits.float()
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                 reduction="none").view(labels.shape)  # fmt: skip
        if means is not None:
            means.append(out.logits.detach().mean(dim=-1, dtype=torch.float32))
        if entropies is not None:
            tempered = logits.detach()
            entropies.append(torch.logsumexp(tempered, -1) - (tempered.softmax(-1) * tempered).sum(-1))
    if router is not None and getattr(out, "aux_loss", None) is not None:
        router.append(out.aux_loss.float())
    return losses


def sequence_logps(model: torch.nn.Module, head: ChunkedLossHead | None, input_ids: torch.Tensor,
                   labels: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(B,) fp32: each row's summed log-prob of its target tokens (minus its summed token cross-entropy)."""
    return -token_losses(model, head, input_ids, labels).sum(1)


class EvalOOM(Exception):
    """Every rank agreed: evaluation ran out of memory even one sample at a time. The evaluation is skipped; training
    goes on (its memory is what the plan is for)."""


class Stopped(BaseException):
    """A stop signal while nothing can be checkpointed yet (setup: data, model build, probe steps, resume; a
    tier step-down's rebuild): the process ends at once, since no step was trained since the last checkpoint.
    A BaseException, like KeyboardInterrupt: no `except Exception` on the way turns it into another error."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum} before training (nothing new to checkpoint)")
        self.signum = signum


# What stops a worker gracefully: the kubelet's and the supervisor's SIGTERM (also the kernel's, when the supervisor
# died: runner/process/lifeline.py), a terminal's Ctrl-C (SIGINT) and Ctrl-\ (SIGQUIT), a closed terminal (SIGHUP).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class StopFlag:
    """Set by a stop signal (STOP_SIGNALS); read at every micro-step. A second SIGINT interrupts at once, and so
    does any stop signal inside `immediate()` (raises `Stopped`)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal received
        self.interrupts = 0  # SIGINTs received (a terminal's Ctrl-C reaches every process of the group)
        self._immediate = 0  # > 0: inside `immediate()`
        self._previous: dict[int, Any] = {}

    def __bool__(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: object) -> None:
        self.interrupts += signum == signal.SIGINT
        if self.interrupts >= 2:
            raise KeyboardInterrupt
        self.signum = self.signum or signum
        if self._immediate:
            raise Stopped(signum)

    @contextmanager
    def immediate(self) -> Iterator[None]:
        """Within: a stop signal (or one that came before) raises `Stopped` where the code is, instead of
        waiting for the loop to read the flag, which setup never does. A signal that lands during a long C
        call (a huge allocation) raises when it returns; the supervisor's kill deadline bounds the rest."""
        self._immediate += 1
        try:
            if self.signum is not None:
                raise Stopped(self.signum)
            yield
        finally:
            self._immediate -= 1

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def get_lr(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """LR for optimizer step `step` (0-based): linear warmup to `peak`, then cosine down to min_ratio * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass
class StepResult:
    """What one optimizer step did on this rank; `loss_sum` stays on the device (no sync) until logged."""

    loss_sum: torch.Tensor  # summed token cross-entropy of this rank's micro-batches, fp32 scalar
    targets: int  # target tokens of the global step (all ranks)
    tokens: int  # input tokens of the global step (all ranks), padding excluded
    grad_norm: torch.Tensor | None  # before clipping; None when clipping is off
    sample_ids: list[int] = field(default_factory=list)  # this rank's samples, in the order processed
    # a preference objective: this rank's sums behind its metrics over its pairs (runner/train/objectives.py, fp32);
    # None for SFT
    preference: torch.Tensor | None = None
    # a mixture-of-experts model: its router's load-balancing loss (unweighted), the mean over this rank's micro-batches
    router_aux: torch.Tensor | None = None
    denominator: float = 0.0  # what the step's loss is divided by (0: `targets`; GRPO's loss types: Objective)
    extremes: torch.Tensor | None = None  # GRPO: this rank's values reduced by max over ranks (grpo.CLIP_EXTREMES)


class Stepper:
    """Runs steps and evaluations on a prepared (accelerator, model, optimizer)."""

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        optimizer: Any,
        data: SFTData,
        ctrl: Control,
        stop: StopFlag,
        *,
        max_grad_norm: float | None,
        prefetch: Prefetcher | None = None,
        loss_kernel: LossKernel = "chunked",
        objective: Objective | None = None,
        rows: int = 1,
    ):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.objective = objective  # a preference objective, for batches of pairs (runner/train/objectives.py)
        self.rows = rows  # sequences a sample is: a pair's 2 rows, which a probe step of its micro-batch runs
        self.preference_sums: list[torch.Tensor] = []  # pairs: each micro-batch's metric sums in this step
        self.extremes: list[torch.Tensor] = []  # GRPO: each micro-batch's values reduced by max (grpo.CLIP_EXTREMES)
        self.router_losses: list[torch.Tensor] = []  # a mixture of experts: each micro-batch's load-balancing loss
        self.nll_scale = 1.0  # ORPO: the step's (or evaluation's) pairs over its chosen chats' positions
        self.data, self.ctrl, self.stop = data, ctrl, stop
        self.max_grad_norm = max_grad_norm
        self.device = accelerator.device
        # accelerate's optimizer wrapper costs ~0.5 ms a step in package lookups (is_lomo_available,
        # inspect.signature): the update steps the optimizer under it (fp16's scaler, clipping of DTensor shards and
        # the step are runner/train/update.py's)
        self.inner = getattr(optimizer, "optimizer", optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.prefetch = prefetch  # None: collate in process (probe steps, tests)
        self.rollouts: Rollouts | None = None  # GRPO: the step's rows are sampled (set by the recipe)
        self.world_size = ctrl.world_size
        self.rank = accelerator.process_index
        # DDP exchanges gradients after the OOM agreement (all_reduce_grads), not inside the last backward
        self.manual_sync = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.sharded_ranks = self.world_size > 1 and not self.manual_sync  # FSDP over several ranks
        # FSDP over several ranks: agree before each of its collectives (runner/oom/fsdp.py); None: restart
        self.gate = fsdp.install(model, ctrl, self.rank) if self.sharded_ranks else None
        # the end of a step (exchange, clipping, optimizer step) as a transaction (runner/train/update.py)
        self.update = Update(self.inner, self.params, world_size=self.world_size, manual_sync=self.manual_sync,
                             max_grad_norm=max_grad_norm, scaler=accelerator.scaler, device=self.device)  # fmt: skip
        self.eval_micro_batch: int | None = None  # evaluation's micro-batch after an OOM in it (kept for later ones)
        # a mixture-of-experts model's load-balancing loss weight (None: none; runner/model/build.py)
        self.router_aux_coef = router_aux_coef(accelerator.unwrap_model(model))
        # the loss from the hidden states in chunks, inside the model's forward (runner/train/loss.py)
        self.head = install_chunked_loss(
            accelerator.unwrap_model(model), run=model, device=self.device, kernel=loss_kernel
        )
        # JOBSPEC_FAULT_OOM's op=N: the region ("train", "eval", "probe") and micro-batch -> the context that injects
        # (runner/oom/faults.py `FaultInjector.region`); a null context when no fault is set
        self.faults: Callable[[str, int], AbstractContextManager[Any]] = lambda _during, _mbs: nullcontext()

    def agree(self, oom: str, *, stop: bool = True, optimizer: bool = False, room: Headroom | None = None,
              in_model: bool = True) -> None:  # fmt: skip
        """One all-reduce MAX over ranks of [stop flag, OOM flag, rank]: StepOOM (OptimizerOOM) on every rank
        when any ran out, else Preempted on every rank when any has the stop flag (if `stop`). `in_model`: the OOM
        came from the model's forward or backward, where other ranks may wait in one of FSDP's collectives."""
        if oom and in_model and self.sharded_ranks and self.gate is None:
            # the others may wait in an FSDP collective this rank will not join: do not start another one
            raise RankOOM(oom, self.rank)
        mine = agreement(stop and bool(self.stop), oom, self.rank, self.world_size, room)
        flags = self.ctrl.all_reduce(mine, "max")
        raise_agreed(flags, oom, self.world_size, optimizer=optimizer)
        if flags[0]:
            raise Preempted

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # Tensors the loader pinned copy asynchronously; pinning here would be one more host copy.
        return t.to(self.device, non_blocking=t.is_pinned())

    def loss_sum(self, batch: Batch, router: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Summed token cross-entropy of a micro-batch, in fp32 (`summed_loss`); `router`: see there. A batch of
        pairs: the preference objective's loss summed over its pairs (runner/train/objectives.py), its metric sums
        kept in `preference_sums`."""
        if isinstance(batch, RolloutBatch):
            return self._rollout_loss(batch, router)
        if batch.pairs:
            return self._pair_loss(batch, router)
        positions = None if not packs_records(batch.position_ids) else self._to_device(batch.position_ids)
        return summed_loss(
            self.model, self.head, self._to_device(batch.input_ids), self._to_device(batch.labels), positions, router
        )

    def _pair_loss(self, batch: Batch, router: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One forward over the batch's 2B rows; ORPO scores its chosen rows on every next token (its NLL term)."""
        objective = self.objective
        if objective is None:
            raise ValueError("a batch of preference pairs, but training.objective is sft")
        x, y = self._to_device(batch.input_ids), self._to_device(batch.labels)
        chosen = None
        scored = y
        if objective.scores_chosen_chat and batch.chosen_labels is not None:
            chosen = self._to_device(batch.chosen_labels)
            scored = torch.cat([chosen, y[len(chosen) :]])
        means: list[torch.Tensor] = []
        if objective.name == "kto":  # the KL rows (the second half) without gradients first, as TRL's KL pass
            half = len(x) // 2
            with torch.no_grad():
                kl_rows = token_losses(self.model, self.head, x[half:], y[half:])
            losses = torch.cat([token_losses(self.model, self.head, x[:half], y[:half], router, means), kl_rows])
        else:
            losses = token_losses(self.model, self.head, x, scored, router, means)
        loss, sums = objective.loss(losses, y, reference=batch.reference, chosen_labels=chosen,
                                    nll_scale=self.nll_scale, mean_logits=means[0] if means else None,
                                    desirable=getattr(batch, "desirable", None))  # fmt: skip
        self.preference_sums.append(sums)
        return loss

    def _rollout_loss(self, batch: RolloutBatch, router: list[torch.Tensor] | None = None) -> torch.Tensor:
        """GRPO: one forward over the micro-batch's completions, scored at the sampling temperature
        (runner/train/grpo.py); the KL metric's sums kept in `preference_sums`, the clip ratios' extremes in
        `extremes`."""
        objective = self.objective
        if objective is None or batch.advantages is None:
            raise ValueError("a GRPO batch, but training.objective is not grpo")
        x, y = self._to_device(batch.input_ids), self._to_device(batch.labels)
        entropies: list[torch.Tensor] = []
        losses = token_losses(self.model, self.head, x, y, router, temperature=objective.temperature,
                              entropies=entropies)  # fmt: skip
        ref = None if batch.ref_logps is None else self._to_device(batch.ref_logps)
        old = None if batch.old_logps is None else self._to_device(batch.old_logps)
        loss, sums = grpo.loss(losses, y, batch.advantages, ref, objective.beta, objective.loss_type,
                               entropies[0] if entropies else None, old, *objective.clip,
                               sapo=objective.sapo)  # fmt: skip
        self.preference_sums.append(sums[: grpo.SUMS])
        self.extremes.append(sums[grpo.SUMS :])
        return loss

    def _set_nll_scale(self, ids: Sequence[int], counts: Sequence[float], split: str) -> list[float]:
        """All-reduce `counts` (with ORPO, this rank's chosen positions of `ids` after them) and set `nll_scale` from
        the global pairs and chosen positions; returns the reduced `counts`."""
        orpo = self.objective is not None and self.objective.scores_chosen_chat
        chosen = getattr(self.data, "chosen_positions", None)  # PreferenceData's (runner/data/preference.py)
        extra = [float(chosen(ids, split)), float(len(ids))] if orpo and chosen is not None else []
        reduced = self.ctrl.all_reduce([*counts, *extra])
        if extra:
            self.nll_scale = reduced[-1] / max(reduced[-2], 1.0)
            return reduced[: len(counts)]
        return reduced

    def train_step(self, sample_ids: Sequence[int], micro_batch: int, lr: float) -> StepResult:
        """Accumulate over this rank's `sample_ids` in micro-batches of `micro_batch`, then one optimizer step.

        Safe to call again with the same ids after an exception: gradients are cleared first. Raises
        StepOOM / OptimizerOOM on every rank when any rank ran out of memory (see the module docstring).
        """
        try:
            with self.faults("train", micro_batch):
                return self._train_step(sample_ids, micro_batch, lr)
        except BaseException:
            self.update.abandon()  # the step is redone or handed over: fp16's scaler forgets its unscale
            raise

    def _train_step(self, sample_ids: Sequence[int], micro_batch: int, lr: float) -> StepResult:
        self.inner.zero_grad(set_to_none=True)
        self.preference_sums, self.router_losses, self.extremes = [], [], []
        baseline = allocated_bytes()  # what the step starts with: an OOM's numbers are read against it
        if self.rollouts is not None:  # GRPO: sampled by the model, once per step (runner/rl/rollout.py)
            batches: Sequence[Batch] = self.rollouts.batches(sample_ids, micro_batch)
        elif self.prefetch is not None:
            batches = self.prefetch.batches(sample_ids, micro_batch)
        else:
            batches = [self.data.collate(ids) for ids in micro_batches(sample_ids, micro_batch)]
        counts = [sum(b.targets for b in batches), sum(b.tokens for b in batches)]
        targets, tokens = self._set_nll_scale(sample_ids, counts, "train")
        samples = len(sample_ids) * self.world_size  # every rank's share is the same (the plan's exact batch)
        per = targets if self.objective is None else self.objective.denominator(targets, samples)
        scale = self.world_size / max(per, 1.0)  # the global mean (per token), undoing the ranks' gradient average
        losses: list[torch.Tensor] = []  # each micro-step's summed loss (detached), summed by the update
        seen: list[int] = []
        oom, room = "", None  # this rank's OOM in the previous micro-step, agreed on before the next one starts
        for i, batch in enumerate(batches):
            self.agree(oom, room=room)
            # FSDP reduce-scatters every micro-batch's gradients: skipping it (no_sync) would hold them unsharded
            # in fp32, 4 bytes a parameter on every rank, what the sharded tiers are chosen to avoid (the memory
            # model counts sharded gradients). DDP accumulates locally and exchanges once (runner/train/update.py).
            sync = self.world_size == 1 or self.sharded_ranks or (i == len(batches) - 1 and not self.manual_sync)
            with nullcontext() if sync else self.accelerator.no_sync(self.model):
                out = self._micro_step(batch, scale, 1.0 / len(batches))
            if out.oom:
                oom, room = out.reason, headroom(out.info, baseline, len(batch.sample_ids))
                log.warning("rank %d: out of memory in micro-step %d of %d (%d samples): %s", self.rank, i + 1,
                            len(batches), len(batch.sample_ids), oom)  # fmt: skip
            else:
                losses.append(out.value)
                seen += batch.sample_ids
        norm, loss_sum = self._finish(oom, room, losses, lr)
        self.inner.zero_grad(set_to_none=True)
        preference = torch.stack(self.preference_sums).sum(0) if self.preference_sums else None
        extremes = torch.stack(self.extremes).amax(0) if self.extremes else None
        router_aux = torch.stack(self.router_losses).mean() if self.router_losses else None
        return StepResult(loss_sum, int(targets), int(tokens), norm, seen, preference, router_aux, per, extremes)

    def _finish(self, oom: str, room: Headroom | None, losses: Sequence[torch.Tensor],
                lr: float) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
        """After the last micro-step (whose OOM is `oom`): every rank agrees on it, DDP exchanges the gradients, then
        the update (`_update`). Returns (grad norm, summed loss); StepOOM / OptimizerOOM on every rank."""
        if not oom and self.manual_sync:  # the exchange's zero gradients and buffer: on this agreement too
            oom = guarded(self.update.prepare_exchange).reason
        self.agree(oom, stop=False, room=room)  # the last micro-step's outcome, known to all before gradients move
        if self.manual_sync:
            self.update.exchange()
        return self._update(losses, lr)

    def _update(self, losses: Sequence[torch.Tensor], lr: float) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Clip and step as a transaction (runner/train/update.py): `prepare` allocates and changes nothing, and every
        rank agrees on it (again once after an OOM); `apply` changes and allocates nothing, a rank that fails in it
        goes on from where it stopped, and every rank agrees on the outcome. Returns (grad norm, summed loss)."""
        prepared = None
        for attempt in range(1, PREPARE_TRIES + 1):
            baseline = allocated_bytes()
            out = guarded(partial(self.update.prepare, losses, self.device))
            if not out.oom:
                prepared = out.value
            try:
                self.agree(out.reason, stop=False, in_model=False)
                break
            except StepOOM as err:
                if attempt == PREPARE_TRIES:
                    why = f"out of memory before the optimizer step: {err.reason}"
                    raise StepOOM(why, err.rank, update=True) from None
                log.warning("rank %d: out of memory preparing the optimizer step (%s): again, with memory released",
                            self.rank, err.reason)  # fmt: skip
                prepared = None
                release_memory(baseline)
        assert prepared is not None
        reason = ""
        for attempt in range(1, APPLY_TRIES + 1):
            applied = guarded(partial(self.update.apply, prepared, lr))
            if not applied.oom:
                reason = ""
                break
            reason = applied.reason
            log.warning("rank %d: out of memory in the optimizer step (try %d of %d): %s", self.rank, attempt,
                        APPLY_TRIES, reason)  # fmt: skip
            release_memory()
        self.agree(reason, stop=False, optimizer=True, in_model=False)  # a stop now would lose a finished step
        return (applied.value if not reason else None), prepared.loss_sum

    def _micro_step(self, batch: Batch, scale: float, share: float = 1.0) -> Guarded[torch.Tensor]:
        """Forward and backward of one micro-batch (`_gated`); `share`: its part of the step's micro-batches."""
        return self._gated(partial(self._accumulate, batch, scale, share))

    def _gated(self, run: Callable[[], T]) -> Guarded[T]:
        """`run` (a forward, or a forward and backward); an OOM on this rank comes back as `oom=True`. With the
        FSDP gate armed, another rank's OOM agreed before one of FSDP's collectives raises StepOOM here,
        at once: that agreement was this micro-step's (no other all-reduce follows)."""
        if self.gate is None:
            return guarded(run)
        self.gate.armed = True
        try:
            return guarded(run)
        except fsdp.PeerOOM as peer:
            flags = peer.flags
            traceback.clear_frames(peer.__traceback__)  # its frames hold the failed forward's tensors
        finally:
            self.gate.armed = False
        log.warning("rank %d: rank %d ran out of memory; agreed before an FSDP collective, no rank waits in it",
                    self.rank, self.world_size - int(flags[2]))  # fmt: skip
        raise_agreed(flags, "", self.world_size)
        raise AssertionError("an agreed PeerOOM always carries the OOM flag")  # pragma: no cover

    def _accumulate(self, batch: Batch, scale: float, share: float) -> torch.Tensor:
        """Backward of the micro-batch's part of the step's loss: its token cross-entropy over the step's targets
        (`scale`) and, for a mixture-of-experts model, its router's load-balancing loss weighted as transformers
        weighs it (`router_aux_loss_coef`) and averaged over the step's micro-batches (`share`) and, through the
        gradients' average, its ranks. The returned loss is the cross-entropy alone (what metrics report)."""
        router: list[torch.Tensor] | None = [] if self.router_aux_coef else None
        ce = self.loss_sum(batch, router)
        loss = ce * scale
        if router:
            loss = loss + router[0] * (self.router_aux_coef * share)
            self.router_losses.append(router[0].detach())
        self.accelerator.backward(loss)
        return ce.detach()

    @torch.no_grad()
    @eager_forwards()
    def evaluate(self, sample_ids: Sequence[int], micro_batch: int) -> tuple[float, int]:
        """(mean token loss, target tokens) over this rank's eval ids, reduced over ranks.

        Under the same agreement as training: after every micro-batch every rank learns whether any ran out of
        memory (the stop check's all-reduce carries it; on a sharded tier the FSDP gate is armed too), and then all
        redo that micro-batch at half the size (kept for later evaluations). Raises EvalOOM on every rank when even
        one sample at a time runs out."""
        size = min(micro_batch, self.eval_micro_batch or micro_batch)
        if self.objective is not None and self.objective.scores_chosen_chat:
            self._set_nll_scale(sample_ids, [], "eval")  # ORPO's NLL: a mean over the whole evaluation's positions
        parts: list[torch.Tensor] = []
        targets = 0
        pending = list(sample_ids)
        self.model.eval()
        try:
            with self.faults("eval", micro_batch):
                while pending:
                    ids = pending[:size]
                    try:
                        out = self._gated(partial(self._eval_micro_step, ids))
                        self.agree(out.reason)  # StepOOM on every rank when any ran out; Preempted on a stop
                    except RankOOM:
                        raise  # no agreement possible (no FSDP gate): the others may wait in a collective
                    except StepOOM as err:
                        reason = err.reason
                    else:
                        parts.append(out.value[0])
                        targets += out.value[1]
                        pending = pending[size:]
                        continue
                    reset_wrapper(self.model)
                    release_memory()
                    if size == 1:
                        raise EvalOOM(f"evaluation ran out of memory one sample at a time: {reason}")
                    log.warning("evaluation: micro-batch %d -> %d after an OOM (%s)", size, size // 2, reason)
                    size = self.eval_micro_batch = size // 2
        finally:
            self.model.train()
        loss, n = self.ctrl.all_reduce([sum(float(p) for p in parts), targets])
        return loss / max(n, 1.0), int(n)

    def _eval_micro_step(self, ids: Sequence[int]) -> tuple[torch.Tensor, int]:
        batch = self.data.collate(ids, split="eval")
        return self.loss_sum(batch), batch.targets

    def probe_step(self, micro_batch: int, seq_len: int) -> bool:
        """A full training step at (micro_batch samples of `rows` sequences each, seq_len) on random tokens that
        changes nothing (lr 0, gradients dropped), under the training step's agreements: False on every rank when any
        ran out of memory. For `runner.sizing.plan.verify_micro_batch`; call `reset_optimizer` afterwards."""
        vocab = self.model_vocab()
        g = torch.Generator().manual_seed(micro_batch)
        rows = micro_batch * self.rows  # a DPO micro-batch of m pairs is 2m sequences
        x = torch.randint(0, vocab, (rows, seq_len), generator=g)
        batch = Batch(x, x.clone(), rows * seq_len, rows * seq_len, ())
        lrs = [float(group["lr"]) for group in self.inner.param_groups]  # a 0-d tensor (torchao's) is set in place
        self.inner.zero_grad(set_to_none=True)
        try:
            with self.faults("probe", micro_batch):
                # DDP exchanges after the agreement, as in a training step (never inside a backward one rank may
                # not finish)
                with self.accelerator.no_sync(self.model) if self.manual_sync else nullcontext():
                    out = self._micro_step(batch, 1.0 / batch.targets)
                self._finish(out.reason, None, [out.value], 0.0)  # AdamW at lr 0 leaves the weights bit-identical
            return True
        except StepOOM as err:
            log.info("probe step at micro-batch %d: out of memory (%s)", micro_batch, err.reason)
            self.update.abandon()
            return False
        finally:
            self.inner.zero_grad(set_to_none=True)
            for group, lr in zip(self.inner.param_groups, lrs, strict=True):
                if isinstance(group["lr"], torch.Tensor):  # torchao's AdamW8bit keeps it as a 0-d tensor
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr

    def reset_optimizer(self) -> None:
        """Forget the moments the probe steps created (the first real step starts Adam afresh)."""
        self.inner.state.clear()

    def model_vocab(self) -> int:
        unwrapped = self.accelerator.unwrap_model(self.model)
        return int(unwrapped.get_input_embeddings().num_embeddings)
