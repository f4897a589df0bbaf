"""The end of a training step as a transaction: gradient exchange, clipping and the optimizer step, recoverable
from an out-of-memory error at any op on any rank.

An allocator can fail anywhere; an optimizer step that fails half-way leaves some moments or parameters updated
and others not, and on several ranks some ranks updated and others not. So the end of the step is cut in phases
by what they do to memory and to state:

    prepare   (allocates, changes nothing)  the step's summed loss; zero gradients for trainable parameters that
              got none; the gradient bucket buffer of DDP's exchange (allocated once, kept); Adam's state where
              there is none yet (`prime`); the fp16 scaler's unscale; the gradient norm of this rank's (local or
              sharded) gradients and the scalars clipping needs; a copy of Adam's step counters
    exchange  (no allocation)  DDP over several ranks: gradients averaged in place through the bucket buffer
    apply     (no allocation by design, mutates)  a sharded norm all-reduced in place, the clip coefficient and
              the gradients scaled in place, then the optimizer step (fused AdamW: one kernel a group, and Adam's
              state exists before the first step: `prime`)

Every rank agrees on the outcome of `prepare` (the caller's all-reduce, which the OOM flags ride on) before
anything changes: an OOM there leaves weights, gradients and Adam's state as they were, on every rank, and
`prepare` is simply run again once (`PREPARE_TRIES`) after the memory is released; when it fails again the step
is handed to the ladder with the weights intact (`StepOOM` with `update=True`). `apply` holds no collective but
the sharded norm's all-reduce, which runs first, before anything can fail; an error after it is retried on that
rank alone, from where it stopped (`Progress`: clipped or not, the groups already stepped, Adam's step counters
put back), so a rank that ran out catches up with the others instead of leaving them on different weights. Only
when that fails too (`APPLY_TRIES`) do the weights differ between ranks: `OptimizerOOM`, the newest checkpoint.

Clipping is torch's `clip_grad_norm_` arithmetic (the same norm and coefficient, bit for bit on one rank:
`reciprocal(norm + 1e-6) * max_norm`, clamped at 1), with the cross-rank sum of a sharded model's norm done by
hand so that it is the one collective and it runs before anything can fail. Measured on the tiny preset, CPU:
no difference in step time against accelerate's clipping (the same ops; the norm's all-reduce is the one
DTensor issues).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runner import internals
from runner.dist import joined

PREPARE_TRIES = 2  # `prepare` after an agreed OOM: once more, then the ladder
APPLY_TRIES = 3  # `apply` on a rank that failed in it: twice more, alone, from where it stopped
BUCKET_BYTES = 25 * 1024**2  # DDP's default bucket size; a gradient at least this large is exchanged on its own


def _adam_state(group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """The state torch's Adam/AdamW creates for `p` at its first step (torch/optim/adam.py `_init_group`): step 0
    (a 0-d float32 on the parameter's device for the fused and capturable kernels, on the CPU otherwise) and zero
    moments shaped like the parameter (a DTensor for a sharded one)."""
    on_device = group.get("fused") or group.get("capturable")
    step = torch.zeros((), dtype=torch.float32, device=p.device) if on_device else torch.tensor(0.0)
    state = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}  # fmt: skip
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def prime(optimizer: Any, params: Sequence[torch.nn.Parameter]) -> bool:
    """Create Adam's state (zero moments, step 0) for every trainable parameter that has none, as its first step
    would: the step that follows then allocates no state, so it cannot run out of memory half-way through it.

    torch's Adam and AdamW, and torchao's AdamW8bit: the state their first step creates (`_adam_state`,
    `internals.new_state`), every new entry built before any is stored, so an OOM leaves none half-made (a state
    with `exp_avg` but no `exp_avg_sq` breaks the next step). Any other optimizer (zero2_offload's host AdamW) by
    its own code: a step on zero gradients with lr 0, which leaves every parameter bit for bit as it was (decay
    factor 1 - 0, update 0), then every state tensor set to zero, and the states it made removed if it fails.
    Returns whether anything was created. SGD without momentum (`training.optimizer: sgd`) keeps no state: none
    to create."""
    if isinstance(optimizer, torch.optim.SGD) and not any(g["momentum"] for g in optimizer.param_groups):
        return False
    missing = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not missing:
        return False
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or internals.is_low_bit(optimizer):
        group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
        make = internals.new_state if internals.is_low_bit(optimizer) else lambda o, p: _adam_state(group_of[p], p)
        made = {p: make(optimizer, p) for p in missing}
        for p, state in made.items():
            optimizer.state[p] = state
        return True
    held = {p: p.grad for p in params}
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    except BaseException:
        for p in missing:
            optimizer.state.pop(p, None)
        raise
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, g in held.items():
            p.grad = g
    for p in missing:
        for key, value in optimizer.state[p].items():
            if isinstance(value, torch.Tensor):
                value.zero_()
            elif isinstance(value, (int, float)):
                optimizer.state[p][key] = type(value)(0)
    return True


def runs(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in order, cut into runs of one dtype and device of at most BUCKET_BYTES together (a larger one alone):
    DDP's buckets. A run of several goes through the shared buffer, a run of one is all-reduced in place."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        same = last is not None and (last[0].dtype, last[0].device) == (t.dtype, t.device)
        if same and size + nbytes <= BUCKET_BYTES:
            last.append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out


def _snapshot(states: list[dict[str, Any]]) -> list[tuple[dict[str, Any], torch.Tensor, int]]:
    """A copy of every state's 0-d step counter: one stacked tensor a device (one kernel, not one per parameter)."""
    by_device: dict[torch.device, list[dict[str, Any]]] = {}
    for state in states:
        by_device.setdefault(state["step"].device, []).append(state)
    out = []
    for group in by_device.values():
        saved = torch.stack([state["step"] for state in group])
        out += [(state, saved, row) for row, state in enumerate(group)]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _sharded(t: torch.Tensor) -> bool:
    return callable(getattr(t, "to_local", None))


@dataclass
class Progress:
    """How far `apply` got on this rank, so a retry goes on from there and never does a part twice."""

    reduced: bool = False  # the sharded norm's all-reduce (a collective: exactly once)
    clipped: bool = False
    stepped: int = 0  # parameter groups stepped
    param: int = 0  # parameters of the next group stepped (an optimizer stepped parameter by parameter)
    scaled: bool = False  # the fp16 scaler's update


@dataclass
class Prepared:
    """What `prepare` allocated for one step: the summed loss, the norm and clip scalars, the step counters."""

    loss_sum: torch.Tensor
    norm: torch.Tensor | None = None  # this rank's norm (squared when it is summed over ranks), then the total
    coef: dict[torch.device, torch.Tensor] | None = None  # the clip coefficient's buffer on each gradient device
    # Adam's step counters as they were: (state, the stacked copy of its device's counters, its row in it)
    counters: list[tuple[dict[str, Any], torch.Tensor, int]] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)


class Update:
    """The end of a step on one rank (see the module docstring). `inner` is the optimizer itself (under accelerate's
    wrapper), `params` the trainable parameters, `scaler` accelerate's fp16 GradScaler or None."""

    def __init__(self, inner: Any, params: Sequence[torch.nn.Parameter], *, world_size: int, manual_sync: bool,
                 max_grad_norm: float | None, scaler: Any = None, device: torch.device | None = None):  # fmt: skip
        self.inner, self.params = inner, list(params)
        self.device = device or (self.params[0].device if self.params else torch.device("cpu"))
        self.world_size, self.manual_sync = world_size, manual_sync
        self.max_grad_norm, self.scaler = max_grad_norm, scaler
        # DDP's exchange buffers by (dtype, device), allocated by the first `prepare_exchange` and kept
        self.buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] | None = None
        self.unscaled = False  # fp16: the scaler unscaled this step's gradients already
        # torch's optimizers step group by group; torchao's host optimizer (zero2_offload) steps every parameter
        # at once and keeps its own groups; torchao's AdamW8bit runs a kernel a parameter, each allocating its fp32
        # working copies: it steps parameter by parameter, so a retry after an OOM steps none twice
        self.by_group = isinstance(inner, torch.optim.Optimizer) and not hasattr(inner, "offload")
        self.by_param = internals.is_low_bit(inner)

    # --- prepare: allocates, changes nothing -------------------------------------------------------------------

    def prepare_exchange(self) -> None:
        """DDP over several ranks, before the exchange: zero gradients for trainable parameters that got none (every
        rank sends the same buckets) and the bucket buffer (once). Idempotent."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.buffers is None:
            self.buffers = {}
            for run in runs(self.params):
                if len(run) > 1:  # the largest run of several, per dtype and device
                    key, n = (run[0].dtype, run[0].device), sum(t.numel() for t in run)
                    if n > (self.buffers[key].numel() if key in self.buffers else 0):
                        self.buffers[key] = torch.empty(n, dtype=key[0], device=key[1])

    def prepare(self, losses: Sequence[torch.Tensor], device: torch.device) -> Prepared:
        """The step's summed loss, fp16 unscaling, the gradient norm and clip buffer, a copy of Adam's step counters."""
        loss_sum = torch.stack(list(losses)).sum() if losses else torch.zeros((), device=device)
        prepared = Prepared(loss_sum)
        if self.by_group:  # torch's AdamW: its state before anything changes (the planner's probes clear it)
            prime(self.inner, self.params)
        if self.scaler is not None and not self.unscaled:
            self.scaler.unscale_(self.inner)  # in place, once a step (the scaler refuses a second time)
            self.unscaled = True
        if self.max_grad_norm is not None:
            prepared.norm, prepared.coef = self._norm()
        prepared.counters = _snapshot([s for s in self._states() if isinstance(s.get("step"), torch.Tensor)])
        return prepared

    def abandon(self) -> None:
        """The step is given up after `prepare` (it is redone, or the ladder takes over): the fp16 scaler forgets that
        it unscaled this step's gradients, which are dropped."""
        if self.scaler is not None and self.unscaled:
            internals.reset_scaler(self.scaler)
        self.unscaled = False

    def _states(self) -> list[dict[str, Any]]:
        state = self.inner.state
        return [state[p] for p in self.params if p in state]

    def _buckets(self) -> list[list[torch.Tensor]]:
        """The gradients in exchange order (`runs`)."""
        return runs([p.grad for p in self.params if p.grad is not None])

    def _norm(self) -> tuple[torch.Tensor, dict[torch.device, torch.Tensor]]:
        """(this rank's gradient norm, an empty clip coefficient for each device gradients live on), as torch's
        clip_grad_norm_ computes the norm: the 2-norm of the per-tensor 2-norms. A sharded model's local norm comes
        back squared, to be summed over ranks, on the training device (`minimal` keeps its gradients on the host,
        and NCCL sums device tensors only)."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            zero = torch.zeros((), device=self.device)
            return zero, {zero.device: torch.empty_like(zero)}
        total = torch.nn.utils.get_total_norm(grads, 2.0)  # what clip_grad_norm_ computes (torch >= 2.6)
        if self._sharded_ranks():
            total = total.square().to(self.device)
        coefs = {total.device: torch.empty_like(total)}
        for g in grads:
            if g.device not in coefs:
                coefs[g.device] = torch.empty((), dtype=total.dtype, device=g.device)
        return total, coefs

    def _sharded_ranks(self) -> bool:
        return self.world_size > 1 and any(_sharded(p) for p in self.params)

    # --- exchange: no allocation --------------------------------------------------------------------------------

    def exchange(self) -> None:
        """DDP over several ranks: average the gradients in place (through the bucket buffer for small ones), as
        DDP's reducer would. Every rank calls it with the same buckets, after the agreement on `prepare`."""
        assert self.buffers is not None
        for bucket in self._buckets():
            if len(bucket) == 1:
                joined(lambda g=bucket[0]: dist.all_reduce(g), "gradient all-reduce")
                bucket[0].div_(self.world_size)
                continue
            n = sum(g.numel() for g in bucket)
            flat = self.buffers[(bucket[0].dtype, bucket[0].device)][:n]
            torch.cat([g.view(-1) for g in bucket], out=flat)
            joined(lambda flat=flat: dist.all_reduce(flat), "gradient all-reduce")
            flat.div_(self.world_size)
            offset = 0
            for g in bucket:
                g.view(-1).copy_(flat[offset : offset + g.numel()])
                offset += g.numel()

    # --- apply: mutates, allocates nothing ----------------------------------------------------------------------

    def apply(self, prepared: Prepared, lr: float) -> torch.Tensor | None:
        """Clip and step, going on from `prepared.progress`; returns the gradient norm before clipping (None: no
        clipping). An error leaves `progress` where it stopped, with Adam's step counters of the groups not yet
        stepped as they were, so calling again finishes the step exactly once."""
        p = prepared.progress
        try:
            if prepared.norm is not None and not p.reduced:
                if self._sharded_ranks():  # the one collective, before anything can fail
                    norm = prepared.norm
                    joined(lambda: dist.all_reduce(norm, group=self._norm_group()), "gradient-norm all-reduce")
                    prepared.norm.sqrt_()
                p.reduced = True
            if prepared.norm is not None and not p.clipped:
                assert prepared.coef is not None and self.max_grad_norm is not None
                coef = prepared.coef[prepared.norm.device].copy_(prepared.norm)
                coef.add_(1e-6).reciprocal_().mul_(self.max_grad_norm).clamp_(max=1.0)
                by_device: dict[torch.device, list[torch.Tensor]] = {}
                for q in self.params:
                    if q.grad is not None:
                        g = _local(q.grad)
                        by_device.setdefault(g.device, []).append(g)
                for device, grads in by_device.items():
                    here = prepared.coef[device]
                    if here is not coef:
                        here.copy_(coef)
                    internals.foreach_mul_(grads, here)
                p.clipped = True
            internals.set_lr(self.inner, lr)
            self._step(p)
        except BaseException:
            self._restore_counters(prepared)
            raise
        return prepared.norm

    def _step(self, p: Progress) -> None:
        if self.scaler is not None:  # fp16: the scaler skips a step with inf/NaN gradients, then moves its scale
            if not p.scaled:
                self._scaled_step(p)
                self.scaler.update()
                p.scaled = True
                self.unscaled = False
            return
        self._groups(p)

    def _scaled_step(self, p: Progress) -> None:
        """What GradScaler.step does after its unscale (done in `prepare`), group by group: a fused AdamW gets the
        inf flags and skips inside its kernel (no host sync); any other optimizer is stepped only without an inf."""
        if not self.by_group:  # torchao's host optimizer (zero2_offload): one step, as GradScaler.step runs it
            if p.stepped == 0:
                self.scaler.step(self.inner)
                p.stepped = len(self.inner.param_groups)
            return
        found = internals.scaler_found_inf(self.scaler, self.inner)
        if not internals.fused_amp_step(self.inner):
            if float(found):
                p.stepped = len(self.inner.param_groups)
            self._groups(p)
            return
        self.inner.grad_scale, self.inner.found_inf = None, found  # unscaled already
        try:
            self._groups(p)
        finally:
            del self.inner.grad_scale, self.inner.found_inf

    def _groups(self, p: Progress) -> None:
        """The optimizer's step, one parameter group at a time from `p.stepped` (all at once where it keeps its own
        groups); `p.stepped` counts each group done."""
        if not self.by_group:
            if p.stepped == 0:
                self.inner.step()
                p.stepped = len(self.inner.param_groups)
            return
        groups = self.inner.param_groups
        while p.stepped < len(groups):
            group = groups[p.stepped]
            parts = [{**group, "params": [q]} for q in group["params"][p.param :]] if self.by_param else [group]
            for part in parts:
                self.inner.param_groups = [part]
                try:
                    self.inner.step()
                finally:
                    self.inner.param_groups = groups
                p.param += self.by_param
            p.stepped, p.param = p.stepped + 1, 0

    def _restore_counters(self, prepared: Prepared) -> None:
        """Put back the step counters of the groups not stepped yet (a fused step counts before its kernel runs)."""
        groups, progress = self.inner.param_groups, prepared.progress
        done = {id(q) for g in groups[: progress.stepped] for q in g["params"]}
        if progress.stepped < len(groups):  # the parameters stepped one by one in the group that failed
            done |= {id(q) for q in groups[progress.stepped]["params"][: progress.param]}
        stepped = {id(self.inner.state[q]) for q in self.params if id(q) in done and q in self.inner.state}
        for state, saved, row in prepared.counters:
            if id(state) not in stepped and isinstance(state.get("step"), torch.Tensor):
                state["step"].copy_(saved[row])

    def _norm_group(self) -> Any:
        for q in self.params:
            mesh = getattr(q, "device_mesh", None)
            if mesh is not None:
                return mesh.get_group()
        return None

