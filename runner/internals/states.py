"""accelerate's process-wide states, its optimizer registry, the attention kernel transformers chose, and its search
for packed sequences."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch import nn

from runner.internals.versions import has


def accelerate_states() -> tuple[Any, Any, Any]:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    return AcceleratorState, GradientState, PartialState


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state, so that the next `Accelerator` starts clean (another tier's
    FSDP plugin, another mixed precision). PartialState too: an FSDP run leaves its `distributed_type` at
    FSDP, and the next Accelerator would take FSDP without its plugin."""
    accelerator_state, gradient_state, _ = accelerate_states()
    if not (has(accelerator_state, "_reset_state") and has(gradient_state, "_reset_state")):
        return  # `check` has stopped the run already; a cleanup after it has nothing to reset
    accelerator_state._reset_state(reset_partial_state=True)
    gradient_state._reset_state()


def force_fsdp(accelerator: Any, plugin: Any) -> None:
    """Make `accelerator` treat the model as FSDP2 where accelerate ignored `plugin` (CPU, one GPU without
    LOCAL_RANK): in its state and in PartialState's shared copy, which every later `AcceleratorState()`
    (the optimizer wrapper makes one) copies back over it."""
    from accelerate.utils import DistributedType

    _, _, partial_state = accelerate_states()
    accelerator.state.distributed_type = partial_state._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def forget_optimizer(accelerator: Any, optimizer: Any) -> None:
    """Drop an optimizer `accelerator.prepare` registered (it would be unscaled and stepped with the others)."""
    accelerator._optimizers.remove(optimizer)


def attention_kernel(model: nn.Module) -> str:
    """The attention implementation `model` runs ("sdpa", "eager", "flash_attention_2", ...), through DDP's and
    peft's wrappers (FSDP2 keeps the module); "" when it has no transformers config."""
    config = getattr(getattr(model, "module", model), "config", None)
    return str(getattr(config, "_attn_implementation", None) or "")


@functools.cache
def _masking_utils() -> Any:
    """transformers.masking_utils, imported once; None where this transformers has none."""
    try:
        from transformers import masking_utils
    except ImportError:
        return None
    return masking_utils


def _no_packed_sequences(position_ids: Any) -> None:
    return None


def _packed_sequences(position_ids: Any) -> Any:
    """transformers' packed-sequence mask (each token's record index in its row: a restart of the positions starts
    the next one), without its check that some row holds more than one record."""
    import torch

    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


@contextlib.contextmanager
def packed_search(packed: bool) -> Iterator[None]:
    """A training forward whose rows the runner knows: transformers' search for packed sequences in the position ids
    (`masking_utils.find_packed_sequence_indices`, on every forward without a mask or cache) gives its answer for them
    at once: None for rows of one record each (`packed` False), the block mask for rows that hold several (True; the
    runner passes position ids only for those). transformers decides by reading `.all()` of a device tensor back to
    the host: a host sync in every training forward, which kept the CPU from queueing the forward until the GPU had
    finished the work before it. The packed answer is checked at start-up against records run alone
    (runner/model/packing.py `check_packing`, which runs through here). Releases without that search (transformers
    4.x before packed-sequence detection): nothing to do."""
    module = _masking_utils()
    original = getattr(module, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    module.find_packed_sequence_indices = _packed_sequences if packed else _no_packed_sequences
    try:
        yield
    finally:
        module.find_packed_sequence_indices = original
