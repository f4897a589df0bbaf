"""The FSDP2 tiers' peak: the moment of a step at which a sharded model holds the most, and what it holds then.

`_fsdp_peak` compares five moments of the step (forward at the loss; backward at the output layer, at the last block,
at the first; the end of backward), each with the modules FSDP2 holds gathered and the gradients not yet reduced,
against the activations saved by then (jobspec/plan/activations.py). jobspec/plan/memory.py `estimate` adds the
largest to the sharded model states.
"""

from __future__ import annotations

from jobspec.catalog.presets import ModelShape
from jobspec.plan.adapters import LoraShape, _block_params
from jobspec.plan.quantize import gathered_saving
from jobspec.plan.widths import GRAD_BYTES, HALF_BYTES


def _fsdp_peak(
    shape: ModelShape,
    tier: str,
    world_size: int,
    lora: LoraShape | None,
    *,
    acts: int,
    loss_hidden: int,
    chunk: int,
    recompute: int,
    kept: int = 0,
    quantize: str | None = None,
) -> tuple[int, int, int]:
    """(gathered weights and gradients beyond what `_states` keeps, activations, loss bytes) at the largest of the
    five moments an FSDP2 step peaks at (traced; bench/memory_model.py), `acts` the activations forward saves:

    - forward, at the loss: the output layer gathered (16-bit weights, and an untied head's all-gather buffer; a tied
      embedding lives in the root unit), the fused loss's 16-bit gradient of it, the loss's hidden states and chunk,
      and where forward reshards, the last block's all-gather buffer, prefetched for backward;
    - backward, at the output layer: the same gather and the head's gradient, reduce-scattered in fp32 (a tied
      embedding's stays 16-bit); a fully trained tied embedding shares its unit with the final norm (accelerate's
      tail unit), which reshards after the output layer's backward and is gathered again for the norm's: its
      all-gather buffer and the copied-out weights are alive together, beside every saved activation;
    - backward, at the last block (the first run, every activation saved) and at the first (one layer's left, the
      root's embedding gathered ahead: `_block_gathers`): the block gathered, its gradient reduce-scattered in fp32,
      with activation checkpointing the block being recomputed; a tied embedding's 16-bit gradient;
    - the end of backward: the root unit's embedding gathered, its 16-bit gradient and the fp32 copy that is
      reduce-scattered, the activations gone (the peak of a tied embedding too large for its few blocks); of the
      16-bit weights forward kept gathered (`kept`, zero2's) only the root's are left by then, none on one rank.

    Without resharding after forward (zero2, zero2_offload) every weight is gathered already: only the buffers
    come on top. With LoRA the frozen base has no gradients; the adapters' are small and left out. A 4-bit base
    (`quantize`) gathers its blocks' linear layers in 4 bits: `block` counts them at their 16-bit equivalent."""
    head, half = shape.vocab * shape.hidden, HALF_BYTES
    tied, reshard, full = shape.tie_embeddings, tier in ("zero3", "minimal"), lora is None
    buffer = half if world_size > 1 else 0  # one rank gathers nothing: its 16-bit copy is the unsharded module
    reduced = GRAD_BYTES if full else 0  # a module's gradient, reduce-scattered in fp32
    # On one rank the reduce-scatter's output is a whole fp32 copy of the gradient beside its fp32 input (and, for
    # `minimal`, on the device until copied to the host); on more ranks the 16-bit gradient is freed before the output
    # shard (4/N bytes a parameter, no more than its 2) is made, so the input's moment is the larger one (traced).
    # The embedding's and an untied head's are the large ones.
    offloaded = GRAD_BYTES * head if full and world_size == 1 else 0
    gather_head = (half * head if reshard else 0) + (0 if tied else buffer * head)
    head_grad = half * head if full else 0  # made by the fused loss in forward
    saving = gathered_saving(shape, quantize, world_size) // (HALF_BYTES * shape.layers)
    pad = fsdp_padding(shape, world_size) // max(1, shape.moe_layers)

    def at(layer: int) -> tuple[int, int, int]:
        """Layer `layer`'s block: (its parameters, what its all-gather buffer holds (FSDP2 pads a MoE block's experts),
        its gradients at its backward). Backward runs the last layer first and layer 0 last; in a model whose dense
        and MoE layers alternate (Llama 4 Maverick) the block gathered ahead of the last one is a dense one."""
        moe = shape.moe_at(layer)
        block = _block_params(shape, layer) - saving
        padded = block + (pad if moe else 0)
        grads = reduced * padded + (head_grad if tied else 0)
        if full and moe:  # the routed experts' weight gradient leaves the grouped matmul transposed: a 16-bit copy
            grads += HALF_BYTES * shape.experts * 3 * shape.hidden * shape.expert_intermediate  # of all of them
        return block, padded, grads

    (last_block, padded, block_grads), ahead, (first_block, _, first_grads) = at(-1), at(-2), at(0)
    last, first = _block_gathers(head, first_block, kept, tied=tied, reshard=reshard, full=full, buffer=buffer,
                                 ahead=ahead[:2])  # fmt: skip
    # the end: the root's embedding gathered again where forward reshards, a tied root's last block still reducing
    end = (half * head if reshard and world_size > 1 else 0) + (reduced * first_block if world_size > 1 and tied else 0)
    end -= 0 if reshard else _end_kept(kept, half * head, world_size)
    # the last block's all-gather, issued for backward at the loss; not with an untied frozen output layer (LoRA), whose
    # unit backward does not run (traced: 2-layer Phi-3, Mistral, Qwen2.5-7B, 4-layer Llama with LoRA at micro-batch 1
    # were 3-21 % over with it, within 2.3 % without)
    prefetch = buffer * padded if reshard and (full or tied) else 0
    # a tied tail (final norm, embedding, output layer) gathered again for the norm's backward, after resharding at the
    # output layer's: during the copy-out its all-gather buffer is alive beside its weights (traced: gemma-2b and
    # gemma-2-2b at zero2_offload, 8 ranks, peaked there 0.60 GiB above the loss, whatever the micro-batch, sequence
    # length or rank count; FSDP2 frees a backward all-gather's buffer only after the copy-out, on a GPU too)
    regather = buffer * head if tied and full else 0
    moments = (
        (gather_head + head_grad + prefetch, acts, loss_hidden + chunk),
        (gather_head + (head_grad + regather if tied else reduced * head + offloaded), acts, loss_hidden),
        (last + block_grads, acts + recompute, 0),
        # where forward reshards, during the last block's own backward: it is gathered beside the one prefetched
        # after it; full fine-tuning's fp32 gradient moment above is larger, a frozen base's (LoRA) has none (traced:
        # Mixtral, Qwen3-30B-A3B and Qwen3-Next LoRA at zero3, 8 ranks, micro-batch 1, were 0.90-0.93 without it,
        # 1.03-1.04 with it; at micro-batch 4 1.03-1.10, Mixtral at minimal 0.78 -> 1.08: over, where it was under)
        (last + (HALF_BYTES * last_block if reshard else 0), acts + recompute, 0),
        (first + first_grads, acts // max(1, shape.layers) + recompute, 0),  # one layer's saved inputs left
        (end + (head_grad + reduced * head + offloaded if full else 0), 0, 0),
    )  # fmt: skip
    return tuple(int(x) for x in max(moments, key=sum))  # type: ignore[return-value]


def _end_kept(kept: int, embedding: int, world_size: int) -> int:
    """What zero2's kept weights have shed by the end of backward: every block resharded after its backward; on one
    rank the root too (traced)."""
    return kept if world_size == 1 else max(0, kept - embedding)


def _block_gathers(
    head: int, first_block: int, kept: int, *, tied: bool, reshard: bool, full: bool, buffer: int,
    ahead: tuple[int, int],
) -> tuple[int, int]:
    """16-bit weights gathered beyond `kept` (what forward left gathered: zero2's) at the last block's backward (the
    first one run, all activations saved) and at the first block's (the last one run, one layer's left), traced:

    - where forward reshards, each block is gathered again (its parameters and the all-gather buffer); at the first
      block the root's embedding is all-gathered ahead into a buffer, for the embedding's backward;
    - where it does not, nothing needs gathering until the root: an untied output layer has resharded after its own
      backward, and so has a fully trained tied embedding's root (its gradient came from the output layer), which
      the first block's backward then gathers ahead again; every other block reshards after its backward.

    At the last block's gradients, where forward reshards, the block itself has resharded and the one backward runs
    next (the one before it in the model) is gathered: `ahead`, its parameters and what its all-gather buffer holds
    (with FSDP2's padding, `fsdp_padding`). Traced on Llama 4 Maverick, whose layers alternate: a dense block is
    gathered while an MoE block's gradients reduce (0.59 GiB of unsharded parameters beside 60.7 GiB reduced). At
    the first block, `first_block` and the root's embedding gathered ahead."""
    if reshard:
        return HALF_BYTES * ahead[0] + buffer * ahead[1], HALF_BYTES * first_block + buffer * head
    root_kept = not (tied and full)
    last = -HALF_BYTES * head * ((not tied) + (not root_kept))
    return last, HALF_BYTES * first_block + (HALF_BYTES * head if root_kept else buffer * head) - kept


def fsdp_padding(shape: ModelShape, world_size: int) -> int:
    """Parameters FSDP2 adds to the shards by padding each tensor's first dimension to a multiple of the ranks:
    noticeable only where that dimension is a mixture-of-experts layer's expert count (the routed experts' 3-D
    weights and biases, the router's rows), which need not divide by the ranks: Qwen1.5-MoE's 60 experts on 8 ranks
    are sharded as 64 (traced: 7.05 GiB of shards where 14.3 B parameters make 6.67; the plan was 5 % under at zero3).
    Every other tensor's first dimension is a width, a multiple of 8 in every published shape (0 on one rank)."""
    if not shape.moe or world_size <= 1:
        return 0
    rows = -shape.experts % world_size
    h, e, bias = shape.hidden, shape.expert_intermediate, shape.expert_bias
    per_expert = h + (1 if bias else 0) + 3 * h * e + ((2 * e + h) if bias else 0)  # router row, weights, biases
    return shape.moe_layers * rows * per_expert
