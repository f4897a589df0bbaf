"""What `training.compile` saves for backward, for the memory trace (runner/train/trace.py).

Compiled blocks keep fewer tensors for backward than eager ones: the min-cut partitioner of AOT autograd (inductor's)
recomputes cheap elementwise work in backward (RMSNorm's fp32 copy, the gated activation, RoPE's products) instead of
saving its outputs. The trace cannot run them: its memory tracker is a dispatch mode, and under one torch.compile runs
no frame (dynamo skips them all, cached or not). So the trace steps eager blocks, and this module measures, on fakes
and outside the tracker, what a block of each kind the model has (its first and, built otherwise, its last) keeps
across its forward, eager and compiled, at the trace's micro-batch, dtypes and autocast (`block_saving`); `apply`
takes the difference off the traced peak.

How a block is compiled here: by `torch.compile` with the `aot_eager_decomp_partition` backend, which is inductor's
decompositions and partitioner without its code generation (fakes hold no data to run kernels on), fullgraph, on a
copy of the block class's forward code, so that dynamo's cache entries attach to that copy and go with it: the run's
own compiled blocks never meet a guard made for fakes. What a trace takes off is what inductor's compiled blocks
keep less on real tensors, to the byte (CPU, bf16 autocast, 4 x 256 tokens: llama-tiny 5,636,096 of 16,461,824
bytes, GPT-2 tiny 6,815,744 of 17,516,544; tests/runner/train/test_trace_compiled.py).

Where it is applied (`apply`): tiers without activation checkpointing, whose peak holds every layer's activations;
the saving is the smaller of the per-block difference times the layers and the activations at the peak scaled by
the compiled/eager ratio (a peak outside the forward keeps fewer of them); a compiled block that keeps more adds the
difference for every block. Checkpointed tiers keep each block's input only; the one block recomputed in backward
saves less too, but the peak may be at the loss: not subtracted (the eager figure bounds it). A block that cannot
be measured here (a graph break, a 4-bit base) saves nothing in the plan.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runner.model.build import transformer_blocks

log = logging.getLogger("jobspec.runner")

BACKEND = "aot_eager_decomp_partition"  # inductor's decompositions and min-cut partitioner, run eagerly


@dataclass(frozen=True)
class BlockSaving:
    """Bytes one block keeps for backward at the traced micro-batch: eager, and compiled (None: not measured)."""

    eager: int
    compiled: int | None
    blocks: int  # blocks in the model
    why: str = ""  # why `compiled` is None


class _Captured(Exception):
    pass


Call = tuple[tuple[Any, ...], dict[str, Any]]  # a block's (args, kwargs)


def _capture_calls(model: nn.Module, blocks: list[nn.Module], ids: torch.Tensor) -> list[Call]:
    """The (args, kwargs) each of `blocks` (in the model's order) is called with in one forward of `model` on `ids`:
    the forward stops at the last of them."""
    seen: dict[int, Call] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen[id(module)] = (args, kwargs)
        if module is blocks[-1]:
            raise _Captured

    handles = [block.register_forward_pre_hook(hook, with_kwargs=True) for block in blocks]
    try:
        with torch.no_grad(), contextlib.suppress(_Captured):
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    if len(seen) < len(blocks):
        raise RuntimeError("the model's forward never called some of its blocks")
    return [seen[id(block)] for block in blocks]


def _why(err: BaseException) -> str:
    """An exception's type and the first line of its message, for a log line or a note."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"[:300]


def _kept(run: Any, params: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd keeps across `run()` (its saved tensors), but the parameters': a
    linear layer saves its weight's transpose, a view of the parameter that costs nothing (storages are told apart by
    their Python objects, which torch keeps one a storage while it lives)."""
    weights = {id(p.untyped_storage()) for p in params}
    storages: dict[int, int] = {}

    def pack(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if id(storage) not in weights:
                storages[id(storage)] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def _fresh_forward(block: nn.Module) -> Any:
    """The block class's forward on a copy of its code object, compiled (see the module docstring)."""
    forward = type(block).forward
    code = forward.__code__.replace()
    fresh = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__)
    fresh.__kwdefaults__ = forward.__kwdefaults__
    # static shapes: the graph of the traced micro-batch, whatever compiled before in this process (dynamo's automatic
    # dynamic shapes mark a size dynamic once a second shape comes, which may save other tensors)
    return torch.compile(fresh, backend=BACKEND, fullgraph=True, dynamic=False)


