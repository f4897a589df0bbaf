"""zero2_offload's optimizer offload (runner/train/offload.py), and what every tier holds against the memory model.

No GPU here. torchao's CPUOffloadOptimizer needs one only at a boundary, and `fake_cuda` fakes that and
nothing else: torchao's device check, CUDA streams and events (every copy runs in order on the CPU here, so
there is nothing to wait for) and pinned allocation (plain host memory; the requests are recorded, and
`Tensor.is_pinned` answers True for the tensors made by them and only for those). FSDP2
over gloo, torchao's hooks, host copies and fused CPU AdamW, accelerate, the Stepper and DCP are the real ones.

Bytes are counted on the tensors themselves (a DTensor by its local shard) around one optimizer step, by
role: the GPU's (parameters as FSDP2 shards them, the 16-bit parameters it gathers in forward and holds into
backward, gradients, and the optimizer state of tiers that keep it there) and the host's (HostAdamW's copies
of parameters and gradients, and Adam's state). On CPU the two are one memory; the roles are what the memory
model (jobspec/plan/memory.py `_states`) describes for a GPU.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from jobspec.catalog import tiers
from jobspec.errors import ConfigError
from jobspec.plan import memory
from jobspec.plan.planner import lora_shape, model_shape
from runner.checkpoint import store
from runner.dist import Control, DistEnv, destroy_process_group, init_process_group
from runner.model.build import build_model
from runner.sizing.plan import Plan
from runner.train import engine
from runner.train.offload import HostAdamW
from tests.runner.train_helpers import records, tiny_spec, train_and_resume

CPU, GPU = torch.device("cpu"), torch.device("cuda")  # GPU: what engine.prepare is told on CPU (as_on_a_gpu)
SEQ = 16
LORA = {"lora": {"rank": 8, "targets": ["c_attn"]}}


class _Event:
    def synchronize(self) -> None:
        pass


class _Stream:
    """A CUDA stream where there is none: the copies it would order run in order on the CPU already."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch) -> list[torch.Size]:
    """The CUDA boundary torchao's CPUOffloadOptimizer touches; returns the shapes it asked to pin."""
    import torchao.optim.cpu_offload as cpu_offload

    pinned: list[torch.Size] = []
    held: list[torch.Tensor] = []  # what was asked pinned, kept alive: no other tensor can reuse its storage
    empty_like = torch.empty_like

    def unpinned(t, *args, pin_memory=False, **kwargs):
        out = empty_like(t, *args, **kwargs)
        if pin_memory:
            pinned.append(t.shape)
            held.append(local(out))
        return out

    def is_pinned(self: torch.Tensor, *args) -> bool:
        ptr = self.untyped_storage().data_ptr()
        return any(h.untyped_storage().data_ptr() == ptr for h in held)

    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    monkeypatch.setattr(cpu_offload, "get_available_devices", lambda: ["cpu", "cuda"])
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch, "empty_like", unpinned)
    return pinned


@pytest.fixture
def as_on_a_gpu(fake_cuda, monkeypatch) -> list[torch.Size]:
    """engine.prepare picks the optimizer as it would on a GPU (the model itself stays on the CPU)."""
    choose = engine.offload_optimizer
    monkeypatch.setattr(engine, "offload_optimizer", lambda optimizer, device, tier: choose(optimizer, GPU, tier))
    return fake_cuda


