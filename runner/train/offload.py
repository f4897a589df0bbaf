"""Optimizer-only CPU offload for tier `zero2_offload`: Adam's states and its step on the host, parameters and
gradients on the GPU (DeepSpeed ZeRO-Offload's split; the seeds' `stage2_offload`). FSDP2 has no such mode
(its CPUOffloadPolicy moves the parameters too), so the offload is torchao's `CPUOffloadOptimizer`.

What torchao does (torchao/optim/cpu_offload.py, 0.13 to 0.18): for every trainable parameter a pinned host
copy of it and of its gradient, both in the parameter's dtype (under FSDP2: of this rank's fp32 shard, a
DTensor whose local tensor is on the host), and one fused CPU AdamW over that copy. A post-accumulate-grad
hook, which FSDP2 calls on the sharded parameter once its reduce-scatter is done, copies the gradient to the
host on a side stream during backward; `step()` waits for each copy, steps that parameter on the CPU and
copies it back to the GPU on the side stream, so transfers overlap the CPU work.

`HostAdamW` puts that behind the optimizer interface the runner uses:
- `param_groups` are the GPU parameters (FSDP2's shards) with their hyperparameters, as for any optimizer:
  the Stepper sets the LR there, `step()` hands it to the host optimizers, and DCP maps them to FQNs.
- `state`, `state_dict()` and `load_state_dict()` use torch's layout (state by parameter: step, exp_avg,
  exp_avg_sq), holding the host tensors themselves: a checkpoint is the same as every other tier's, so a
  resume may change tier (the OOM ladder does).
- `step()` copies every gradient to the host again first: torchao's hook copies it before the Stepper
  clips it (or fp16 unscales it), and DCP's state initialisation sets zero gradients without any hook, so
  torchao alone would step on unclipped gradients. Whether a gradient changed cannot be told reliably (a
  DTensor's in-place foreach writes leave its version counters alone), so each gradient crosses PCIe once
  more per step; the copies are queued at once and waited for one parameter at a time, so they overlap
  the CPU steps. The hook's copies during backward become redundant transfers on a side stream.
- After `load_state_dict()` (a resume wrote the GPU parameters) the next step first refreshes the host
  copies from the GPU parameters; torchao alone would write its stale copy back.
- `minimal_size=0`: every parameter goes to the host (torchao keeps tensors under 4096 elements on the GPU
  with a second, GPU AdamW by default), so all optimizer state is in one place and the memory model exact.
- Adam's moments are moved into pinned host memory, beside torchao's copies: torch's AdamW makes them with
  `zeros_like` of the host copy, which is pageable (the H100 run of 2026-11-25 found them so), and a loaded or
  reset state arrives pageable too. After a step that made or found pageable moments, each is copied once into
  a pinned tensor of its own (`_pin_states`); the check runs again only after a load or a reset.

Memory per rank, bytes per trainable parameter over N ranks: host 16/N (fp32 copy 4, gradient copy 4,
exp_avg and exp_avg_sq 8, pinned); the GPU keeps FSDP2's fp32 shard and fp32 gradient shard, so only
Adam's 8/N leave it (jobspec/plan/memory.py `_states`). Needs an accelerator (CUDA or ROCm: pinned memory,
streams); runner/train/engine.py `offload_optimizer` uses it only there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

from jobspec import install_hint
from jobspec.errors import ConfigError
from runner.internals import OffloadParts, offload_parts

# The group entries a step may change (the Stepper sets lr every step); the host optimizers keep their own
# others (fused=True above all).
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def cpu_offload_optimizer() -> type[torch.optim.Optimizer]:
    """torchao's CPUOffloadOptimizer, imported on first use (the `offload` extra, GPU only)."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as err:
        raise ConfigError(
            f"memory.tier zero2_offload steps the optimizer on the host with torchao's CPUOffloadOptimizer, and "
            f"torchao cannot be imported ({err}): pip install torchao, or {install_hint('offload')}"
        ) from err
    return CPUOffloadOptimizer


class HostState(MutableMapping):
    """GPU parameter -> its AdamW state (step, exp_avg, exp_avg_sq), which lives in the host optimizer."""

    def __init__(self, parts: OffloadParts, changed: Callable[[], None] | None = None):
        self._parts = parts
        self._changed = changed or (lambda: None)  # HostAdamW: pin what the next step finds

    def _where(self, p: torch.Tensor) -> tuple[dict, torch.Tensor]:
        return self._parts.optim_dict[p].state, self._parts.param_d2h_map[p]

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        state, host = self._where(p)
        if host not in state:  # a defaultdict: look, do not create
            raise KeyError(p)
        return state[host]

    def __setitem__(self, p: torch.Tensor, value: dict[str, Any]) -> None:
        state, host = self._where(p)
        state[host] = value
        self._changed()

    def __delitem__(self, p: torch.Tensor) -> None:
        state, host = self._where(p)
        del state[host]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p, opt in self._parts.optim_dict.items() if self._parts.param_d2h_map[p] in opt.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def clear(self) -> None:  # Stepper.reset_optimizer: forget the probe steps' moments
        for opt in self._parts.optim_dict.values():
            opt.state.clear()
        self._changed()


