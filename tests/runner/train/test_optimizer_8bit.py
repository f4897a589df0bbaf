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
from tests.runner.train_helpers import records, steps_with_an_oom, tiny_spec, train_and_resume, train_in_process

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
    """The tiny preset's shapes (its MLP's weights and a norm), so that the kernels the runs above compiled serve."""
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(128, 512)), torch.nn.Parameter(torch.randn(128)),
            torch.nn.Parameter(torch.randn(512, 128))]  # fmt: skip


def _train(fail_at: int | None) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, int]:
    from runner.train.engine import BETAS

    params = _params(0)
    groups = [{"params": params[:2], "weight_decay": 0.0}, {"params": params[2:], "weight_decay": 0.0}]
    opt = internals.adamw_8bit(groups, 1e-2, BETAS)
    update = Update(opt, params, world_size=1, manual_sync=False, max_grad_norm=1.0)

    def grads(step: int) -> None:
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)

    return params, opt, steps_with_an_oom(update, opt, 3, grads, fail_at)


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


def test_auto_takes_8bit_moments_at_a_tier_where_adamws_do_not_fit_before_offloading():
    """`training.optimizer: auto`: the planner keeps AdamW where it fits and takes 8-bit moments where only they fit,
    before stepping down to an offload tier (the plan's reasons say so); the runner builds what the plan chose."""
    from jobspec.spec.models import JobSpec
    from runner.sizing.hostmem import HostInfo
    from runner.sizing.plan import initial_plan
    from runner.sizing.probe import DeviceInfo
    from runner.train import engine

    def spec(optimizer: str) -> JobSpec:
        return JobSpec.model_validate({"name": "t", "model": {"preset": "llama-1b"}, "data": {"max_seq_len": 2048},
                                       "training": {"global_batch": 32, "optimizer": optimizer},
                                       "hardware": {"gpus": 1}, "memory": {"tier": "auto"}})  # fmt: skip

    shape, gib = PRESETS["llama-1b"], 1024**3
    need = {o: memory.estimate(shape, tier="fast", seq_len=2048, micro_batch=1, world_size=1, optimizer=o).gpu_bytes
            for o in ("adamw", "adamw_8bit")}  # fmt: skip
    total = int((need["adamw"] + need["adamw_8bit"]) / 2 / 0.9)  # between the two at 90 % utilization
    device = DeviceInfo("cuda", "fake", total, total, (9, 0), True, 1, "pynvml")
    host = HostInfo(total_bytes=1024 * gib, available_bytes=900 * gib, cpus=64)
    auto = initial_plan(spec("auto"), device, host, 1)
    assert (auto.tier, auto.optimizer) == ("fast", "adamw_8bit")
    assert any(r.startswith("optimizer auto -> adamw_8bit: AdamW's fp32 moments need") for r in auto.reasons)
    plain = initial_plan(spec("adamw"), device, host, 1)
    assert plain.tier != "fast" and plain.optimizer == "adamw"
    roomy = DeviceInfo("cuda", "fake", 4 * total, 4 * total, (9, 0), True, 1, "pynvml")
    assert initial_plan(spec("auto"), roomy, host, 1).optimizer == "adamw"

    model = torch.nn.Linear(128, 64)
    cpu = torch.device("cpu")
    assert internals.is_low_bit(engine.make_optimizer(model, spec("auto"), cpu, "fast", "adamw_8bit"))
    assert not internals.is_low_bit(engine.make_optimizer(model, spec("auto"), cpu, "fast", "adamw"))
    assert internals.is_low_bit(engine.make_optimizer(model, spec("adamw_8bit"), cpu, "zero3"))
    assert type(engine.make_optimizer(model, spec("adamw_8bit"), cpu, "zero2_offload")) is torch.optim.AdamW