@pytest.fixture
def group():
    """FSDP2 wants a process group even alone; accelerate's singletons are reset after each test."""
    from accelerate.state import AcceleratorState, GradientState

    init_process_group(DistEnv(), CPU, needed=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    destroy_process_group()


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # the next Accelerator may carry another FSDP plugin
    GradientState._reset_state()


def build(spec, tier: str):
    """(accelerator, model, optimizer) as runner/train/recipe.py builds them at `tier`, on the CPU."""
    precision = spec.training.precision
    model = build_model(spec, bos=257, eos=258, vocab=262, precision=precision)
    plan = Plan(tier, 2, 1, 2, 1, False, precision, 0, False, SEQ, 0, 0)
    return engine.prepare(plan, spec, CPU, model, engine.make_optimizer(model, spec, CPU, tier))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard


def tensor_bytes(t: torch.Tensor) -> int:
    return local(t).numel() * local(t).element_size()


def storage(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class Footprint:
    params: int  # the parameters as the optimizer sees them (FSDP2: this rank's shards)
    held: int  # parameters FSDP2 gathered in forward and still holds when backward starts
    grads: int
    optim: int  # the optimizer's state tensors (step counters, 0-dim, left out)
    host: int  # HostAdamW's host copies of the parameters and their gradients

    @property
    def gpu(self) -> int:  # everything but the optimizer's state: the GPU's part at every tier bar `fast`-like
        return self.params + self.held + self.grads


def footprint(accelerator, model: nn.Module, optimizer, max_norm: float | None = None) -> Footprint:
    """One step on one micro-batch; tensors counted when each is largest (held: between forward and backward)."""
    sharded = list(model.parameters())
    x = batch(0)
    loss = model(input_ids=x, labels=x).loss
    held = sum(tensor_bytes(p) for p in model.parameters() if not any(p is q for q in sharded))
    accelerator.backward(loss)
    if max_norm is not None:
        accelerator.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    inner = getattr(optimizer, "optimizer", optimizer)
    states = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    host = [t for h in getattr(inner, "host", {}).values() for t in (h, h.grad)]
    return Footprint(
        params=sum(map(tensor_bytes, sharded)),
        held=held,
        grads=sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        optim=sum(map(tensor_bytes, states)),
        host=sum(map(tensor_bytes, host)),
    )


def modelled(spec, tier: str) -> tuple[int, int, int, int, int]:
    """(GPU, host, trainable, weights held, gathered-module bound) from the memory model, one rank. GPU: what
    persists (weights, gradients, optimizer, buckets) plus, for the zero2 tiers, the 16-bit weights FSDP2 holds
    through backward; the transient gather buffer and 16-bit gradient of one module (zero3: its gathers) are the
    bound."""
    shape, lora = model_shape(spec), lora_shape(spec)
    s = memory._states(shape, tier, 1, lora)
    t = s.trainable
    w = shape.params + (t if lora else 0)
    persistent = s.weights + s.gradients + s.optimizer + s.buckets
    if tier == "fast":
        return persistent, s.host, t, w, s.working
    # the module gathered at the step's peak, with its gradients (memory._fsdp_peak, before any sample)
    bound = memory._fsdp_peak(shape, tier, 1, lora, acts=0, loss_hidden=0, chunk=0, recompute=0)[0]
    if tier in ("zero2", "zero2_offload"):  # the gather FSDP2 keeps; the transient buffer and gradient are the bound
        assert s.working == memory.HALF_BYTES * w
        return persistent + s.working, s.host, t, w, bound
    return persistent, s.host, t, w, bound


# --- which optimizer a tier steps with --------------------------------------------------------------------


def test_only_zero2_offload_on_a_gpu_steps_on_the_host(fake_cuda, tmp_path):
    spec = tiny_spec(tmp_path)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plain = engine.make_optimizer(model, spec, GPU, "zero2_offload")
    host = engine.offload_optimizer(plain, GPU, "zero2_offload")
    assert isinstance(host, HostAdamW) and host.param_groups is plain.param_groups
    # a pinned host copy of every parameter and of its gradient, none kept on the device (minimal_size=0)
    assert sorted(map(tuple, fake_cuda)) == sorted(tuple(p.shape) for p in model.parameters() for _ in "pg")
    assert set(host.host) == set(model.parameters()) and host.offload.d_opt is None
    assert all(h.device == CPU and h is not p for p, h in host.host.items())
    for device, tier in [(CPU, "zero2_offload"), (GPU, "fast"), (GPU, "zero2"), (GPU, "zero3"), (GPU, "minimal")]:
        assert engine.offload_optimizer(plain, device, tier) is plain, (device, tier)


def test_the_tier_names_the_package_when_torchao_is_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # `from torchao.optim import ...` raises ImportError
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"zero2_offload.*torchao.*pip install torchao"):
        engine.offload_optimizer(engine.make_optimizer(model, tiny_spec(tmp_path), GPU, "zero2_offload"),
                                 GPU, "zero2_offload")  # fmt: skip


# --- bytes per device against the memory model ------------------------------------------------------------


@pytest.mark.parametrize("lora", [{}, LORA], ids=["full", "lora"])
def test_zero2_offload_holds_params_and_grads_on_the_gpu_and_adam_on_the_host(group, as_on_a_gpu, tmp_path, lora):
    spec = tiny_spec(tmp_path, model=lora, training={"precision": "bf16"}, memory={"tier": "zero2_offload"})
    accelerator, model, optimizer = build(spec, "zero2_offload")
    assert isinstance(optimizer.optimizer, HostAdamW) and accelerator._optimizers == [optimizer]
    f = footprint(accelerator, model, optimizer, max_norm=1.0)
    gpu, host, t, w, _ = modelled(spec, "zero2_offload")
    # GPU: 16-bit weights held through backward (2w), FSDP2's shards (frozen 16-bit, trainable fp32), fp32 grads
    assert (f.held, f.params, f.grads) == (2 * w, 2 * (w - t) + 4 * t, 4 * t)
    assert f.gpu == gpu
    # host: fp32 copy of each trainable shard and of its gradient (8t), Adam's m and v (8t)
    assert (f.host, f.optim) == (8 * t, 8 * t)
    assert f.host + f.optim == host
    # Adam's state is its own memory, not the parameters' or gradients' (on a GPU: pinned host memory)
    inner = optimizer.optimizer
    on_gpu = {storage(x) for p in model.parameters() for x in (p, p.grad) if x is not None}
    on_host = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert on_host and not {storage(v) for v in on_host} & on_gpu


# What the engine holds at each tier on one rank in 16-bit training, w = t = P (all trainable), against the
# memory model's terms (jobspec/plan/memory.py `_states`): fp32 shards and fp32 gradients beside Adam's 8t/N,
# the 16-bit gather FSDP2 keeps from forward to backward at zero2, CPUOffloadPolicy's host share at minimal.
@pytest.mark.parametrize("tier", tiers.TIERS)
def test_every_tier_holds_what_the_memory_model_says(group, tmp_path, tier):
    spec = tiny_spec(tmp_path, training={"precision": "bf16"}, memory={"tier": tier})
    accelerator, model, optimizer = build(spec, tier)
    f = footprint(accelerator, model, optimizer)
    gpu, host, t, w, bound = modelled(spec, tier)
    assert w == t
    states = f.params + f.grads + f.optim  # what persists from step to step
    if tier == "fast":  # one rank: no DDP buckets
        assert (f.held, states, f.host) == (0, gpu, 0) and (gpu, host) == (16 * t, 0)
    elif tier == "zero2":
        assert (f.held, states) == (2 * w, 16 * t) and f.held + states == gpu
    elif tier == "zero2_offload":  # on CPU it trains as zero2 (nothing to offload to): Adam stays put
        assert not isinstance(optimizer.optimizer, HostAdamW)
        assert f.gpu == gpu and f.optim == 8 * t and host == 16 * t
    elif tier == "zero3":  # the root module (embeddings, tied head) is not resharded after forward
        assert states == gpu == 16 * t and 0 < f.held <= bound
    else:  # minimal, on CPU as zero3; on a GPU all of `states` is the host's
        assert states == host == 16 * t and gpu == 0 and 0 < f.held <= bound


# --- training, clipping and checkpoints through HostAdamW ----------------------------------------------------


def train_steps(accelerator, model, optimizer, steps: int, max_norm: float) -> None:
    """`steps` optimizer steps of two accumulated micro-batches each, clipped, as the Stepper does them."""
    for step in range(steps):
        for micro in range(2):
            x = batch(10 * step + micro)
            accelerator.backward(model(input_ids=x, labels=x).loss)
        accelerator.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.optimizer.zero_grad(set_to_none=True)


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().full_tensor().clone() for p in model.parameters()]