class HostAdamW(torch.optim.Optimizer):
    """AdamW over `optimizer`'s parameter groups (FSDP2's shards on the GPU) whose states and step are on the host.

    Built after FSDP2 has sharded the model (runner/train/engine.py `prepare`): torchao copies and hooks the
    parameters it is given. Like torchao's class it does not call Optimizer.__init__ (no step hooks)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        offload_class = cpu_offload_optimizer()
        self.defaults = dict(optimizer.defaults)
        self.param_groups = optimizer.param_groups
        groups = [{"params": g["params"], **{k: g[k] for k in HYPERPARAMETERS}} for g in self.param_groups]
        self.offload = offload_class(groups, torch.optim.AdamW, minimal_size=0)
        self.parts = offload_parts(self.offload)  # torchao's internals, or one clear error (runner/internals/)
        self.host = self.parts.param_d2h_map  # GPU parameter -> host copy; its .grad is the host gradient
        self.state = HostState(self.parts, self._unpin)  # type: ignore[assignment]  # Optimizer's is a defaultdict
        self._stale_host = False  # set by load_state_dict: refresh the host copies before the next step
        self._check_pinned = True  # until every parameter's moments are pinned (new, loaded or reset states)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self._stale_host:
            for p, h in self.host.items():
                h.copy_(p.detach())
            self._stale_host = False
        for group in self.param_groups:
            update = {k: group[k] for k in HYPERPARAMETERS}
            for p in group["params"]:
                self.parts.optim_dict[p].param_groups[0].update(update)
        self._copy_grads()
        loss = self.offload.step(closure)
        self._pin_states()
        return loss

    def _unpin(self) -> None:
        self._check_pinned = True

    def _pin_states(self) -> None:
        """Every moment tensor (exp_avg, exp_avg_sq) of the host optimizers into pinned memory, once: a pageable one
        is copied into a pinned tensor that takes its place (the host optimizers read their state at every step).
        Until every parameter has stepped, the next step looks again."""
        if not self._check_pinned:
            return
        complete = True
        for p, h in self.host.items():
            state = self.parts.optim_dict[p].state.get(h)  # a defaultdict: look, do not create
            if not state:
                complete = False
                continue
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and not _local(value).is_pinned():
                    state[key] = torch.empty_like(value, pin_memory=True).copy_(value)
        self._check_pinned = not complete

    def _copy_grads(self) -> None:
        """Queue a host copy of every gradient as it is now (clipped), in parameter order: torchao's step
        walks this queue, waiting for each copy's event before stepping that parameter on the CPU."""
        queue = self.parts.queue
        queue.clear()
        backend = getattr(torch, self.parts.device)  # torch.cuda (ROCm too): torchao's own choice
        stream = self.parts.stream
        stream.wait_stream(backend.current_stream())  # after the writes (clipping) on the compute stream
        with backend.stream(stream):
            for p, h in self.host.items():
                if p.grad is not None:
                    h.grad.copy_(p.grad, non_blocking=True)
                    queue[p] = stream.record_event()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.host:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.parts.queue.clear()  # copies of gradients a retried step dropped: never stepped on

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: {"state": {index: state}, "param_groups": [{..., "params": [index, ...]}]}, indices
        counting the parameters of `param_groups` in order (what DCP maps to FQNs); host tensors, not copies."""
        params = [p for g in self.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(params)}
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        return {"state": {index[p]: s for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hyperparameters into `param_groups`, states into the host optimizers (torch casts and places them
        there), matched by position as torch does; the host parameter copies are refreshed at the next step."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                f"optimizer state for groups of {[len(g['params']) for g in saved_groups]} parameters does not fit "
                f"groups of {[len(g['params']) for g in self.param_groups]}"
            )
        saved_state = state_dict["state"]
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for p, key in zip(group["params"], saved["params"], strict=True):
                opt = self.parts.optim_dict[p]
                own = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
                state = {0: saved_state[key]} if key in saved_state else {}
                opt.load_state_dict({"state": state, "param_groups": [{**own, "params": [0]}]})
        self._stale_host = True
        self._check_pinned = True


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's host copies are DTensors), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t
