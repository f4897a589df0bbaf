"""The trained state handed to the next memory tier in memory, for an in-process tier step-down.

An OOM at micro-batch 1 in forward or backward leaves the weights and the optimizer state as the last
finished step left them. The step-down (runner/train/stepdown.py `step_down`) still writes them as a checkpoint
first (the fallback if the process dies while it rebuilds), but need not read that checkpoint back:

- `take()`, before the old tier is released: every parameter the checkpoint would hold (the trainable ones
  with LoRA), its optimizer state and the RNG states, each cut to what this rank holds at the next tier.
  Every tier below `fast` is FSDP2, which shards dim 0 of each parameter with `torch.chunk` over all ranks:
  a replicated tensor (one process, DDP) is cut to this rank's chunk, an FSDP2 shard is kept as it is.
  Copied to the host, unless it is already there whole (one CPU process: the tensors themselves).
- `fits()`, once the next tier is built: why it cannot be handed over (another layout, another optimizer),
  or None. The caller agrees on it over all ranks and, on any "no", loads the checkpoint as before.
- `give_transient()`, before anything else: the non-persistent buffers (rotary frequencies), which no state dict
  holds, into a model built without weights (runner/model/build.py `weights="none"`: no init pass at all).
- `give()`: copies the parameters into the new shards in place, and the optimizer state through the
  optimizer's own `load_state_dict` (torch's layout, so any optimizer keeping it works), then the RNG.

Profiled on the 2-core CPU machine (bench/recovery.py's step-down, one torch thread): reading the checkpoint
back took 0.25 s of the 0.30 s rebuild (0.15 s of it DCP's Adam state initialisation, one zero-gradient
step on the DTensors, whose first-use cost the first step at the new tier now pays instead), the hand-over
under 0.01 s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from runner import internals
from runner.checkpoint.store import rng_state, set_rng_state
from runner.model.build import transient_buffers

log = logging.getLogger("jobspec.runner")
HOST_SHARE = 0.5  # the host copies may take at most this share of the host memory available to a rank


@dataclass
class Handoff:
    """This rank's share of the trained state, keyed by parameter name (FQN)."""

    params: dict[str, torch.Tensor]  # this rank's dim-0 chunk of each parameter
    buffers: dict[str, torch.Tensor]  # persistent buffers, whole (FSDP2 does not shard buffers)
    transient: dict[str, torch.Tensor]  # non-persistent ones (rotary frequencies): for a model built without weights
    state: dict[str, dict[str, Any]]  # optimizer state by parameter name, cut like the parameter
    groups: list[dict[str, Any]]  # optimizer parameter groups: hyperparameters and parameter names
    rng: dict[str, Any]
    nbytes: int = 0


def _local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor | None:
    """The part of `t` (a parameter, or a state tensor shaped like it) this rank holds under FSDP2 with
    `world` ranks; None for a layout other than dim-0 sharding over one mesh dimension."""
    if isinstance(t, DTensor):
        if t.device_mesh.ndim != 1 or t.device_mesh.size() != world or tuple(t.placements) != (Shard(0),):
            return None
        return t.to_local()
    if world == 1 or t.dim() == 0:
        return t
    chunks = torch.chunk(t, world, dim=0)
    return chunks[rank] if rank < len(chunks) else t.new_empty((0, *t.shape[1:]))


