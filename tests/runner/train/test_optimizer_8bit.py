"""`training.optimizer: adamw_8bit`: torchao's AdamW8bit through the runner's whole path on CPU (runner/internals/
lowbit.py, runner/train/engine.py, update.py, handoff.py, runner/checkpoint/store.py) and in the memory model.

torchao compiles its step once per parameter shape (about 40 s for the tiny preset on these 2 cores on a cold
inductor cache, a few seconds once cached), so the runs share one module fixture.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.optim")

from jobspec.catalog.presets import PRESETS
from jobspec.errors import ConfigError
from jobspec.plan import memory
from runner import internals
from runner.train import handoff
from runner.train.update import Update
from tests.runner.train_helpers import records, tiny_spec, train_and_resume, train_in_process

EIGHT_BIT = {"training": {"micro_batch": 4, "steps": 8, "optimizer": "adamw_8bit"}, "checkpoints": {"every_steps": 4}}


def _quantized(t: torch.Tensor, signed: bool) -> torch.Tensor:
    from torchao.optim.subclass_8bit import OptimState8bit

    state = OptimState8bit.zeros(t.shape, signed=signed, block_size=internals.lowbit.BLOCK)
    state.copy_(t)  # torchao's own quantization
    return state


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_a_dequantized_state_requantizes_to_the_same_codes_and_scales(signed):
    """The checkpoint and the hand-over keep fp32 values; read back on the same layout they are the same 8-bit state,
    bit for bit: blocks whose extreme is negative (the signed map has no -1.0), whose largest value came from the
    entry next to 1.0, and blocks of zeros included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g) * torch.rand(512, 1, generator=g) * 10
    x[3] = 0.0
    x[5, 7] = -50.0  # a negative extreme
    x = x if signed else x.square()
    saved = _quantized(x, signed)
    back = _quantized(torch.zeros_like(x), signed)
    internals.requantize_into(back, internals.dequantized(saved))
    assert torch.equal(back.codes, saved.codes) and torch.equal(back.scale, saved.scale)


def test_values_of_another_layout_are_quantized_afresh_as_closely_as_torchao_does():
    """fp32 values that no 8-bit state of these blocks made (another tier's shards): a fresh quantization, no
    worse than torchao's own."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    ours = _quantized(torch.zeros_like(x), True)
    internals.requantize_into(ours, x)
    theirs = _quantized(x, True)
    err = (ours.dequantize() - x).abs().max()
    assert err <= (theirs.dequantize() - x).abs().max() * 1.01 and err < 0.05 * x.abs().max()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny preset for 8 steps with 8-bit moments, uninterrupted and resumed from step 4, and with fp32 AdamW."""
    base = tmp_path_factory.mktemp("eight_bit")
    full, part = train_and_resume(base, EIGHT_BIT)
    fp32_dir = base / "fp32"
    code, _ = train_in_process(tiny_spec(fp32_dir, **{**EIGHT_BIT, "training": {"micro_batch": 4, "steps": 8}}))
    assert code == 0
    return base, full, part, fp32_dir


def test_the_run_steps_with_8bit_moments(runs):
    _, full, _, _ = runs
    inner = full.optimizer.optimizer
    assert internals.is_low_bit(inner)
    states = [v for s in inner.state.values() for k, v in s.items() if k.startswith("exp_avg")]
    quantized = [v for v in states if internals.is_quantized(v)]
    # every tensor of at least 4096 values: the embeddings and the blocks' matrices of the tiny preset
    big = [p for p in full.model.parameters() if p.numel() >= memory_min()]
    assert len(quantized) == 2 * len(big) and len(states) == 2 * sum(1 for p in full.model.parameters())


def memory_min() -> int:
    return internals.lowbit.MIN_QUANTIZED


def test_it_learns_as_fp32_adamw_does(runs):
    base, _, _, fp32_dir = runs
    eight = {r["step"]: r["loss"] for r in records(base / "full")}
    fp32 = {r["step"]: r["loss"] for r in records(fp32_dir)}
    assert eight[1] == pytest.approx(fp32[1], rel=1e-6)  # the first forward is before any update
    assert eight[8] < eight[1] - 0.5
    assert eight[8] == pytest.approx(fp32[8], rel=0.02)


def test_a_resumed_8bit_run_matches_an_uninterrupted_one_bit_for_bit(runs):
    """The checkpoint holds the moments as fp32 values, read back into the same codes and scales."""
    base, full, part, _ = runs
    a = {r["step"]: r["loss"] for r in records(base / "full")}
    b = {r["step"]: r["loss"] for r in records(base / "part")}
    assert sorted(b) == [5, 6, 7, 8] and all(b[s] == a[s] for s in b), (a, b)
    for (k, v), (_, w) in zip(full.model.state_dict().items(), part.model.state_dict().items(), strict=True):
        assert torch.equal(v, w), k
    assert internals.is_low_bit(part.optimizer.optimizer)