def test_host_adamw_steps_as_adamw_does_with_clipping_and_accumulation(group, as_on_a_gpu, tmp_path, monkeypatch):
    spec = tiny_spec(tmp_path, training={"precision": "bf16"})
    reference = build(spec, "zero2")
    train_steps(*reference, steps=3, max_norm=0.05)  # norms are ~5: clipping scales every step
    expected = weights(reference[1])
    reset_accelerate()
    offloaded = build(spec, "zero2_offload")
    assert isinstance(offloaded[2].optimizer, HostAdamW)
    train_steps(*offloaded, steps=3, max_norm=0.05)
    torch.testing.assert_close(weights(offloaded[1]), expected)  # fused CPU AdamW vs the for-loop one
    # torchao alone copies each gradient in backward, before clipping: it would step on unclipped ones
    reset_accelerate()
    monkeypatch.setattr(HostAdamW, "_copy_grads", lambda self: None)
    hooks_only = build(spec, "zero2_offload")
    train_steps(*hooks_only, steps=3, max_norm=0.05)
    assert not all(torch.allclose(a, b) for a, b in zip(weights(hooks_only[1]), expected, strict=True))


def test_a_probe_step_at_lr_0_changes_nothing_and_reset_forgets_the_moments(group, as_on_a_gpu, tmp_path):
    """What runner/sizing/plan.py's probe steps do through the Stepper (probe_step, reset_optimizer)."""
    _, model, optimizer = built = build(tiny_spec(tmp_path, training={"precision": "bf16"}), "zero2_offload")
    before = weights(model)
    for group_ in optimizer.param_groups:
        group_["lr"] = 0.0
    train_steps(*built, steps=1, max_norm=1.0)
    torch.testing.assert_close(weights(model), before, rtol=0, atol=0)
    inner = optimizer.optimizer
    assert len(inner.state) == len(before) and all(float(s["step"]) == 1.0 for s in inner.state.values())
    inner.state.clear()
    assert len(inner.state) == 0 and not inner.state_dict()["state"]
    for group_ in optimizer.param_groups:
        group_["lr"] = 1e-3
    train_steps(*built, steps=1, max_norm=1.0)
    assert all(float(s["step"]) == 1.0 for s in inner.state.values()) and len(inner.state) == len(before)
    assert not all(torch.equal(a, b) for a, b in zip(weights(model), before, strict=True))