def test_the_moments_take_the_bytes_the_model_counts():
    """On real tensors: 2 bytes of codes and 8/256 of scales a value for each quantized tensor, 8 bytes for the rest;
    the model's 65/32 a parameter is the first, within the few small tensors of a real model."""
    params = [torch.nn.Parameter(torch.randn(512, 1024)), torch.nn.Parameter(torch.randn(1024))]
    opt = internals.adamw_8bit([{"params": params}], 1e-3, (0.9, 0.999))
    held = 0
    for p in params:
        for key, value in internals.new_state(opt, p).items():
            if key != "step":
                parts = (value.codes, value.scale) if internals.is_quantized(value) else (value,)
                held += sum(t.numel() * t.element_size() for t in parts)
    assert held == 512 * 1024 * 65 // 32 + 1024 * 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_a_gpu_the_8bit_step_holds_no_more_than_the_working_copies_counted():
    """The compiled step of one 64M-value parameter: the bytes it allocates beyond the states, against the memory
    model's LOW_BIT_STEP_BYTES a value (an upper bound until this measures it); the figure is printed."""
    p = torch.nn.Parameter(torch.randn(8192, 8192, device="cuda"))
    opt = internals.adamw_8bit([{"params": [p]}], 1e-3, (0.9, 0.999))
    p.grad = torch.randn_like(p)
    opt.step()  # compiles, makes the states
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    print(f"adamw_8bit step: {extra / p.numel():.2f} bytes a value beyond the states "
          f"(model: {memory.LOW_BIT_STEP_BYTES})")  # fmt: skip
    assert extra <= memory.LOW_BIT_STEP_BYTES * p.numel()


