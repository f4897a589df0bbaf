"""`training.block_kernels: liger`: Liger Kernel's RMSNorm, gated MLP and RoPE in the blocks
(runner/internals/kernels.py `apply_liger_blocks`), against transformers' own blocks.

Liger's kernels are Triton: on this CPU they run under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py),
with two gaps of the interpreter filled for the test (`interpreter`): a float argument reaches the kernel as a
Python float (compiled Triton passes an fp32 scalar, which Liger's kernels call `.to` on), and libdevice's functions
(Liger's RMSNorm takes `rsqrt` from it on CUDA) have no interpreted body. What a GPU adds (compilation, speed) is
the `gpu` test's and bench/gpu's to measure.

What must hold: every family Liger has kernels for gives the same loss and gradients as transformers' own blocks
(fp32, to rounding); only the model given changes (a model built after it runs transformers' own classes); a
family Liger lacks, a CPU without the interpreter, a CPU vendor in the spec are refused with the fix (exit 2); the
runner trains with them as without (full and LoRA, loss for loss); the trace counts what Liger's functions keep, and
the plan sizes the micro-batch from it.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from bench.families import CONFIGS, tiny
from jobspec.errors import ConfigError
from runner import internals
from runner.model.build import liger_blocks

pytest.importorskip("triton")
pytest.importorskip("liger_kernel")

LIGER_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "olmo2", "granite",
               "smollm3", "mixtral", "qwen3_moe", "deepseek_v3", "llama4", "qwen3_next", "gpt_oss")  # fmt: skip
NOT_LIGER = ("gpt2", "olmoe", "qwen2_moe", "glm4_moe")


@pytest.fixture(autouse=True)
def modeling_modules_as_they_were():
    """transformers' modeling modules as they were after each test: `apply_liger_blocks` (and the trace's build with
    Liger's blocks) leaves its RoPE in the family's module for the process, which runs Liger's wherever the
    interpreter is on, so every later test of that family in this process would too (bf16 under the interpreter gave
    NaN losses to test_quantize.py in CI, 2026-11-30). A module first imported during the test is put back through
    the function the RoPE wraps."""
    modules = {name: mod for name, mod in sys.modules.items() if name.startswith("transformers.models.")}
    before = {name: dict(vars(mod)) for name, mod in modules.items()}
    yield
    for name, mod in modules.items():
        for attr, value in before[name].items():
            if vars(mod).get(attr) is not value:
                setattr(mod, attr, value)
    for name, mod in list(sys.modules.items()):
        if name.startswith("transformers.models.") and mod is not None:
            for attr, value in list(vars(mod).items()):
                wrapped = getattr(value, "__wrapped_by_jobspec__", None)
                if wrapped is not None:
                    setattr(mod, attr, wrapped[1])


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter with its two gaps filled (see the module docstring)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1 (a GPU machine: the gpu test compiles the kernels)")
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    convert = ti._implicit_cvt

    def scalars_as_fp32(arg):
        if isinstance(arg, float):
            return tl.tensor(ti.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    monkeypatch.setattr(ti, "_implicit_cvt", scalars_as_fp32)
    import liger_kernel.ops.geglu
    import liger_kernel.ops.rms_norm  # noqa: F401

    interpreted = {"rsqrt": lambda x: tl.math.rsqrt(x), "tanh": lambda x: 2 * tl.sigmoid(2 * x) - 1}
    for name, mod in list(sys.modules.items()):
        if name.startswith("liger_kernel.ops."):
            for attr, value in list(vars(mod).items()):
                if "libdevice" in (getattr(value, "__module__", None) or "") and attr in interpreted:
                    monkeypatch.setattr(mod, attr, interpreted[attr])


def tiny_model(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from runner.model.build import ready_for_training, text_part

    name = next(n for n, c in CONFIGS.items() if c["model_type"] == model_type)
    cfg = dict(tiny(name, vocab=128))
    cfg.pop("architectures", None)
    config = text_part(AutoConfig.for_model(**cfg))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return ready_for_training(model).float()


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", LIGER_TYPES)
def test_each_familys_blocks_give_transformers_losses_and_gradients(interpreter, model_type):
    plain = tiny_model(model_type)
    liger = copy.deepcopy(plain)
    applied = liger_blocks(liger, "cpu")
    assert applied, model_type
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    (l0, g0), (l1, g1) = loss_and_grads(plain, ids), loss_and_grads(liger, ids)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g0.keys()
    for name, grad in g0.items():
        torch.testing.assert_close(g1[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    print(model_type, applied)


def test_only_the_model_given_changes(interpreter):
    """Liger's apply function swaps the family's classes in transformers' modeling module for every later model;
    `apply_liger_blocks` puts them back: a model built after it runs transformers' own forwards (on the CPU too), and
    the module's RoPE runs Liger's only where Triton runs."""
    from transformers.models.llama import modeling_llama

    classes = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
    liger_blocks(tiny_model("llama"), "cpu")
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == classes
    later = tiny_model("llama")
    assert all(type(m).forward is m.forward.__func__ for m in later.modules() if isinstance(m, classes))
    rope = modeling_llama.apply_rotary_pos_emb
    _, plain = rope.__wrapped_by_jobspec__
    calls = []
    monkey = {"liger": lambda *a, **k: calls.append("liger") or plain(*a, **k)}
    rope_of = internals.kernels._gpu_or_plain(monkey["liger"], lambda *a, **k: calls.append("plain") or plain(*a, **k))
    q = torch.randn(1, 2, 3, 4)
    cos, sin = torch.ones(1, 3, 4), torch.zeros(1, 3, 4)
    rope_of(q, q, cos, sin)
    assert calls == ["liger"]  # under the interpreter; a CPU tensor without it runs transformers' own
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        rope_of(q, q, cos, sin)
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    assert calls == ["liger", "plain"]


def test_a_model_built_again_gets_them_again_without_nesting_and_generates_as_transformers(interpreter):
    """An in-process step-down builds the model again: the module's RoPE wraps transformers' own once, not the
    previous wrapper; and sampling (GRPO's completions, with a KV cache) picks the same tokens greedily."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    plain = tiny_model("llama")
    plain.config.use_cache = True
    liger = copy.deepcopy(plain)
    liger_blocks(liger, "cpu")
    liger_blocks(tiny_model("llama"), "cpu")
    assert modeling_llama.apply_rotary_pos_emb.__wrapped_by_jobspec__[1] is original
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = liger.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_a_family_liger_lacks_and_a_cpu_without_the_interpreter_are_refused_with_the_fix(interpreter, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError, match=r"has no kernels for model_type 'gpt2': set training.block_kernels: plain"):
        internals.apply_liger_blocks(gpt2, "gpt2", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="runs Triton kernels on a GPU, and this rank trains on cpu"):
        internals.apply_liger_blocks(tiny_model("llama"), "llama", "cpu")


def test_a_cpu_vendor_is_refused_at_validate(tmp_path):
    import subprocess

    import yaml

    from tests.runner.train_helpers import ROOT, tiny_spec_dict

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec_dict(tmp_path / "run", training={"block_kernels": "liger"})))
    done = subprocess.run([sys.executable, "-m", "jobspec", "validate", str(spec)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "training.block_kernels" in done.stderr and "block_kernels: plain" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("lora", "tier"), [(False, "fast"), (True, "fast"), (False, "zero2")],
                         ids=["full", "lora", "full-zero2"])  # fmt: skip
def test_the_runner_trains_with_them_loss_for_loss(interpreter, tmp_path, lora, tier):
    """The runner's own step (`jobspec run`'s Recipe) on a Llama-shaped preset: the same losses with Liger's blocks as
    with transformers' (fp32, 1e-5), under FSDP2 too (one gloo rank: the norms' weights are DTensors)."""
    from tests.runner.train_helpers import records, tiny_spec, train_in_process

    losses = {}
    for kernels in ("plain", "liger"):
        adapters = {"lora": {"rank": 4, "targets": ["q_proj", "v_proj", "gate_proj"]}} if lora else {}
        sections = {"model": {"preset": "llama-tiny", **adapters},
                    "training": {"block_kernels": kernels, "steps": 2, "warmup_steps": 1, "global_batch": 2},
                    "data": {"max_seq_len": 24}, "hardware": {"vendor": "cuda", "gpus": 1},
                    "memory": {"tier": tier}}  # fmt: skip
        code, _ = train_in_process(tiny_spec(tmp_path / kernels, **sections))
        assert code == 0
        losses[kernels] = [r["loss"] for r in records(tmp_path / kernels)]
    assert len(losses["plain"]) == 2
    torch.testing.assert_close(losses["liger"], losses["plain"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("tier", ["fast", "zero2", "zero3"])
def test_the_trace_counts_what_ligers_functions_keep_and_the_formula_follows(tier):
    """The trace of the runner's step runs Liger's autograd functions on fakes (their launches skipped) and finds the
    activations they keep; the formula (LIGER_SAVED_BYTES) within 5 % of it with and without them."""
    import dataclasses

    from jobspec.catalog.presets import PRESETS
    from jobspec.plan import memory
    from runner.train.trace import trace_step

    shape = dataclasses.replace(PRESETS["llama-1b"], layers=2, hidden=512, intermediate=1024, heads=8, kv_heads=2,
                                vocab=1024)  # fmt: skip
    traced, formula = {}, {}
    for kernels in ("plain", "liger"):
        traced[kernels] = trace_step(shape, tier=tier, world_size=1, micro_batch=2, seq_len=512,
                                     block_kernels=kernels).peak  # fmt: skip
        e = memory.estimate(shape, tier=tier, seq_len=512, micro_batch=2, world_size=1, block_kernels=kernels)
        formula[kernels] = e.gpu_bytes - e.overhead
        assert abs(formula[kernels] / traced[kernels] - 1) < 0.05, (kernels, formula[kernels], traced[kernels])
    saved = traced["plain"] - traced["liger"]
    assert saved > 0.05 * traced["plain"]  # 14-17 % of these steps' peaks
    assert formula["plain"] - formula["liger"] == pytest.approx(saved, rel=0.35)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_a_gpu_the_compiled_kernels_train_as_transformers_blocks_do():
    """Compiled for the GPU: a Llama-shaped model in bf16 autocast with Liger's blocks against transformers' own,
    the loss and every gradient, and each one's step time and peak memory (printed; `pytest -m gpu -s` shows them)."""
    import time

    ids = torch.randint(0, 128, (8, 1024), generator=torch.Generator().manual_seed(7)).cuda()
    results, times, peaks = [], {}, {}
    for kernels in ("plain", "liger"):
        model = tiny_model("llama").cuda()
        if kernels == "liger":
            liger_blocks(model, "cuda")
        steps = []
        torch.cuda.reset_peak_memory_stats()
        for _ in range(6):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            tic = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - tic)
        times[kernels], peaks[kernels] = sorted(steps[1:])[2], torch.cuda.max_memory_allocated()
        results.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (plain, plain_grads), (liger, liger_grads) = results
    print(f"step: plain {times['plain'] * 1e3:.2f} ms, liger {times['liger'] * 1e3:.2f} ms (median of 5); peak "
          f"{peaks['plain'] / 2**20:.0f} / {peaks['liger'] / 2**20:.0f} MiB")  # fmt: skip
    torch.testing.assert_close(liger, plain, rtol=1e-3, atol=1e-2)
    for name, grad in plain_grads.items():
        scale = grad.abs().max().clamp_min(1e-12)
        assert (liger_grads[name] - grad).abs().max() <= 3e-2 * scale, name


def test_jobspec_run_refuses_a_family_liger_lacks_before_any_worker_starts(tmp_path):
    """`jobspec run` with `block_kernels: liger` on a GPT-2 preset: the supervisor's preflight refuses it (exit 2, the
    field and the fix, no traceback) before a worker builds anything."""
    import subprocess

    import yaml

    from tests.runner.train_helpers import ROOT, runner_env, tiny_spec_dict

    spec = tmp_path / "spec.yaml"
    sections = {"training": {"block_kernels": "liger"}, "hardware": {"vendor": "cuda", "gpus": 1}}
    spec.write_text(yaml.safe_dump(tiny_spec_dict(tmp_path / "run", **sections)))
    done = subprocess.run([sys.executable, "-m", "jobspec", "run", str(spec)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=runner_env())  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "training.block_kernels liger" in done.stderr and "has no kernels for model_type 'gpt2'" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "step-1").exists()
