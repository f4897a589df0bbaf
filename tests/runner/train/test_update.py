"""The end of a step as a transaction with fp16's GradScaler (runner/train/update.py): the optimizer step is taken
group by group, as GradScaler.step would take it whole, so an OOM inside the second group finishes that group alone.

A torch GradScaler on the CPU scales, unscales and checks for inf as on a GPU; the fused AdamW takes its inf flags
inside the kernel on both. The runner refuses fp16 on a CPU-only machine (autocast), so these tests drive `Update`
directly with the scaler and optimizer the runner gives it.
"""

from __future__ import annotations

import pytest
import torch

from runner.train.update import Update
from tests.runner.train_helpers import steps_with_an_oom


def _setup(seed: int = 0, *, fused: bool = True):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4)),
              torch.nn.Parameter(torch.randn(3, 3))]  # fmt: skip
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-2,
                            fused=fused)  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return params, opt, scaler, Update(opt, params, world_size=1, manual_sync=False, max_grad_norm=1.0, scaler=scaler)


def _grads(params, scaler, step: int, inf: bool = False) -> None:
    g = torch.Generator().manual_seed(100 + step)
    scale = scaler.scale(torch.ones(()))  # what a scaled backward multiplies the gradients by
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    if inf:
        params[2].grad[0, 0] = float("inf")


def _train(update, params, opt, scaler, steps: int, fail_at: int | None = None, inf_at: int | None = None):
    return steps_with_an_oom(update, opt, steps, lambda step: _grads(params, scaler, step, inf=step == inf_at), fail_at)


@pytest.mark.parametrize("fused", [True, False])
def test_an_oom_in_the_second_group_of_an_fp16_step_finishes_that_group_alone(fused):
    """Bit-identical weights, Adam's step counters and loss scale against a run without the OOM."""
    a = _setup(fused=fused)
    _train(a[3], a[0], a[1], a[2], steps=3)
    b = _setup(fused=fused)
    calls = _train(b[3], b[0], b[1], b[2], steps=3, fail_at=4)  # step 2's second group (two groups a step)
    assert calls == 7
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert [float(s["step"]) for s in b[1].state.values()] == [3.0, 3.0, 3.0]
    assert a[2].get_scale() == b[2].get_scale()


@pytest.mark.parametrize("fused", [True, False])
def test_an_fp16_step_with_an_inf_gradient_is_skipped_and_the_scale_halves(fused):
    params, opt, scaler, update = _setup(fused=fused)
    _train(update, params, opt, scaler, steps=1)
    before = [p.detach().clone() for p in params]
    scale = scaler.get_scale()
    _train(update, params, opt, scaler, steps=1, inf_at=0)
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    assert scaler.get_scale() == scale / 2
    assert [float(s["step"]) for s in opt.state.values()] == [1.0, 1.0, 1.0]