def _host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host and owning its memory (a chunk must not keep the whole tensor alive)."""
    t = t.detach()
    if t.device.type == "cpu" and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.to("cpu", copy=True)


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def take(model: nn.Module, optimizer: Any, *, rank: int, world: int, trainable_only: bool,
         room: int | None = None) -> Handoff | str:  # fmt: skip
    """This rank's share of `model` (unwrapped) and `optimizer`, or why it cannot be taken. `room`: the host
    bytes the copies may take (None: no limit, the state already lives on the host)."""
    names = _names(model)
    kept = {n for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    sd = optimizer.state_dict()
    if room is not None:
        state_tensors = sum(1 for s in sd["state"].values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        per_param = 1 + state_tensors / max(len(kept), 1)
        need = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in kept) * per_param / world
        if need > room:
            return f"the host copies would take {need / 2**30:.1f} GiB, more than the {room / 2**30:.1f} GiB allowed"
    params: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        if n in kept:
            local = _local(p.detach(), rank, world)
            if local is None:
                return f"parameter {n} is sharded as {getattr(p, 'placements', '?')}, not dim 0 over {world} ranks"
            params[n] = _host(local)
    keys = model.state_dict(keep_vars=True).keys()
    buffers = {n: _host(b) for n, b in model.named_buffers() if n in keys and not trainable_only}
    transient = {n: _host(b) for n, b in model.named_buffers() if n not in keys and not trainable_only}
    order = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[str, dict[str, Any]] = {}
    for index, values in sd["state"].items():
        p = order[index]
        name = names.get(id(p))
        if name is None:
            return "the optimizer holds a parameter the model does not name"
        cut: dict[str, Any] = {}
        for key, v in values.items():
            if internals.is_quantized(v):  # an 8-bit moment (adamw_8bit): its fp32 values, cut like the parameter
                v = internals.dequantized(v)
            if not torch.is_tensor(v) or v.dim() == 0:
                cut[key] = v.detach().clone() if torch.is_tensor(v) else v
            elif tuple(v.shape) == tuple(p.shape):
                local = _local(v.detach(), rank, world)
                if local is None:
                    return f"optimizer state {key} of {name} is sharded as {getattr(v, 'placements', '?')}"
                cut[key] = _host(local)
            else:
                return f"optimizer state {key} of {name} has shape {tuple(v.shape)}, its parameter {tuple(p.shape)}"
        state[name] = cut
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names.get(id(order[i]), "") for i in g["params"]]}
        for g in sd["param_groups"]
    ]
    tensors = [
        *params.values(),
        *buffers.values(),
        *transient.values(),
        *(v for s in state.values() for v in s.values() if torch.is_tensor(v)),
    ]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return Handoff(params, buffers, transient, state, groups, rng_state(), nbytes)


@torch.no_grad()
def give_transient(h: Handoff, model: nn.Module) -> bool:
    """Copy the kept non-persistent buffers into `model` (unwrapped, built without weights: runner/model/build.py
    `weights="none"`), which no state dict or checkpoint carries; False when `h` has not the model's every one."""
    transient = transient_buffers(model)
    if transient.keys() != h.transient.keys() or any(b.shape != h.transient[n].shape for n, b in transient.items()):
        return False
    for n, b in transient.items():
        b.copy_(h.transient[n])
    return True


def fits(h: Handoff, model: nn.Module, optimizer: Any) -> str | None:
    """Why `h` cannot be given to the newly built `model` (unwrapped) and `optimizer`; None when it can."""
    params = dict(model.named_parameters())
    for n, local in h.params.items():
        p = params.get(n)
        if p is None:
            return f"the new model has no parameter {n}"
        target = p.to_local() if isinstance(p, DTensor) else p
        if tuple(target.shape) != tuple(local.shape):
            return (
                f"parameter {n}: this rank holds {tuple(target.shape)} at the new tier, {tuple(local.shape)} was kept"
            )
    buffers = dict(model.named_buffers())
    for n, b in h.buffers.items():
        if n not in buffers or tuple(buffers[n].shape) != tuple(b.shape):
            return f"the new model has no buffer {n} of shape {tuple(b.shape)}"
    names = _names(model)
    new = [[names.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups]
    if new != [g["params"] for g in h.groups]:
        return "the new optimizer groups its parameters differently"
    return None


@torch.no_grad()
def give(h: Handoff, model: nn.Module, optimizer: Any) -> None:
    """Write `h` into the new tier's `model` (unwrapped) and `optimizer`; `fits` said it can."""
    params = dict(model.named_parameters())
    for n, local in h.params.items():
        p = params[n]
        (p.to_local() if isinstance(p, DTensor) else p).copy_(local)
    buffers = dict(model.named_buffers())
    for n, b in h.buffers.items():
        buffers[n].copy_(b)
    names = _names(model)
    index = {names[id(p)]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    if internals.is_low_bit(optimizer):
        state = {index[n]: _low_bit_like(optimizer, s, params[n]) for n, s in h.state.items()}
    else:
        state = {index[n]: {k: _like(v, params[n]) for k, v in s.items()} for n, s in h.state.items()}
    groups = [{**g, "lr": float(g["lr"]), "params": [index[n] for n in g["params"]]} for g in h.groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    internals.keep_tensor_lr(optimizer)
    set_rng_state(h.rng)


def _low_bit_like(optimizer: Any, kept: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """A state kept as fp32 chunks -> torchao AdamW8bit's for the new parameter `p`: its moments 8-bit where it would
    quantize them (runner/internals/lowbit.py), one fp32 chunk on the device at a time; the step on the host."""
    state = internals.new_state(optimizer, p)
    for key, value in kept.items():
        if key == "step":
            state[key] = torch.as_tensor(value, dtype=torch.float32).detach().to("cpu", copy=True)
        elif internals.is_quantized(state.get(key)):
            internals.requantize_into(state[key], value)
        else:
            state[key] = _like(value, p)
    return state


def _like(v: Any, p: torch.Tensor) -> Any:
    """A state value kept as this rank's chunk -> shaped and placed like the new parameter `p`."""
    if not torch.is_tensor(v) or v.dim() == 0:
        return v
    if isinstance(p, DTensor):
        local = v.to(p.to_local().device)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return v.to(p.device)
