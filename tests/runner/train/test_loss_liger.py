"""`training.loss_kernel: liger`: each chunk's cross-entropy by Liger Kernel's Triton kernel (runner/train/loss.py,
`internals.liger_rows`), against the plain chunked loss and autograd.

The kernel is Triton: on this CPU it runs under Triton's interpreter (TRITON_INTERPRET=1, set before liger-kernel is
first imported), which executes the same kernel source on CPU tensors. What a GPU adds (compilation, speed) is
bench/gpu's to measure. Skipped where liger-kernel or triton is not installed (the dev extra installs both).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from jobspec.catalog.presets import PRESETS
from jobspec.errors import ConfigError
from jobspec.plan import activations, memory
from runner import internals
from runner.data.dataset import IGNORE
from runner.train.loss import install_chunked_loss, kernel_chunk_tokens, linear_cross_entropy
from tests.runner.train.test_loss import FP32, labels_for, tiny_model

pytest.importorskip("triton")
pytest.importorskip("liger_kernel")


@pytest.fixture(autouse=True)
def interpreted(request):
    """On a CPU the kernel runs under Triton's interpreter, which tests/conftest.py turns on before anything imports
    Triton (Triton reads it at import); the `gpu` test runs it compiled."""
    if request.node.get_closest_marker("gpu") is None and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1 (a GPU machine: the gpu test below runs the kernel compiled)")


def both(hidden, weight, bias, labels, *, chunk, weights=None):
    """(loss, gradients) of the chunked and the Liger path, the same inputs and the same incoming gradient."""
    out = []
    for kernel in ("chunked", "liger"):
        inputs = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
        h, w, *b = inputs
        per_token = linear_cross_entropy(h, w, b[0] if b else None, labels, chunk=chunk, kernel=kernel)
        loss = (per_token * weights).sum() if weights is not None else per_token.sum()
        out.append((per_token.detach(), torch.autograd.grad(loss, inputs)))
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_liger_equals_the_chunked_loss_and_autograd_in_fp32(bias, chunk):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(6, 9, 16, generator=g)
    weight = torch.randn(300, 16, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    labels = torch.randint(0, 300, (6, 9), generator=g)
    labels[labels % 4 == 0] = IGNORE
    (plain, plain_grads), (liger, liger_grads) = both(hidden, weight, b, labels, chunk=chunk)
    ref = F.cross_entropy(F.linear(hidden, weight, b).flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                          reduction="none").view(6, 9)  # fmt: skip
    assert liger.dtype == torch.float32 and liger.shape == labels.shape
    assert torch.all(liger[labels == IGNORE] == 0)
    torch.testing.assert_close(liger, ref, **FP32)
    torch.testing.assert_close(liger, plain, **FP32)
    for got, want in zip(liger_grads, plain_grads, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize(("scale", "cap"), [(1.0, 5.0), (0.25, None), (3.0, 2.0)])
def test_both_kernels_apply_the_familys_logit_transform_as_autograd_does(scale, cap):
    """A soft cap and a logit scale (LogitTransform) on each chunk, in both kernels, with a uniform incoming gradient
    (gradients formed in forward) and a per-token one (recomputed chunk by chunk): equal to autograd through
    `cap * tanh(scale * logits / cap)` on the whole logits."""
    from runner.train.loss import LogitTransform

    tf = LogitTransform(scale, cap)
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(4, 7, 16, generator=g), torch.randn(300, 16, generator=g) * 2
    labels = torch.randint(0, 300, (4, 7), generator=g)
    labels[0, :2] = IGNORE
    weights = torch.rand(4, 7, generator=g)
    for per_token_weights in (None, weights):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        z = F.linear(h, w) * scale
        z = cap * torch.tanh(z / cap) if cap else z
        ref = F.cross_entropy(z.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none").view(4, 7)
        ref_loss = (ref * per_token_weights).sum() if per_token_weights is not None else ref.sum()
        want = torch.autograd.grad(ref_loss, (h, w))
        for kernel in ("chunked", "liger"):
            h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            got = linear_cross_entropy(h2, w2, None, labels, chunk=5, kernel=kernel, transform=tf)
            loss = (got * per_token_weights).sum() if per_token_weights is not None else got.sum()
            torch.testing.assert_close(got, ref.detach(), **FP32)
            for a, b in zip(torch.autograd.grad(loss, (h2, w2)), want, strict=True):
                torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize(("scale", "cap"), [(1.0, None), (3.0, 2.0)])
def test_both_kernels_give_each_tokens_mean_logit_and_entropy_and_the_same_loss_with_them(scale, cap):
    """`means` (logits/chosen|rejected) and `entropies` (GRPO's entropy): each token's mean over the vocabulary of the
    transformed logits and the entropy of their softmax, IGNORE positions included, from the chunks (no whole logits);
    asking for them changes neither the loss nor its gradient."""
    from runner.train.loss import LogitTransform

    tf = LogitTransform(scale, cap)
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(3, 7, 16, generator=g), torch.randn(300, 16, generator=g) * 2
    labels = torch.randint(0, 300, (3, 7), generator=g)
    labels[0, :2] = IGNORE
    z = F.linear(hidden, weight) * scale
    capped = cap * torch.tanh(z / cap) if cap else z
    want = capped.mean(-1)
    entropy = -(capped.log_softmax(-1).exp() * capped.log_softmax(-1)).sum(-1)
    for kernel in ("chunked", "liger"):
        means: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        h = hidden.clone().requires_grad_()
        got = linear_cross_entropy(h, weight, None, labels, chunk=5, kernel=kernel, transform=tf, means=means,
                                   entropies=entropies)  # fmt: skip
        (grad,) = torch.autograd.grad(got.sum(), h)
        h2 = hidden.clone().requires_grad_()
        plain = linear_cross_entropy(h2, weight, None, labels, chunk=5, kernel=kernel, transform=tf)
        (grad2,) = torch.autograd.grad(plain.sum(), h2)
        assert len(means) == 1 and means[0].shape == labels.shape and means[0].dtype == torch.float32
        torch.testing.assert_close(means[0], want, **FP32)
        assert len(entropies) == 1 and entropies[0].shape == labels.shape
        torch.testing.assert_close(entropies[0], entropy, **FP32)
        torch.testing.assert_close(got, plain, rtol=0, atol=0)
        torch.testing.assert_close(grad, grad2, rtol=0, atol=0)


def test_a_per_token_incoming_gradient_recomputes_through_the_kernel():
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(10, 8, generator=g), torch.randn(50, 8, generator=g)
    labels = torch.randint(0, 50, (10,), generator=g)
    labels[:4] = IGNORE
    weights = torch.rand(10, generator=g)
    (_, plain), (_, liger) = both(hidden, weight, None, labels, chunk=3, weights=weights)
    for got, want in zip(liger, plain, strict=True):
        torch.testing.assert_close(got, want, **FP32)
    assert torch.all(liger[0][:4] == 0)


def test_without_gradients_the_kernel_gives_the_loss_alone():
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(70, 8, generator=g)
    labels = torch.randint(0, 70, (2, 5), generator=g)
    with torch.no_grad():
        plain = linear_cross_entropy(hidden, weight, None, labels, chunk=4)
        liger = linear_cross_entropy(hidden, weight, None, labels, chunk=4, kernel="liger")
    torch.testing.assert_close(liger, plain, **FP32)


def test_bf16_autocast_runs_the_kernel_on_16_bit_logits_close_to_the_chunked_loss():
    """Under autocast the kernel reads the chunk's bf16 logits (the chunked loss upcasts them first): the same
    logits, softmax in fp32 in both; gradients rounded to bf16 once in both, so they agree to bf16's precision."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(64, 32, generator=g), torch.randn(500, 32, generator=g) * 0.2
    labels = torch.randint(0, 500, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (plain, plain_grads), (liger, liger_grads) = both(hidden, weight, None, labels, chunk=10)
    torch.testing.assert_close(liger, plain, rtol=1e-5, atol=1e-4)
    for got, want in zip(liger_grads, plain_grads, strict=True):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize(("preset", "tied"), [("tiny", True), ("llama-tiny", False)])
def test_through_the_model_every_gradient_equals_the_chunked_heads(preset, tied):
    ids = torch.randint(0, PRESETS[preset].vocab, (2, 24), generator=torch.Generator().manual_seed(6))
    labels = labels_for(ids, PRESETS[preset].vocab)
    results = []
    for kernel in ("chunked", "liger"):
        model = tiny_model(preset, tied=tied)
        head = install_chunked_loss(model, kernel=kernel)
        assert head is not None and head.kernel == kernel
        with head.targets(labels):
            loss = model(input_ids=ids).logits.float().sum()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (liger, liger_grads) = results
    torch.testing.assert_close(liger, plain, **FP32)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(liger_grads[name], grad, **FP32, msg=lambda m, n=name: f"{n}: {m}")


# --- sizes: the runner's chunks, the trace and the formula ---------------------------------------------------------


def test_the_chunks_hold_the_same_bytes_of_logits_at_the_compute_width():
    vocab = 128256
    assert kernel_chunk_tokens(vocab, "chunked", torch.bfloat16) == activations.LOSS_CHUNK_BYTES // (4 * vocab)
    assert kernel_chunk_tokens(vocab, "liger", torch.bfloat16) == activations.LOSS_CHUNK_BYTES // (2 * vocab)
    assert kernel_chunk_tokens(vocab, "liger", torch.float32) == activations.LOSS_CHUNK_BYTES // (4 * vocab)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["fast", "zero3"])
def test_the_trace_and_the_formula_count_the_kernels_chunk(tier):
    """A shape whose step peaks at the loss (small blocks, a 128k vocabulary): the trace of the runner's own step
    with each kernel (Liger's the one call skipped on fakes), and the formula within 5 % of each. The chunked loss
    holds 1.5 x 256 MiB at the loss (fp32 logits and their 16-bit gradient), Liger's 256 MiB of bf16 logits."""
    from runner.train.trace import trace_step

    shape = dataclasses.replace(PRESETS["llama-1b"], layers=2, hidden=512, intermediate=1024, heads=8, kv_heads=2)
    traced, formula = {}, {}
    for kernel in ("chunked", "liger"):
        r = trace_step(shape, tier=tier, world_size=2, micro_batch=4, seq_len=2048, loss_kernel=kernel)
        e = memory.estimate(shape, tier=tier, seq_len=2048, micro_batch=4, world_size=2, loss_kernel=kernel)
        traced[kernel], formula[kernel] = r.peak, e.gpu_bytes - e.overhead
        assert abs(formula[kernel] / traced[kernel] - 1) < 0.05, (kernel, formula[kernel], traced[kernel])
    saved = traced["chunked"] - traced["liger"]
    assert 0.3 * activations.LOSS_CHUNK_BYTES < saved <= 0.5 * activations.LOSS_CHUNK_BYTES + 2**20, saved
    assert formula["chunked"] - formula["liger"] == pytest.approx(saved, rel=0.35)


# --- refusals: where the kernel cannot run ------------------------------------------------------------------------


def test_check_liger_refuses_a_cpu_without_the_interpreter(monkeypatch):
    internals.check_liger("cpu")  # the interpreter is on
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match=r"loss_kernel.*chunked"):
        internals.check_liger("cpu")
    internals.check_liger("cuda")


def test_check_liger_refuses_a_kernel_whose_arguments_changed(monkeypatch):
    class Moved:
        arg_names = ["X_ptr", "Y_ptr", "loss_ptr", "n_cols", "ignore_index", "reduction", "NEW_REQUIRED"]

    monkeypatch.setattr(internals.kernels, "_liger_kernel", lambda: (Moved(), 1024))
    with pytest.raises(ConfigError, match=r"liger-kernel .*NEW_REQUIRED"):
        internals.check_liger("cuda")


def test_check_liger_names_the_fix_without_the_package(monkeypatch):
    def missing():
        raise ImportError("No module named 'liger_kernel'")

    monkeypatch.setattr(internals.kernels, "_liger_kernel", missing)
    with pytest.raises(ConfigError, match=r"jobspec-k8s\[liger\].*loss_kernel: chunked"):
        internals.check_liger("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_a_gpu_the_compiled_kernel_trains_a_model_as_the_chunked_loss_does():
    """Compiled for the GPU (not interpreted): a Llama-style model in bf16 autocast, loss and every gradient against
    the plain chunked loss, and each path's step time (printed; `pytest -m gpu -s` shows it)."""
    import time

    internals.check_liger("cuda")
    ids = torch.randint(0, PRESETS["llama-tiny"].vocab, (8, 512), generator=torch.Generator().manual_seed(7)).cuda()
    labels = labels_for(ids, PRESETS["llama-tiny"].vocab)
    results, times = [], {}
    for kernel in ("chunked", "liger"):
        model = tiny_model("llama-tiny", tied=False).cuda()
        head = install_chunked_loss(model, kernel=kernel)
        assert head is not None
        steps = []
        for _ in range(6):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            tic = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16), head.targets(labels):
                loss = model(input_ids=ids).logits.float().sum()
            loss.backward()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - tic)
        times[kernel] = sorted(steps[1:])[2]
        results.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (plain, plain_grads), (liger, liger_grads) = results
    print(f"step: chunked {times['chunked'] * 1e3:.2f} ms, liger {times['liger'] * 1e3:.2f} ms (median of 5)")
    torch.testing.assert_close(liger, plain, rtol=1e-4, atol=1e-2)
    for name, grad in plain_grads.items():
        scale = grad.abs().max().clamp_min(1e-12)
        assert (liger_grads[name] - grad).abs().max() <= 2e-2 * scale, name