def _map(fn: Any, value: Any) -> Any:
    """`fn` on every leaf of nested tuples, lists and dicts (a block's call: hidden states, RoPE's (cos, sin)...)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def _structure(block: nn.Module) -> list[str]:
    return [type(m).__name__ for m in block.modules()]


def block_saving(
    model: nn.Module, *, micro_batch: int, seq_len: int, dtype: torch.dtype | None, autocast: torch.dtype | None,
    mode: Any,
) -> BlockSaving:  # fmt: skip
    """What a block of `model` (not yet sharded or autocast) keeps for backward, eager and compiled, on fakes (`mode`:
    the trace's FakeTensorMode): its parameters cast to `dtype` (FSDP2's compute dtype; None: as built), its forward
    under CPU autocast to `autocast` (`fast`; None: none), its input as the model gives it, requiring a gradient.
    The first block, and the last where it is built otherwise (a mixture-of-experts model's dense first layers, a
    hybrid's linear attention): the one that saves less counts for every block. Never raises: a block that does not
    compile here, or a forward that cannot be followed to it, gives `compiled` None and why."""
    start = time.perf_counter()
    try:
        with quiet_dynamo():
            measured, blocks = _measure(model, micro_batch, seq_len, dtype, autocast, mode)
    except Exception as err:  # a graph break, a dynamo gap, no blocks found: the eager figure stays the bound
        log.info("trace: a block did not compile in %.1f s (%s): the plan counts eager blocks",
                 time.perf_counter() - start, _why(err))
        return BlockSaving(0, None, 0, _why(err))
    eager, compiled = min(measured, key=lambda m: m[0] - m[1])
    log.info("trace: %d block(s) compiled and measured in %.1f s: one keeps %.2f of eager's bytes for backward",
             len(measured), time.perf_counter() - start, compiled / max(eager, 1))
    return BlockSaving(eager, compiled, blocks)


def _measure(model: nn.Module, micro_batch: int, seq_len: int, dtype: torch.dtype | None,
             autocast: torch.dtype | None, mode: Any) -> tuple[list[tuple[int, int]], int]:  # fmt: skip
    """((eager, compiled) bytes for each block kind (see `block_saving`), the number of blocks), measured on a twin
    of `model` made of fakes: one forward on it gives the blocks' calls (transformers' rotary embedding enters an
    autocast region of the input's device, which the meta device has none of)."""
    twin = copy.deepcopy(model)
    with mode:
        twin.to_empty(device="cpu")
        blocks = transformer_blocks(twin)
        kinds = [blocks[0]] + ([blocks[-1]] if _structure(blocks[-1]) != _structure(blocks[0]) else [])
        calls = _capture_calls(twin, kinds, torch.zeros(micro_batch, seq_len, dtype=torch.long))
        measured = [_measure_block(block, call, dtype, autocast) for block, call in zip(kinds, calls, strict=True)]
    return measured, len(blocks)


def _measure_block(block: nn.Module, call: Call, dtype: torch.dtype | None,
                   autocast: torch.dtype | None) -> tuple[int, int]:  # fmt: skip
    """(eager, compiled) bytes `block` (of fakes, inside the fake mode) keeps for backward when called as `call`."""
    if hasattr(block, "gradient_checkpointing"):
        block.gradient_checkpointing = False  # one block's forward as it runs without checkpointing
    if dtype is not None:
        for p in block.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    args, kwargs = call
    hidden = args[0] if args else kwargs.get("hidden_states")

    def ready(value: Any) -> Any:  # FSDP2 casts a unit's floating inputs to its compute dtype
        if not isinstance(value, torch.Tensor):
            return value
        out = value.detach()
        if out.is_floating_point() and dtype is not None:
            out = out.to(dtype)
        return out.requires_grad_(True) if value is hidden else out

    f_args, f_kwargs = _map(ready, args), _map(ready, kwargs)
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()

    def run(forward: Any) -> Any:
        def go() -> None:
            with cast:
                forward(*f_args, **f_kwargs)

        return go

    params = list(block.parameters())
    return _kept(run(block), params), _kept(run(types.MethodType(_fresh_forward(block), block)), params)


def apply(saving: BlockSaving, activations: int) -> int:
    """Bytes the compiled blocks keep less at a traced peak that holds `activations` bytes of activations: the
    per-block difference over every block, at most the peak's activations scaled by the compiled/eager ratio. A
    compiled block that keeps more (torch 2.11 on Qwen3-Next's linear attention: 6.6 times eager's bytes) gives a
    negative figure, the difference over every block: the plan counts it."""
    if saving.compiled is None or saving.eager <= 0:
        return 0
    per_block = saving.eager - saving.compiled
    if per_block < 0:
        return per_block * saving.blocks
    return int(min(per_block * saving.blocks, activations * per_block / saving.eager))


def prime() -> None:
    """Have dynamo build its tables of torch's functions now, while they are themselves: the trace wraps some of
    them (trace.py `gpu_decisions`), and tables first built under the wrappers would not know the originals after
    (CPU, 2026-11-30: every later compile in the process broke its graph at `torch.rsqrt`). Each trace that measures
    compiled blocks calls it, after its fake process group's start (which clears the tables)."""
    try:
        torch.compile(lambda x: torch.rsqrt(x), backend="eager", fullgraph=True)(torch.ones(1))
    except Exception as err:  # no dynamo here: the block's own compile fails and the plan counts eager blocks
        log.info("trace: dynamo did not start (%s)", _why(err))


def note(saving: BlockSaving, cut: int) -> str:
    """The trace's note on what compiling saved."""
    if saving.compiled is None:
        return f"compile: one block did not compile here ({saving.why}): counted as eager"
    less = f"{cut} B less" if cut >= 0 else f"{-cut} B more"
    return (f"compile: a compiled block keeps {saving.compiled / max(saving.eager, 1):.2f} of eager's bytes for "
            f"backward; {less} at the peak")


@contextlib.contextmanager
def quiet_dynamo() -> Iterator[None]:
    """dynamo's and inductor's loggers at WARNING while a block compiles for the trace (their INFO is per graph)."""
    names = ("torch._dynamo", "torch._inductor", "torch._functorch")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(max(levels[n], logging.WARNING))
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)