def _supervised_and_resumed(tmp_path, hardware: dict, at: int, timeout: float, **sections) -> list[dict]:
    """The spec run whole by `python -m runner` (the supervisor's path) in tmp_path/full, and again in tmp_path/part
    from a copy of full's checkpoint step-`at` alone; both must exit 0. The two runs' losses by step."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tests.runner.train_helpers import runner_env, tiny_spec_dict, write_spec

    root = Path(__file__).resolve().parents[3]
    losses = []
    for name in ("full", "part"):
        spec = {**tiny_spec_dict(tmp_path / name, **sections), "hardware": hardware}
        if name == "part":
            (tmp_path / name).mkdir()
            shutil.copytree(tmp_path / "full" / f"step-{at}", tmp_path / name / f"step-{at}")
        path = write_spec(tmp_path / f"{name}.yaml", spec)
        result = subprocess.run([sys.executable, "-m", "runner", str(path)], cwd=root, env=runner_env(),
                                capture_output=True, text=True, timeout=timeout)  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        assert "torchao AdamW8bit" in result.stderr
        losses.append({r["step"]: r["loss"] for r in records(tmp_path / name)})
    return losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_an_8bit_run_on_a_gpu_resumes_as_it_ran(tmp_path):
    """The supervisor's path on a GPU at tier fast, bf16 autocast, 8-bit moments on the device: 4 steps, then the
    same from step 2's checkpoint, each step's loss the same."""
    from tests.runner.train_helpers import timeout_s

    full, part = _supervised_and_resumed(
        tmp_path, {"vendor": "cuda", "gpus": 1}, 2, timeout_s(),
        training={"micro_batch": 4, "steps": 4, "optimizer": "adamw_8bit", "precision": "auto"},
        checkpoints={"every_steps": 2}, memory={"tier": "fast"},
    )  # fmt: skip
    assert sorted(part) == [3, 4] and all(part[s] == full[s] for s in (3, 4)), (full, part)


@pytest.mark.sweep
@pytest.mark.parametrize("tier", ["fast", "zero3"])
def test_two_ranks_resume_an_8bit_run_as_it_ran(tmp_path, tier):
    """Two gloo ranks (DDP at fast, FSDP2 at zero3: each rank's 8-bit moments of its own shard), checkpointed at step
    4 and resumed there on two ranks: every later loss the same (measured 2026-11-29: equal at both tiers; resumed on
    one rank instead, the blocks differ and the losses agree to 1e-7)."""
    from tests.runner.train_helpers import timeout_s

    full, part = _supervised_and_resumed(
        tmp_path, {"vendor": "cpu", "gpus": 2}, 4, timeout_s(2 * 300),
        training={"micro_batch": 2, "steps": 8, "optimizer": "adamw_8bit"},
        checkpoints={"every_steps": 4}, memory={"tier": tier},
    )  # fmt: skip
    assert sorted(part) == [5, 6, 7, 8] and all(part[s] == full[s] for s in part)


def _tier_changes(run_dir) -> list[tuple[str, str]]:
    return [(r["from_tier"], r["to_tier"]) for r in records(run_dir, "event") if r.get("event") == "tier_change"]


def test_auto_retries_a_tier_with_8bit_moments_before_stepping_down(tmp_path, monkeypatch, caplog):
    """`training.optimizer: auto`: micro-batch 1 runs out at tier fast (step 3, once): the ladder's rung before the
    next tier is the same tier with 8-bit moments, in process, AdamW's state handed over; the run finishes there,
    its first steps as an AdamW run's, and tier_state.json keeps the choice for a restart."""
    import logging

    from runner.oom import ladder
    from runner.oom.faults import ENV_VAR

    sections = {"training": {"micro_batch": 1, "steps": 5, "optimizer": "auto"}, "checkpoints": {"every_steps": 5}}
    code, clean = train_in_process(tiny_spec(tmp_path / "clean", **sections))
    assert code == 0 and clean.plan.optimizer == "adamw" and not internals.is_low_bit(clean.optimizer.optimizer)
    monkeypatch.setenv(ENV_VAR, "step=3")
    with caplog.at_level(logging.INFO, logger="jobspec.runner"):
        code, got = train_in_process(tiny_spec(tmp_path / "rung", **sections))
    assert code == 0 and (got.plan.tier, got.plan.optimizer) == ("fast", "adamw_8bit")
    assert internals.is_low_bit(got.optimizer.optimizer)
    assert _tier_changes(tmp_path / "rung") == [("fast", "fast")]
    assert ladder.low_bit_tiers(tmp_path / "rung") == {"fast"}
    text = caplog.text
    assert "stepping down tier fast -> fast with 8-bit Adam moments" in text
    assert "optimizer auto -> adamw_8bit: AdamW's fp32 moments ran out at micro-batch 1 at tier fast" in text
    a = {r["step"]: r["loss"] for r in records(tmp_path / "clean")}
    b = {r["step"]: r["loss"] for r in records(tmp_path / "rung")}
    assert sorted(b) == [1, 2, 3, 4, 5] and all(b[s] == a[s] for s in (1, 2, 3))  # before the first 8-bit update
    assert b[5] == pytest.approx(a[5], rel=0.02)


def test_when_8bit_moments_run_out_too_the_ladder_goes_on_to_the_next_tier(tmp_path, monkeypatch):
    """Every step at tier fast runs out: fast (AdamW) -> fast (8-bit) -> zero2_offload, whose host AdamW keeps fp32
    moments; the run finishes there."""
    from runner.oom.faults import ENV_VAR

    monkeypatch.setenv(ENV_VAR, "tier=fast")
    sections = {"training": {"micro_batch": 4, "steps": 3, "optimizer": "auto"}, "checkpoints": {"every_steps": 3}}
    code, got = train_in_process(tiny_spec(tmp_path / "run", **sections))
    assert code == 0 and (got.plan.tier, got.plan.optimizer) == ("zero2_offload", "adamw")
    assert _tier_changes(tmp_path / "run") == [("fast", "fast"), ("fast", "zero2_offload")]


def test_a_restart_plans_the_tier_with_8bit_moments_and_the_supervisor_counts_the_rung(tmp_path):
    """The relaunch path: a worker that recorded the rung exits 75 with the tier unchanged; the supervisor launches
    the same tier again (one more launch per GPU tier under auto) and the new plan takes 8-bit moments there."""
    from jobspec.contract import EXIT_OK, EXIT_OOM_RETRY_TIER
    from jobspec.spec.models import JobSpec
    from runner.oom import ladder, relaunch
    from runner.sizing.hostmem import HostInfo
    from runner.sizing.plan import size_for_tier
    from runner.sizing.probe import DeviceInfo

    launched: list[str] = []

    def launch(tier: str) -> int:
        launched.append(tier)
        if ladder.low_bit_tiers(tmp_path):
            return EXIT_OK
        ladder.record_low_bit(tmp_path, tier, "out of memory at micro-batch 1")
        return EXIT_OOM_RETRY_TIER

    result = relaunch.supervise(launch, tmp_path, "fast", wait_s=0, low_bit=True)
    assert result.exit_code == EXIT_OK and launched == ["fast", "fast"]
    spec = JobSpec.model_validate({"name": "t", "model": {"preset": "gpt2-small"}, "data": {"max_seq_len": 1024},
                                   "training": {"global_batch": 8, "optimizer": "auto"},
                                   "hardware": {"gpus": 1}})  # fmt: skip
    gib = 1024**3
    device = DeviceInfo("cuda", "fake", 80 * gib, 80 * gib, (9, 0), True, 1, "pynvml")
    host = HostInfo(total_bytes=64 * gib, available_bytes=60 * gib, cpus=8)
    assert size_for_tier(spec, device, host, 1, "fast").optimizer == "adamw"  # it fits: AdamW
    again = size_for_tier(spec, device, host, 1, "fast", low_bit=ladder.low_bit_tiers(tmp_path))
    assert again.optimizer == "adamw_8bit" and any("ran out at micro-batch 1 at tier fast" in r for r in again.reasons)


def test_without_torchao_an_8bit_run_stops_before_any_work_with_the_fix(tmp_path, monkeypatch):
    """torchao not importable (the `runner` extra alone): exit 2 at the tier's build, naming the field and the
    install that carries it; nothing trained."""
    import sys

    from jobspec.contract import EXIT_CONFIG
    from runner.process import worker
    from tests.runner.train_helpers import tiny_spec_dict, write_spec

    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # `import torchao.optim` raises ImportError
    path = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", training={"optimizer": "adamw_8bit"}))
    status = tmp_path / "status.json"
    monkeypatch.setenv("JOBSPEC_STATUS_FILE", str(status))
    assert worker.main([str(path)]) == EXIT_CONFIG
    assert not records(tmp_path / "run")
    import json

    reason = json.loads(status.read_text()).get("reason", "")
    assert "training.optimizer adamw_8bit or auto needs torchao" in reason and "jobspec-k8s[offload]" in reason


def test_the_planners_probe_steps_leave_8bit_moments_and_weights_as_they_were(tmp_path, monkeypatch):
    """The GPU planning path on CPU (JOBSPEC_FAULT_OOM's `probes`): probe steps at lr 0 through AdamW8bit (its lr a
    0-d tensor, set in place and put back), their moments dropped; training then starts from the initial weights,
    its first loss the same as a run without probes."""
    from runner.oom.faults import ENV_VAR

    sections = {"training": {"global_batch": 16, "steps": 3, "optimizer": "adamw_8bit"}}
    code, _ = train_in_process(tiny_spec(tmp_path / "clean", **{**sections, "training": {
        **sections["training"], "micro_batch": 8}}))  # fmt: skip
    assert code == 0
    monkeypatch.setenv(ENV_VAR, "mbs>8,probes")
    code, probed = train_in_process(tiny_spec(tmp_path / "probed", **sections))
    assert code == 0 and probed.plan.micro_batch == 8 and probed.plan.probes >= 1
    assert torch.is_tensor(probed.optimizer.optimizer.param_groups[0]["lr"])
    a, b = records(tmp_path / "clean"), records(tmp_path / "probed")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