def test_the_hand_over_gives_an_8bit_state_to_a_new_8bit_optimizer_unchanged(runs):
    """A tier step-down's state in memory (runner/train/handoff.py) between two AdamW8bit optimizers of one layout:
    the same codes, scales and step counters; into fp32 AdamW (an offload tier): the dequantized values."""
    _, full, _, _ = runs
    model, inner = full.model, full.optimizer.optimizer
    kept = handoff.take(model, inner, rank=0, world=1, trainable_only=False)
    assert isinstance(kept, handoff.Handoff)
    groups = [{**g, "params": list(g["params"])} for g in inner.param_groups]
    fresh = internals.adamw_8bit([{k: v for k, v in g.items() if k != "lr"} for g in groups], 1e-3, (0.9, 0.999))
    assert handoff.fits(kept, model, fresh) is None
    handoff.give(kept, model, fresh)
    plain = torch.optim.AdamW([{k: v for k, v in g.items() if k != "lr"} for g in groups], lr=1e-3)
    handoff.give(kept, model, plain)
    for p in (q for g in groups for q in g["params"]):
        old, new, fp32 = inner.state[p], fresh.state[p], plain.state[p]
        assert float(new["step"]) == float(old["step"]) == 8.0
        for key in ("exp_avg", "exp_avg_sq"):
            if internals.is_quantized(old[key]):
                assert torch.equal(new[key].codes, old[key].codes) and torch.equal(new[key].scale, old[key].scale)
                assert torch.equal(fp32[key], old[key].dequantize())
            else:
                assert torch.equal(new[key], old[key]) and torch.equal(fp32[key], old[key])


def test_an_in_process_step_down_to_an_offload_tier_goes_on_with_fp32_moments(tmp_path, monkeypatch):
    """fast (8-bit) -> zero2_offload, whose host AdamW keeps fp32 moments: the state handed over, the run finished,
    each step's loss before the step-down as the unfaulted 8-bit run's."""
    from runner.oom.faults import ENV_VAR

    monkeypatch.setenv(ENV_VAR, "tier=fast")
    code, got = train_in_process(tiny_spec(tmp_path / "down", **EIGHT_BIT))
    assert code == 0 and got.plan.tier == "zero2_offload"
    assert isinstance(got.optimizer.optimizer, torch.optim.AdamW)
    losses = [r["loss"] for r in records(tmp_path / "down")]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5


def _params(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(128)),
            torch.nn.Parameter(torch.randn(32, 256))]  # fmt: skip


def _train(fail_at: int | None) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, int]:
    params = _params(0)
    opt = internals.adamw_8bit([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], 1e-2,
                               (0.9, 0.999))  # fmt: skip
    update = Update(opt, params, world_size=1, manual_sync=False, max_grad_norm=1.0)
    calls, real = {"n": 0}, type(opt).step

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (test: inside the 8-bit step)")
        return real(self, *args, **kwargs)

    opt.step = flaky.__get__(opt)  # this instance only
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        prepared = update.prepare([torch.tensor(1.0)], torch.device("cpu"))
        for _ in range(3):
            try:
                update.apply(prepared, 1e-2)
                break
            except torch.OutOfMemoryError:
                continue
        opt.zero_grad(set_to_none=True)
    return params, opt, calls["n"]


def test_an_oom_inside_the_8bit_step_steps_no_parameter_twice():
    """AdamW8bit steps parameter by parameter (one compiled kernel each, with its own fp32 working copies): an OOM
    at the second parameter is retried from it, and the weights and step counters are those of a run without it."""
    clean, _, n = _train(None)
    assert n == 9  # three steps of three parameters, one step call each
    faulted, opt, n = _train(5)  # step 2, its second parameter
    assert n == 10
    for x, y in zip(clean, faulted, strict=True):
        assert torch.equal(x, y)
    assert [float(s["step"]) for s in opt.state.values()] == [3.0, 3.0, 3.0]


def test_the_memory_model_counts_8bit_moments_and_the_steps_working_copies():
    shape = PRESETS["llama-1b"]
    kw = {"seq_len": 2048, "micro_batch": 1, "world_size": 1}
    fp32, eight = (memory.estimate(shape, tier="fast", optimizer=o, **kw) for o in ("adamw", "adamw_8bit"))
    t = fp32.trainable_params
    assert fp32.optimizer == 8 * t
    assert eight.optimizer == 65 * t // 32 + 16 * shape.vocab * shape.hidden
    assert fp32.gpu_bytes - eight.gpu_bytes >= fp32.optimizer - eight.optimizer > 2**31  # the 1B: 2.95 GiB less
    zero3 = memory.estimate(shape, tier="zero3", optimizer="adamw_8bit", **{**kw, "world_size": 4})
    assert zero3.optimizer == 65 * t // (32 * 4) + 16 * shape.vocab * shape.hidden // 4
    for tier in ("zero2_offload", "minimal"):  # fp32 moments on the host: nothing changes
        assert memory.estimate(shape, tier=tier, optimizer="adamw_8bit", **kw) == memory.estimate(shape, tier=tier,
                                                                                                 **kw)  # fmt: skip
    assert memory.optimizer_change(shape, "fast", 1, None, None, "adamw_8bit") == eight.optimizer - fp32.optimizer
    with pytest.raises(ConfigError, match="unknown optimizer"):
        memory.estimate(shape, tier="fast", optimizer="lion", **kw)


def test_the_plan_says_which_optimizer_and_the_spec_refuses_an_unknown_one(tmp_path, capsys):
    from jobspec.cli import main
    from tests.runner.train_helpers import tiny_spec_dict, write_spec

    spec = tiny_spec_dict(tmp_path / "run", training={"optimizer": "adamw_8bit"})
    path = write_spec(tmp_path / "spec.yaml", spec)
    assert main(["plan", str(path), "--gpu-memory", "24Gi"]) == 0
    assert "optimizer: adamw_8bit (training.optimizer)" in capsys.readouterr().out
    bad = write_spec(tmp_path / "bad.yaml", tiny_spec_dict(tmp_path / "run", training={"optimizer": "adam8"}))
    assert main(["validate", str(bad)]) == 2
    assert "training.optimizer" in capsys.readouterr().err
