"""DDP and FSDP2 after an OOM: reset a step cut short, and the FSDP2 comms the ranks agree on an OOM before."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner.internals.versions import log


def reset_ddp(model: nn.Module) -> bool:
    """Make DDP forget a gradient reduction an OOM cut short (else the redo's forward raises "Expected to have
    finished reduction in the prior iteration"). False when this torch cannot: the caller restarts instead."""
    reducer = getattr(model, "reducer", None)
    if reducer is None or not hasattr(reducer, "_reset_state"):
        return False
    reducer._reset_state()
    return True


def fsdp_comm_bases() -> tuple[type, type] | None:
    """FSDP2's AllGather and ReduceScatter base classes (what `set_custom_all_gather` takes); None if absent."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:
        return None
    return AllGather, ReduceScatter


def _groups(state: Any) -> list[Any]:
    """The parameter groups of one FSDPState: a list `_fsdp_param_groups` from torch 2.13 on (several groups a
    module), the single `_fsdp_param_group` (None for a module without parameters of its own) before (2.11, 2.12).
    AttributeError where this torch has neither."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def fsdp_param_groups(unit: nn.Module) -> list[Any] | None:
    """The FSDP parameter groups of one `fully_shard`ed module; None when this torch keeps them elsewhere."""
    try:
        return _groups(unit._get_fsdp_state())
    except AttributeError:
        return None


def fsdp_group_comms(group: Any) -> tuple[Any, Any]:
    """(all-gather, reduce-scatter) comm objects a parameter group uses now: the ones a custom comm wraps."""
    return group._all_gather_comm, group._reduce_scatter_comm


def fsdp_reset_way() -> str | None:
    """How `reset_fsdp` resets FSDP2 on this torch: "reset_iter_state" (torch's own, 2.13 on), "by hand" (torch
    2.11, 2.12: `_reset_iter_state` below, where the iteration state it resets is found), None where neither can work
    (no `_get_fsdp_state`, or FSDP2's training states or a parameter group's `_to_sharded` moved)."""
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "_get_fsdp_state"):
        return None
    if hasattr(FSDPModule, "reset_iter_state"):
        return "reset_iter_state"
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return None
    return "by hand" if hasattr(TrainingState, "IDLE") and hasattr(FSDPParamGroup, "_to_sharded") else None


def reset_fsdp(model: nn.Module) -> bool:
    """After an exception inside FSDP2's forward or backward: `FSDPModule.reset_iter_state` (public since torch 2.13;
    `_reset_iter_state` below on older ones), then drop the gradients a partial backward left on the unsharded
    parameters, which it keeps and the redo's backward would add to. True for models that are not FSDP2; False when
    this torch cannot (the caller restarts)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return True
    try:
        state = model._get_fsdp_state()
        if state._is_root is None:  # the step failed before FSDP's lazy init: nothing to reset
            return True
        if hasattr(model, "reset_iter_state"):
            model.reset_iter_state()
        else:
            _reset_iter_state(state)
        for st in state._state_ctx.all_states:
            for param in (p for group in _groups(st) for p in group.fsdp_params):
                if getattr(param, "_unsharded_param", None) is not None:
                    param._unsharded_param.grad = None
                param.unsharded_accumulated_grad = None
    except AttributeError as err:
        log.warning("torch %s: cannot reset FSDP2 after the OOM (%s, reset %s): the shrink happens by a restart",
                    torch.__version__, err, fsdp_reset_way())  # fmt: skip
        return False
    return True


def _reset_iter_state(root: Any) -> None:
    """torch 2.13's `FSDPState._reset_iter_state` for torch 2.11 and 2.12 (the GPU image's 2.11), where FSDP2
    has no reset: every attribute it touches is reset where this torch has it. Without it an OOM inside FSDP2 left
    its states mid-iteration and the shrink restarted the workers (the H100 record's step-down ending in exit 75)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    handle = getattr(root, "_device_handle", None)
    stream = handle.current_stream() if handle is not None and hasattr(handle, "current_stream") else None

    def wait(event: Any) -> None:
        if event is not None and stream is not None:
            stream.wait_event(event)

    comm = root._comm_ctx
    if (ag := getattr(comm, "all_gather_state", None)) is not None:
        wait(getattr(ag, "event", None))
        comm.all_gather_state = None
    for rs in getattr(comm, "reduce_scatter_states", ()) or ():
        wait(getattr(rs, "event", None))
    if hasattr(comm, "reduce_scatter_states"):
        comm.reduce_scatter_states.clear()
    if (rs := getattr(comm, "reduce_scatter_state", None)) is not None:  # the single pending one of older torches
        wait(getattr(rs, "event", None))
        comm.reduce_scatter_state = None
    for event in (getattr(comm, "_last_post_reduce_events", None) or {}).values():
        wait(event)
    if hasattr(comm, "_last_post_reduce_events"):
        comm._last_post_reduce_events.clear()
    if hasattr(comm, "post_forward_order"):
        comm.post_forward_order.clear()
    for st in root._state_ctx.all_states:
        if hasattr(st, "_modules_to_run_forward"):
            st._modules_to_run_forward.clear()
        st._training_state = TrainingState.IDLE
        for group in _groups(st):
            if (result := getattr(group, "_all_gather_result", None)) is not None:
                wait(getattr(result, "all_gather_event", None))
                work = getattr(result, "all_gather_work", None)
                if hasattr(work, "wait"):
                    work.wait()
                group._all_gather_result = None
            for name in ("_post_reduce_event", "_reshard_after_forward_event"):
                if getattr(group, name, None) is not None:
                    wait(getattr(group, name))
                    setattr(group, name, None)
            if getattr(group, "_all_reduce_state", None) is not None:
                wait(getattr(group._all_reduce_state, "event", None))
                group._all_reduce_state = None
            if hasattr(group, "_partial_reduce_output"):
                group._partial_reduce_output = None
            if hasattr(group, "_post_forward_indices"):
                group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    root._state_ctx.iter_forward_root = None
    if hasattr(root._state_ctx, "post_backward_final_callback_queued"):
        root._state_ctx.post_backward_final_callback_queued = False


def reducer_class() -> Any:
    return getattr(getattr(torch._C, "_distributed_c10d", None), "Reducer", None)