def test_a_zero2_offload_checkpoint_loads_at_any_tier_and_back(group, as_on_a_gpu, tmp_path):
    spec = tiny_spec(tmp_path, training={"precision": "bf16"})
    ctrl = Control(1)
    source = build(spec, "zero2_offload")
    train_steps(*source, steps=2, max_norm=1.0)
    path = store.save(tmp_path / "ck", 2, source[1], source[2], {"plan": {}}, rank=0, ctrl=ctrl, keep=3)
    saved = source[2].optimizer.state_dict()
    for tier in ("zero2", "zero2_offload"):  # a plain AdamW (the ladder's fast/zero2 side), then HostAdamW
        reset_accelerate()
        _, model, optimizer = build(spec, tier)
        store.load(path, model, optimizer, rank=0, ctrl=ctrl)
        torch.testing.assert_close(weights(model), weights(source[1]), rtol=0, atol=0)
        loaded = optimizer.optimizer.state_dict()
        assert len(loaded["state"]) == len(saved["state"]) == len(list(model.parameters()))
        for i, s in saved["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded["state"][i][key].full_tensor(), s[key].full_tensor()), (tier, i, key)
            assert float(loaded["state"][i]["step"]) == 2.0
    # the host copies HostAdamW steps from are the loaded weights, not the fresh model's: one more step
    # from the checkpoint lands where the source's next step does
    train_steps(*source, steps=1, max_norm=1.0)
    reset_accelerate()
    resumed = build(spec, "zero2_offload")
    store.load(path, resumed[1], resumed[2], rank=0, ctrl=ctrl)
    train_steps(*resumed, steps=1, max_norm=1.0)
    torch.testing.assert_close(weights(resumed[1]), weights(source[1]), rtol=0, atol=0)


@pytest.mark.slow
def test_a_resumed_zero2_offload_run_matches_an_uninterrupted_one(as_on_a_gpu, tmp_path):
    """The Recipe's whole path (Stepper: LR per step, clipping; DCP checkpoints) with HostAdamW, as on a GPU."""
    sections = {"training": {"micro_batch": 2, "steps": 8}, "checkpoints": {"every_steps": 4},
                "memory": {"tier": "zero2_offload"}}  # fmt: skip
    full, part = train_and_resume(tmp_path, sections)
    assert isinstance(full.optimizer.optimizer, HostAdamW)
    a = {r["step"]: r["loss"] for r in records(tmp_path / "full")}
    b = {r["step"]: r["loss"] for r in records(tmp_path / "part")}
    assert sorted(b) == [5, 6, 7, 8] and all(b[s] == a[s] for s in b), (a, b)
    for (k, v), (_, w) in zip(full.model.state_dict().items(), part.model.state_dict().items(), strict=True):
        assert torch.equal(v.full_tensor(), w.full_tensor()), k


def assert_adam_state_pinned_on_the_host(model: nn.Module, inner: HostAdamW, device: torch.device) -> None:
    """Parameters (and gradients, where there are) on `device`; Adam's moments of every trainable parameter, and
    torchao's copies of parameters and gradients, in pinned host memory."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(local(p).device.type == device.type for p in model.parameters())
    assert all(local(p.grad).device.type == device.type for p in trainable if p.grad is not None)
    states = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert len(states) == 2 * len(trainable)  # exp_avg and exp_avg_sq
    assert all(local(v).device.type == "cpu" for v in states)
    assert all(local(v).is_pinned() for v in states), "Adam's moments are in pageable host memory"
    assert all(local(h).is_pinned() and local(h.grad).is_pinned() for h in inner.host.values())


def test_adam_state_of_zero2_offload_lies_in_pinned_host_memory(group, as_on_a_gpu, tmp_path):
    """torch's AdamW makes its moments with zeros_like of torchao's pinned host copy, which gives pageable memory
    (what the H100 found on 2026-11-25); a loaded state and one made again after a reset are pageable too."""
    _, model, optimizer = built = build(tiny_spec(tmp_path, training={"precision": "bf16"}), "zero2_offload")
    inner = optimizer.optimizer
    train_steps(*built, steps=1, max_norm=1.0)
    assert_adam_state_pinned_on_the_host(model, inner, CPU)
    # a resume: the loaded tensors (clones here: pageable) become the state, and the next step pins them
    saved = inner.state_dict()
    pageable = {i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()}
    inner.load_state_dict({"state": pageable, "param_groups": saved["param_groups"]})
    assert not all(local(v).is_pinned() for s in inner.state.values() for k, v in s.items() if k != "step")
    train_steps(*built, steps=1, max_norm=1.0)
    assert_adam_state_pinned_on_the_host(model, inner, CPU)
    # the probe steps' reset: new moments at the next step, pinned again
    inner.state.clear()
    train_steps(*built, steps=1, max_norm=1.0)
    assert all(float(s["step"]) == 1.0 for s in inner.state.values())
    assert_adam_state_pinned_on_the_host(model, inner, CPU)


# --- on a GPU (pytest -m gpu on the device machine) -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_a_gpu_parameters_stay_on_the_device_and_adam_state_goes_to_pinned_host_memory(tmp_path):
    spec = tiny_spec(tmp_path, training={"precision": "bf16"}, hardware={"vendor": "cuda"},
                     memory={"tier": "zero2_offload"})  # fmt: skip
    # An indexed device, as the runner's engine.pick_device makes it (torch.device("cuda", local_rank)): NCCL's
    # process group binds one device and torch refuses a `device_id` without an index (the H100's ValueError).
    gpu = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(gpu)
    init_process_group(DistEnv(), gpu, needed=True)
    try:
        model = build_model(spec, bos=257, eos=258, vocab=262, precision="bf16")
        plan = Plan("zero2_offload", 2, 1, 2, 1, False, "bf16", 0, False, SEQ, 0, 0)
        accelerator, model, optimizer = engine.prepare(
            plan, spec, gpu, model, engine.make_optimizer(model, spec, gpu, "zero2_offload")
        )
        inner = optimizer.optimizer
        assert isinstance(inner, HostAdamW)
        for step in range(2):  # the first step makes Adam's moments, the second steps with them
            x = batch(step).to(gpu)
            accelerator.backward(model(input_ids=x, labels=x).loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
            assert_adam_state_pinned_on_the_host(model, inner, gpu)  # real pinned memory here, no fakes
            optimizer.zero_grad(set_to_none=True)
        assert all(float(s["step"]) == 2.0 for s in inner.state.values())
    finally:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        destroy_process_group()
