"""The token cross-entropy straight from the hidden states, in chunks: the (tokens, vocab) fp32 logits never exist.

`F.cross_entropy(logits.float(), ...)` holds the logits upcast to fp32, their log-softmax and, in backward,
their gradient: about 12 B per token x vocab, the largest part of a step's peak at a 50k-150k vocabulary.
`LinearCrossEntropy` computes `hidden @ weight.T (+ bias)` a chunk of tokens at a time (`chunk_tokens`: one
chunk's fp32 logits about `CHUNK_BYTES`), keeps only each token's logsumexp and loss and, in training, forms
each chunk's (softmax - onehot) while its logits exist, from which it accumulates the gradients of the hidden
states, the weight and the bias; backward scales them by the incoming gradient (recomputing the chunks only
when that gradient differs between tokens). Matmuls run in the compute dtype (autocast's when it is on, else the
weight's), the softmax in fp32, as the old path did; each gradient comes back in its input's dtype.

How it plugs in: the model's output layer (`get_output_embeddings()`, a plain `nn.Linear` for GPT-2 and
Llama, tied or not) gets an instance-level `forward` (`ChunkedLossHead`, installed by `install_chunked_loss`):
inside `with head.targets(labels):` it returns the per-token loss (B, T, 1), 0 at IGNORE, which the model
passes out as `.logits`; outside it is `nn.Linear.forward`. The loss is thus computed inside the model's own
forward, where FSDP2 has gathered the layer's weight; the module, its class, its parameters and their
names stay those of the plain model, so state-dict keys, the embedding tie, checkpoints, exports (a fresh
model), DDP, FSDP2's units and hooks (accelerate shards [final norm, lm_head] as one unit and casts its
output), LoRA, activation checkpointing (the head is outside the checkpointed blocks) and torch.compile (the
chunked path runs eagerly, a graph break) are untouched. Alternatives set aside: a wrapper module with the
linear as a child renames every key under it (`lm_head.linear.weight`) and, under FSDP2, would have to call
the child's forward to get its weight gathered; transformers' `loss_function` hook receives the whole logits;
patching the model's own forward is per architecture.

Installed by `Stepper.__init__` (runner/train/step.py) on the prepared model: it replaces no module, so what
DDP and FSDP2 wrapped stays as it was. Not installed (the caller keeps the full logits, and a log line says
why): an output layer that is not an `nn.Linear` running `nn.Linear.forward` (peft-wrapped, quantised), or a
model that changes what its output layer returns in a way the family table does not name. That is found by a
probe: one 4-token forward without gradient, the same on every rank, in which the head returns known values.
What the table names (Gemma 2's final soft cap, Granite's logit scale: `logit_transform`) the head does itself, chunk
by chunk (`LogitTransform`), with the model's own switched off in its config while the loss is computed; checked
against the model's full logits through transformers' own transform to 1e-5 (tests/runner/train/test_loss.py).

`training.loss_kernel: liger` keeps all of this and hands each chunk's softmax, loss and (softmax - onehot) to
Liger Kernel's Triton kernel (`internals.liger_rows`), which works on the chunk's logits at the compute width and
overwrites them with their gradient: one pass instead of eight tensor ops, no fp32 copy, so a chunk holds
LOSS_CHUNK_BYTES of 16-bit logits (twice the tokens). Liger's own entry points were set aside: its fused linear
cross-entropy returns one summed loss (the head must pass out per-token losses, which FSDP2 casts to its output
dtype: a bf16 sum of a whole micro-batch would lose its low digits) or, per token, recomputes every chunk in
backward; its cross-entropy takes whole logits. Checked equal to the plain path to 1e-5 in fp32 under Triton's
interpreter on the CPU (tests/runner/train/test_loss_liger.py); not yet timed on a GPU.

Measured (bench/loss.py, medians of 5, full logits vs chunked): with the gradients recomputed in backward, H100
bf16 autocast, GPT-2 hidden 768, 12 layers, vocab 50257, 8 x 1024 tokens: peak 12.1 -> 7.4 GiB, step 65 -> 77 ms;
2 layers, vocab 128256, 8 x 2048 tokens: 30.1 -> 3.7 GiB, 64 -> 98 ms (the logits' matmul once more). With the
gradients computed in forward (`fused`, now the default in training), on this project's 2-core CPU, fp32, 2
layers, 4 x 512 tokens: peak 2123 -> 1099 MiB, step 3.95 -> 3.38 s (2026-11-25); not yet measured on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.fsdp import FSDPModule

from jobspec.catalog.families import FAMILIES
from jobspec.plan.activations import LOSS_CHUNK_BYTES, LossKernel, loss_chunk_tokens
from runner import internals
from runner.data.dataset import IGNORE
from runner.model.build import eager_forwards

log = logging.getLogger("jobspec.runner")
CHUNK_BYTES = LOSS_CHUNK_BYTES  # one chunk's fp32 logits; the memory model sizes the loss from the same constant
PROBE = (64.0, 65.0, 66.0, 67.0)  # what the head returns in the install probe: exact in bf16, changed by any transform
WIDTH = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its output layer's logits before the loss, applied here to each chunk: times `scale`
    (Granite: 1 / logits_scaling), then `cap * tanh(x / cap)` (Gemma 2's final soft cap). The gradient through it is
    `scale` (times `1 - tanh^2` where capped), formed while the chunk exists. A capped chunk holds that derivative
    beside its fp32 logits, so its tokens are halved (`tokens`): the chunk's bytes stay what the memory model counts."""

    scale: float = 1.0
    cap: float | None = None
    post: float = 1.0  # after the cap: 1 / the sampling temperature (GRPO scores its completions as it sampled them)

    def __bool__(self) -> bool:
        return self.scale != 1.0 or self.cap is not None or self.post != 1.0

    def tokens(self, chunk: int, kernel: LossKernel) -> int:
        """Tokens of a chunk that stays within the bytes of `chunk` untransformed ones: a capped chunk holds its
        derivative too (half as many tokens; a quarter under Liger's kernel, whose chunk is otherwise 16-bit)."""
        if self.cap is None:
            return chunk
        return max(1, chunk // (4 if kernel == "liger" else 2))

    def apply(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """(the transformed logits in fp32, their derivative: a tensor where capped, else the scale)."""
        x = logits.float() if logits.dtype != torch.float32 else logits
        if self.scale != 1.0:
            x = x.mul_(self.scale)
        if self.cap is None:
            return (x.mul_(self.post) if self.post != 1.0 else x), self.scale * self.post
        t = x.div_(self.cap).tanh_()
        slope = torch.mul(t, t).neg_().add_(1.0).mul_(self.scale * self.post)
        return t.mul_(self.cap * self.post), slope


NO_TRANSFORM = LogitTransform()


def chunk_tokens(vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits stay within `budget` bytes."""
    return max(1, budget // (4 * vocab))


def kernel_chunk_tokens(vocab: int, kernel: LossKernel, dtype: torch.dtype) -> int:
    """Tokens per chunk for `kernel` computing in `dtype`, as the memory model sizes them (`loss_chunk_tokens`)."""
    return loss_chunk_tokens(vocab, kernel, WIDTH.get(dtype, "fp32"))


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear` computes in: autocast's for the weight's device when it is on, else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(n, V) logits of one chunk, in the dtype of `h` and `w`."""
    return h @ w.T if b is None else torch.addmm(b, h, w.T)


def _minus(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`logits` (n, V) minus `shift` (n,) in fp32: 16-bit logits are upcast in the same pass (no fp32 copy first)."""
    if logits.dtype == torch.float32:
        return logits.sub_(shift[:, None])
    return torch.sub(logits, shift[:, None])


def _accumulate(
    p: torch.Tensor, hc: torch.Tensor, w: torch.Tensor, s: int, chunk: int,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], dtype: torch.dtype,
) -> None:  # fmt: skip
    """Add one chunk's share to `grads` (hidden (N, H), weight (V, H), bias fp32 (V,); None: not needed), given
    its dL/dlogits `p` (n, V) fp32 (consumed) and its hidden states `hc` (n, H)."""
    grad_h, grad_w, grad_b = grads
    if grad_b is not None:
        grad_b += p.sum(0)
    g = p.to(dtype)
    if grad_h is not None:
        grad_h[s : s + chunk] = g @ w
    if grad_w is not None:
        if grad_w.dtype == dtype:
            grad_w.addmm_(g.T, hc)  # one rounding per chunk
        else:
            grad_w += g.T @ hc  # 16-bit chunk products summed in the fp32 weight's gradient


def _chunk_grads(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor, lse: torch.Tensor,
    scale: torch.Tensor, chunk: int, grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    dtype: torch.dtype, tf: LogitTransform = NO_TRANSFORM,
) -> None:  # fmt: skip
    """The gradients of sum_i scale_i * loss_i, recomputing each chunk's logits: (softmax - onehot) * scale (through
    `tf`'s derivative). `lse` None: Liger's kernel makes each chunk's (softmax - onehot) at the compute width."""
    for s in range(0, h.shape[0], chunk):
        hc = h[s : s + chunk]
        if lse is None:
            p = _liger_chunk(_logits(hc, w, b), target[s : s + chunk], None, True, tf)
            _accumulate(p.mul_(scale[s : s + chunk, None].to(p.dtype)), hc, w, s, chunk, grads, dtype)
            del p
            continue
        z, slope = tf.apply(_logits(hc, w, b)) if tf else (_logits(hc, w, b), 1.0)
        p = _minus(z, lse[s : s + chunk]).exp_()  # (n, V) fp32 softmax
        p.mul_(scale[s : s + chunk, None])
        p.scatter_add_(1, target[s : s + chunk, None], -scale[s : s + chunk, None])
        _accumulate(p.mul_(slope) if tf else p, hc, w, s, chunk, grads, dtype)
        del p, z, slope


def _liger_chunk(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor | None, grads: bool,
                 tf: LogitTransform, mean: torch.Tensor | None = None,
                 entropy: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One chunk through Liger's kernel (`internals.liger_rows`), which leaves d loss / d logits in `logits`. With a
    transform the kernel reads the transformed logits (fp32) and their gradient is taken back through it here (Liger's
    own soft cap takes its cap as a kernel scalar, which Triton's interpreter cannot pass: one path for both).
    `mean`, `entropy` (n,): each row's mean logit and softmax entropy, taken before the kernel overwrites them."""
    z, slope = tf.apply(logits) if tf else (logits, 1.0)
    if mean is not None:
        mean.copy_(z.mean(dim=-1, dtype=torch.float32))
    if entropy is not None:
        for r in range(0, z.shape[0], ENTROPY_ROWS):  # fp32 a few rows at a time: no chunk-sized copy
            block = z[r : r + ENTROPY_ROWS].float()  # fp32 logits: `block` is z itself, left as it is
            e = (block - block.amax(dim=-1, keepdim=True)).exp_()
            entropy[r : r + ENTROPY_ROWS] = _entropy(e, e.sum(dim=-1))
    internals.liger_rows(z, target, torch.empty(z.shape[0], device=z.device) if loss is None else loss, IGNORE, grads)
    return z.mul_(slope) if grads and tf else z


ENTROPY_ROWS = 64  # rows of a chunk whose x log x is formed at once (a 152k vocabulary: 39 MB)


def _entropy(e: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """(n,) fp32: each row's softmax entropy from the (n, V) fp32 `e` = exp(logit - row max) and its row sums `total`:
    log(total) - sum(e log e) / total (0 log 0 = 0), x log x formed ENTROPY_ROWS rows at a time."""
    xlogx = torch.empty(e.shape[0], device=e.device, dtype=torch.float32)
    for r in range(0, e.shape[0], ENTROPY_ROWS):
        block = e[r : r + ENTROPY_ROWS]
        xlogx[r : r + ENTROPY_ROWS] = torch.special.xlogy(block, block).sum(dim=-1)
    return total.log() - xlogx / total


def _forward_plain(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor, scale: torch.Tensor,
    lse: torch.Tensor, loss: torch.Tensor, chunk: int,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None, dtype: torch.dtype,
    tf: LogitTransform = NO_TRANSFORM, means: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Each chunk's loss and log-sum-exp into `loss` and `lse` (N,); with `grads`, (softmax - onehot) * scale added
    to them while the chunk's fp32 logits exist (times `tf`'s derivative: the loss is of the transformed logits).
    `means` (N,): each token's mean logit over the vocabulary (TRL's `mean_logits`), from the same chunk; `entropy`
    (N,): each token's entropy of the softmax (TRL's `entropy`)."""
    for s in range(0, h.shape[0], chunk):
        hc, t = h[s : s + chunk], target[s : s + chunk, None]
        logits, slope = tf.apply(_logits(hc, w, b)) if tf else (_logits(hc, w, b), 1.0)
        top = logits.amax(dim=-1).float()  # (n,)
        x = _minus(logits, top)  # (n, V) fp32, the only large tensor; logsumexp in place:
        del logits
        if means is not None:  # one reduction over the chunk: sum(logit - top) / V + top
            means[s : s + chunk] = x.sum(dim=-1).div_(x.shape[1]).add_(top)
        picked = x.gather(1, t).squeeze(1)  # target logit - top
        total = x.exp_().sum(dim=-1)  # x now holds exp(logit - top)
        lse[s : s + chunk] = total.log().add_(top)
        if entropy is not None:
            entropy[s : s + chunk] = _entropy(x, total)
        loss[s : s + chunk] = lse[s : s + chunk] - top - picked
        if grads is not None:  # softmax - onehot from the same chunk, while it exists: the logits' matmul runs once
            x.div_(total[:, None]).mul_(scale[s : s + chunk, None])
            x.scatter_add_(1, t, -scale[s : s + chunk, None])
            _accumulate(x.mul_(slope) if tf else x, hc, w, s, chunk, grads, dtype)
        del x, slope


def _forward_liger(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, labels: torch.Tensor, loss: torch.Tensor, chunk: int,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None, dtype: torch.dtype,
    tf: LogitTransform = NO_TRANSFORM, means: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Each chunk's loss into `loss` (N,) by Liger's kernel; with `grads`, the (softmax - onehot) it leaves in the
    chunk's logits (0 at IGNORE rows, which it skips) added to them. `means`, `entropy`: as `_forward_plain`'s."""
    for s in range(0, h.shape[0], chunk):
        hc = h[s : s + chunk]
        mean = None if means is None else means[s : s + chunk]
        logits = _liger_chunk(_logits(hc, w, b), labels[s : s + chunk], loss[s : s + chunk], grads is not None, tf,
                              mean, None if entropy is None else entropy[s : s + chunk])  # fmt: skip
        if grads is not None:
            _accumulate(logits, hc, w, s, chunk, grads, dtype)
        del logits


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of `hidden @ weight.T + bias` (..., V): fp32, shaped like `labels` (...), 0 at IGNORE.

    The result is allocated in that shape, not a view: FSDP2 warns about a view returned by a module.

    `fused` (training a summed loss: `summed` True, the caller's promise that it sums the per-token losses times one
    scalar, so the incoming gradient is the same for every token): the gradients are computed in forward, from the
    chunk's logits while they exist, and backward only scales them: the logits' matmul runs once, as in the plain path
    (Liger Kernel's fused linear cross-entropy does the same). Per-token losses weighted apart (the preference
    objectives', GRPO's) are recomputed chunk by chunk from the saved hidden states in backward. (An earlier version
    computed them in forward anyway and compared the incoming gradient on the host to choose: a sync in every
    backward, and the forward's gradients thrown away for every weighted loss.)

    `kernel` "liger": each chunk's loss and (softmax - onehot) come from Liger Kernel's Triton kernel
    (`internals.liger_rows`), which reads the chunk's logits at the compute width and overwrites them with their
    gradient: no fp32 copy of the chunk, one pass over it instead of the eight tensor ops below.

    `means` (a list, or None): each token's mean logit over the vocabulary, fp32 and shaped like `labels`, is appended
    to it (a detached by-product of the chunks: TRL's `logits/chosen|rejected`); `entropies` likewise each token's
    entropy of the softmax over the vocabulary (GRPO's `entropy`, TRL's entropy_from_logits)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, dtype: torch.dtype, fused: bool = False,  # type: ignore[override]
                kernel: LossKernel = "chunked", tf: LogitTransform = NO_TRANSFORM,
                means: list[torch.Tensor] | None = None, entropies: list[torch.Tensor] | None = None):  # fmt: skip
        # hidden (..., H), weight (V, H), bias (V,) or None, labels (...) int64; N tokens
        with torch.autocast(hidden.device.type, enabled=False):  # the casts are explicit
            h = hidden.reshape(-1, hidden.shape[-1]).to(dtype)  # (N, H), saved at the compute width, as autocast would
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            valid = labels.reshape(-1) != IGNORE
            target = labels.reshape(-1).masked_fill(~valid, 0)
            liger = kernel == "liger"
            lse = None if liger else torch.empty(h.shape[0], device=h.device, dtype=torch.float32)  # (N,)
            out = torch.empty(labels.shape, device=h.device, dtype=torch.float32)
            loss = out.view(-1)
            grads = _new_grads(ctx.needs_input_grad[:3], h, weight, hidden.dtype) if fused else (None, None, None)
            scale = valid.float()  # fused: each token's loss has gradient 1 (0 at IGNORE) until backward scales it
            mean = None if means is None else torch.empty(labels.shape, device=h.device, dtype=torch.float32)
            flat_mean = None if mean is None else mean.view(-1)
            ent = None if entropies is None else torch.empty(labels.shape, device=h.device, dtype=torch.float32)
            flat_ent = None if ent is None else ent.view(-1)
            if liger:
                _forward_liger(h, w, b, labels.reshape(-1).contiguous(), loss, chunk, grads if fused else None, dtype,
                               tf, flat_mean, flat_ent)  # fmt: skip
            else:
                _forward_plain(h, w, b, target, scale, lse, loss, chunk, grads if fused else None, dtype, tf,
                               flat_mean, flat_ent)  # fmt: skip
            if means is not None:
                means.append(mean)
            if entropies is not None:
                entropies.append(ent)
            loss.masked_fill_(~valid, 0.0)
            ctx.fused = grads if fused else None
        ctx.save_for_backward(h, weight, bias, target, valid, lse)
        ctx.chunk, ctx.dtype, ctx.hidden_shape, ctx.hidden_dtype = chunk, dtype, hidden.shape, hidden.dtype
        ctx.tf = tf
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):  # type: ignore[override]
        h, weight, bias, target, valid, lse = ctx.saved_tensors
        flat = grad_loss.reshape(-1)
        # the gradients made in forward (`fused`: a summed loss, whose incoming gradient is the same for every token
        # by the caller's promise) are scaled; per-token losses (the preference objectives', GRPO's) come back
        # weighted by their sequence and are recomputed: finding out by comparing the values would read them back
        # to the host, a sync in every micro-batch's backward
        if ctx.fused is not None and flat.numel() > 0:
            g0 = flat[0]  # the same for every token: the forward's gradients, scaled
            grad_h, grad_w, grad_b = (None if x is None else x.mul_(g0.to(x.dtype)) for x in ctx.fused)
            ctx.fused = None
        else:
            ctx.fused = None
            with torch.autocast(h.device.type, enabled=False):
                w, b = weight.to(ctx.dtype), None if bias is None else bias.to(ctx.dtype)
                scale = flat.float() * valid  # (N,): d loss_i, 0 at IGNORE
                grad_h, grad_w, grad_b = grads = _new_grads(ctx.needs_input_grad[:3], h, weight, ctx.hidden_dtype)
                _chunk_grads(h, w, b, target, lse, scale, ctx.chunk, grads, ctx.dtype, ctx.tf)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        if grad_h is not None:
            grad_h = grad_h.view(ctx.hidden_shape)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def _new_grads(
    need: tuple[bool, ...], h: torch.Tensor, weight: torch.Tensor, hidden_dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Empty gradients of the hidden states, zeroed ones of the weight (its dtype, as autograd gives it) and bias."""
    need_h, need_w, need_b = need
    grad_h = torch.empty(h.shape, device=h.device, dtype=hidden_dtype) if need_h else None
    grad_w = torch.zeros_like(weight) if need_w else None
    grad_b = torch.zeros(weight.shape[0], device=h.device, dtype=torch.float32) if need_b else None
    return grad_h, grad_w, grad_b


@torch.compiler.disable  # eager under torch.compile: dynamo would unroll the chunk loop
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    chunk: int | None = None,
    kernel: LossKernel = "chunked",
    transform: LogitTransform = NO_TRANSFORM,
    means: list[torch.Tensor] | None = None,
    summed: bool = False,
    entropies: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of `transform(hidden @ weight.T + bias)` against `labels` (IGNORE: 0), shaped like
    `labels`, fp32; `means`, `entropies`: see `LinearCrossEntropy`.

    hidden (..., H), labels (...); `chunk`: tokens per chunk (default `kernel_chunk_tokens`; fewer for a soft cap:
    `LogitTransform.tokens`); `kernel`: what computes each chunk's softmax, loss and gradient (`LinearCrossEntropy`);
    `summed`: the caller sums the result (times one scalar), so its gradient is the same for every token."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)}")
    dtype = compute_dtype(weight)
    n = chunk or kernel_chunk_tokens(weight.shape[0], kernel, dtype)
    n = max(1, transform.tokens(n, kernel))
    # gradients in forward only for a summed loss: per-token losses come back weighted, and backward recomputes them
    fused = summed and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return LinearCrossEntropy.apply(hidden, weight, bias, labels, n, dtype, fused, kernel, transform, means, entropies)


class ChunkedLossHead:
    """The model's output layer with a second mode: per-token losses (B, T, 1) while `targets(labels)` is open.

    Installed as the layer's instance `forward`; `remove()` gives the layer back its class's forward."""

    def __init__(self, linear: nn.Linear, chunk: int | None = None, kernel: LossKernel = "chunked",
                 transform: LogitTransform = NO_TRANSFORM, config: Any = None,
                 off: dict[str, Any] | None = None):  # fmt: skip
        self.linear = linear
        self.chunk = chunk  # tokens per chunk; None: kernel_chunk_tokens(vocab, kernel, compute dtype)
        self.kernel = kernel
        self.transform = transform  # what the model does to the logits, done here chunk by chunk
        self._config, self._off = config, off or {}  # the config values that make the model do it, off meanwhile
        self._labels: torch.Tensor | None = None
        self._means: list[torch.Tensor] | None = None
        self._entropies: list[torch.Tensor] | None = None
        self._summed = False
        self._probe: torch.Tensor | None = None
        linear.forward = self.forward  # shadows nn.Linear.forward on this instance only

    @contextmanager
    def targets(self, labels: torch.Tensor, means: list[torch.Tensor] | None = None, *, summed: bool = False,
                temperature: float = 1.0, entropies: list[torch.Tensor] | None = None) -> Iterator[None]:  # fmt: skip
        """While open, the layer returns the loss of each token against `labels` (B, T) (shifted; IGNORE masked), and
        the model's own soft cap or logit scale is off (the head applies it to each chunk). `means`: each forward
        appends its tokens' mean logits (B, T, 1) fp32 to it (`LinearCrossEntropy`). `summed`: the caller sums the
        losses (times one scalar) before backward, which then needs no host sync (`linear_cross_entropy`).
        `temperature`: the loss of the logits over it (GRPO's, as TRL scores sampled completions). `entropies`: each
        forward appends its tokens' softmax entropies (B, T, 1) fp32 to it."""
        self._labels, self._means, self._summed, self._entropies = labels, means, summed, entropies
        transform = self.transform
        if temperature != 1.0:
            self.transform = replace(transform, post=transform.post / temperature)
        kept = {key: getattr(self._config, key) for key in self._off}
        for key, value in self._off.items():
            setattr(self._config, key, value)
        try:
            yield
        finally:
            self._labels = self._means = self._entropies = None
            self._summed = False
            self.transform = transform
            for key, value in kept.items():
                setattr(self._config, key, value)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        linear, labels = self.linear, self._labels
        if labels is None:
            return type(linear).forward(linear, hidden)  # the plain layer: logits
        if hidden.shape[:-1] != labels.shape:  # e.g. a model that slices the hidden states before its head
            raise ValueError(f"output layer: hidden states {tuple(hidden.shape)}, labels {tuple(labels.shape)}")
        if self._probe is not None:
            return self._probe.to(hidden.device, copy=True)
        # (B, T, 1, H) against (B, T, 1): the per-token loss comes out (B, T, 1), allocated so (not a view)
        h, y = hidden.unsqueeze(-2), labels.unsqueeze(-1)
        return linear_cross_entropy(h, linear.weight, linear.bias, y, chunk=self.chunk, kernel=self.kernel,
                                    transform=self.transform, means=self._means, summed=self._summed,
                                    entropies=self._entropies)  # fmt: skip

    def remove(self) -> None:
        if self.linear.__dict__.get("forward") == self.forward:
            del self.linear.forward

    def probe(self, model: nn.Module, device: torch.device) -> str | None:
        """Why `model` cannot take its loss from this head, or None: one tiny forward, no gradient, in eval mode,
        in which the head returns known values that the model must pass out unchanged as `.logits`."""
        ids = torch.zeros(1, len(PROBE), dtype=torch.long, device=device)
        expected = self._probe = torch.tensor(PROBE).view(1, -1, 1)
        training = model.training
        model.eval()
        try:
            with torch.no_grad(), eager_forwards(), self.targets(ids):
                out = model(input_ids=ids).logits
        except (RuntimeError, ValueError) as err:  # e.g. the model slices the hidden states before the head
            return f"the probe forward failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        finally:
            self._probe = None
            model.train(training)
            for m in model.modules():  # FSDP2 leaves units without reshard-after-forward gathered, and their
                if isinstance(m, FSDPModule):  # gathered tensors registered: the optimizer's are the sharded ones
                    m.reshard()
        if out.shape != expected.shape or not torch.equal(out.float().cpu(), expected):
            return "the model changes what its output layer returns (logit soft-capping or scaling?)"
        return None


def logit_transform(model: nn.Module) -> tuple[LogitTransform, Any, dict[str, Any]]:
    """(what `model`'s family does to its logits, its config, the config values that switch that off) from the family
    table (jobspec/catalog/families.py: Gemma 2's `final_logit_softcapping`, Granite's `logits_scaling`)."""
    config = getattr(model, "config", None)
    fam = FAMILIES.get(getattr(config, "model_type", None) or "")
    if fam is None:
        return NO_TRANSFORM, config, {}
    off: dict[str, Any] = {}
    cap, scale = None, 1.0
    value = getattr(config, fam.softcap_key, None) if fam.softcap_key else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        cap, off[fam.softcap_key] = float(value), None  # type: ignore[index]
    value = getattr(config, fam.scale_key, None) if fam.scale_key else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and value != 1:
        scale, off[fam.scale_key] = (1.0 / value if fam.scale_divides else float(value)), 1.0  # type: ignore[index]
    return LogitTransform(scale, cap), config, off


def install_chunked_loss(
    model: nn.Module,
    *,
    run: nn.Module | None = None,
    device: torch.device | None = None,
    chunk: int | None = None,
    kernel: LossKernel = "chunked",
) -> ChunkedLossHead | None:
    """The chunked loss installed on `model`'s output layer (`model` unwrapped: HF or peft model), or None with a
    log line saying why the caller must keep the full logits. `run`: what to call for the probe forward (the
    DDP/FSDP-prepared model; default `model`), on `device` (default: the layer's). `kernel` "liger": the caller has
    checked that Liger's kernel runs here (`internals.check_liger`)."""
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    why = None
    if not isinstance(layer, nn.Linear) or type(layer).forward is not nn.Linear.forward:
        why = f"the output layer is {type(layer).__name__}, not a plain nn.Linear"
    elif "forward" in vars(layer):
        why = "the output layer's forward is already replaced"
    if why is None:
        transform, config, off = logit_transform(model)
        head = ChunkedLossHead(layer, chunk, kernel, transform, config, off)
        why = head.probe(run or model, device or layer.weight.device)
        if why is None:
            log.info("loss: chunked cross-entropy from the hidden states, %s (chunks of %d MiB of logits, vocab %d%s)",
                     "Liger Kernel's Triton kernel" if kernel == "liger" else "plain PyTorch", CHUNK_BYTES >> 20,
                     layer.out_features, f"; logits x {transform.scale:g}, soft cap {transform.cap}" if transform
                     else "")  # fmt: skip
            return head
        head.remove()
    log.info("loss: full logits, not the chunked cross-entropy: %s", why)
    return None
