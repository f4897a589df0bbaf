"""A rank-local OOM on a sharded tier with several ranks: agree before every FSDP collective.

FSDP2 gathers parameters (all-gather) inside forward and backward and reduce-scatters gradients inside
the last backward of a step. A rank that runs out of memory between two of those collectives never
issues the next one; the other ranks would wait in it until the process group times out. The loop's
agreement after each micro-step (`Stepper.agree`) comes too late for them.

So, as MosaicML Composer does for FSDP1 with module hooks, every FSDP collective of a training step
is preceded by the loop's own agreement: the same CPU all-reduce MAX of [stop, oom, rank, bytes per
sample, -room] (runner/oom/shrink.py `agreement`), sent with "no OOM". It is installed through FSDP2's
collective API (`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`): the wrappers below
agree, then hand the collective to the one FSDP had. The rank that ran out catches its OOM at the step
level and sends "OOM" in its next agreement; that all-reduce pairs with the others' pre-collective one,
since until then every rank issued the same collectives. So every rank learns of the OOM at the same
point: the rank that ran out raises `StepOOM`, the others raise `PeerOOM` from inside FSDP (turned
into `StepOOM` by the loop) before entering the collective, nobody waits, and all shrink together.

What each agreement pairs with, by where the OOM happens:
- in compute, or in the buffer allocation of a collective (before `__call__`): the others' next
  pre-collective agreement, or their end-of-micro-step one when no collective is left in the step;
- in the copy-out after a collective: the same, since the collective itself was joined by all;
- raised by the collective call itself on one rank, after the agreement, while the others are in it: that
  rank issues it once more with the memory released (`Gate.joined`), so it joins them.
Clipping and the optimizer step need no gate: their one collective (the sharded gradient norm's all-reduce)
runs after every rank agreed that nothing ran out (runner/train/update.py). Not covered (the supervisor's
restart stays the fallback, `RankOOM`): a torch without this API, several parameter groups per module, and
`JOBSPEC_FSDP_AGREE=0`, which turns it off.

Cost: one small gloo all-reduce per FSDP collective of a training step (evaluation and the planner's
probe steps do not agree: the gate is armed only inside `Stepper.train_step`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runner import internals
from runner.dist import Control, joined
from runner.oom.detect import is_oom, release_memory
from runner.oom.shrink import agreement

log = logging.getLogger("jobspec.runner")
ENV_VAR = "JOBSPEC_FSDP_AGREE"


class PeerOOM(Exception):
    """Raised inside an FSDP collective on the ranks that did not run out: another rank did, and said so in
    the agreement that precedes the collective. `flags` are the reduced agreement values."""

    def __init__(self, flags: Sequence[float]):
        super().__init__("out of memory on another rank (agreed before an FSDP collective)")
        self.flags = list(flags)


class Gate:
    """The pre-collective agreement of one rank. `armed` only inside a training step."""

    def __init__(self, ctrl: Control, rank: int):
        self.ctrl, self.rank = ctrl, rank
        self.armed = False
        self.agreements = 0  # pre-collective all-reduces so far (tests, benchmarks)

    def joined(self, collective: Any) -> Any:
        """Issue `collective`, which the other ranks have entered by now (they passed the same agreement): an OOM
        raised by the call itself on this rank (its buffers were allocated before the agreement) is retried once
        with the memory released (`runner.dist.joined`), so that this rank joins and nobody waits for it."""
        return joined(collective, f"FSDP collective on rank {self.rank}", is_oom=is_oom, release=release_memory)

    def check(self) -> None:
        if not self.armed:
            return
        self.agreements += 1
        flags = self.ctrl.all_reduce(agreement(False, "", self.rank, self.ctrl.world_size), "max")
        if flags[1]:
            raise PeerOOM(flags)


def install(model: nn.Module, ctrl: Control, rank: int) -> Gate | None:
    """Put a gate in front of every FSDP2 collective of `model` (several ranks only). None when the model
    is not FSDP2, there is one rank, `JOBSPEC_FSDP_AGREE=0`, or this torch lacks the API (then a rank-local
    OOM restarts all ranks, as before)."""
    from torch.distributed.fsdp import FSDPModule

    if ctrl.world_size == 1 or not isinstance(model, FSDPModule):
        return None
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("%s=0: a rank-local OOM on this sharded tier restarts all ranks", ENV_VAR)
        return None
    classes = internals.fsdp_comm_bases()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    found = [internals.fsdp_param_groups(m) for m in units]
    groups = [g for g in found if g is not None] if all(g is not None for g in found) else []
    if classes is None or not hasattr(FSDPModule, "set_custom_all_gather") or not groups:
        log.warning("this torch has no FSDP2 custom-collective API: a rank-local OOM restarts all ranks")
        return None
    if any(len(g) > 1 for g in groups):
        log.warning("several FSDP parameter groups per module: a rank-local OOM restarts all ranks")
        return None
    gate = Gate(ctrl, rank)
    all_gather, reduce_scatter = _wrappers(*classes)
    for unit, unit_groups in zip(units, groups, strict=True):
        if not unit_groups:  # a wrapper module that holds no parameters of its own issues no collective
            continue
        gather_comm, scatter_comm = internals.fsdp_group_comms(unit_groups[0])
        unit.set_custom_all_gather(all_gather(gate, gather_comm))
        unit.set_custom_reduce_scatter(reduce_scatter(gate, scatter_comm))
    return gate


def _wrappers(all_gather_base: type, reduce_scatter_base: type) -> tuple[type, type]:
    """AllGather / ReduceScatter implementations that agree, then call the comm FSDP had."""

    class AgreeingAllGather(all_gather_base):  # type: ignore[misc, valid-type]
        def __init__(self, gate: Gate, inner: Any):
            self.gate, self.inner = gate, inner

        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:  # fmt: skip
            self.gate.check()
            return self.gate.joined(lambda: self.inner(output_tensor, input_tensor, group, async_op))

    class AgreeingReduceScatter(reduce_scatter_base):  # type: ignore[misc, valid-type]
        def __init__(self, gate: Gate, inner: Any):
            self.gate, self.inner = gate, inner

        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:  # fmt: skip
            self.gate.check()
            return self.gate.joined(lambda: self.inner(output_tensor=output_tensor, input_tensor=input_tensor,
                                                       group=group, op=op, async_op=async_op))  # fmt: skip

    return AgreeingAllGather, AgreeingReduceScatter
