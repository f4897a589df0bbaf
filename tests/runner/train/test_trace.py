"""The memory oracle (runner/train/trace.py): the FakeTensor trace equals the same step on real tensors."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.memory_model import MODELS
from jobspec.catalog.presets import PRESETS
from jobspec.errors import ConfigError
from jobspec.spec.models import LoraSpec
from runner.train.trace import fixed_bytes, largest_micro_batch, per_sample_bytes, runner_loss, trace_step
from tests.matrix import half_fraction

LORA = {"tiny": LoraSpec(rank=4, targets=["c_attn"]), "llama-tiny": LoraSpec(rank=4, targets=["q_proj", "v_proj"])}


def _trace(preset: str, tier: str, *, fake: bool, lora: bool, ckpt: bool, micro_batch: int = 2):
    # fused=None: the AdamW the runner builds on a CPU, so that fake and real run the same kernels
    return trace_step(PRESETS[preset], tier=tier, world_size=1, micro_batch=micro_batch, seq_len=64,
                      loss=runner_loss, fused=None, fake=fake, lora=LORA[preset] if lora else None,
                      checkpointing=ckpt)  # fmt: skip


@pytest.mark.parametrize(  # GPT-2 (tied head) and a Llama with GQA (2 kv heads); every pair of values by default
    ("preset", "tier", "lora", "ckpt"),
    half_fraction([["tiny", "llama-tiny"], ["fast", "zero2", "zero3"], [False, True], [False, True]],
                  ids=[None, None, lambda v: "lora" if v else "full", lambda v: "ckpt" if v else "no-ckpt"]),
)  # fmt: skip
def test_fake_trace_equals_real_tensors_to_the_byte(preset, tier, lora, ckpt):
    fake = _trace(preset, tier, fake=True, lora=lora, ckpt=ckpt)
    real = _trace(preset, tier, fake=False, lora=lora, ckpt=ckpt)
    assert fake.raw == real.raw
    assert fake.peak == real.peak > 0
    assert fake.trainable == real.trainable < (real.params if lora else real.trainable + 1)


def test_the_eager_mask_decision_matters():
    """Without the eager answer transformers builds a (b, 1, s, s) mask and repeats K/V on fakes: the peak grows. The
    runner's forwards and the trace give it (runner/internals/states.py `packed_search`, which also spares eager a
    host sync): off here."""
    import contextlib
    from unittest import mock

    from runner import internals

    real = _trace("llama-tiny", "fast", fake=False, lora=False, ckpt=False)
    with mock.patch.object(internals, "packed_search", lambda packed: contextlib.nullcontext()):
        traced = _trace("llama-tiny", "fast", fake=True, lora=False, ckpt=False)
    assert traced.peak > real.peak


def test_peak_is_affine_in_micro_batch_and_two_traces_give_the_line():
    """Affine once the peak lies in forward/backward (activations dominate): below that the optimizer step's
    constant peak wins, so peak = max(step peak, line); two traces in the activation regime give the line."""
    cfg = MODELS["llama-3.2-1b"] | {"num_hidden_layers": 2, "vocab_size": 32000}
    lora = LoraSpec(rank=8, targets=["q_proj", "v_proj"])
    runs = [trace_step(cfg, tier="fast", world_size=2, micro_batch=b, seq_len=512, loss=runner_loss, lora=lora)
            for b in (1, 2, 4)]  # fmt: skip
    slope, fixed = per_sample_bytes(runs[0], runs[2]), fixed_bytes(runs[0], runs[2])
    assert slope > 0 and fixed > 0
    assert runs[1].peak == pytest.approx(fixed + 2 * slope, rel=0.01)
    assert largest_micro_batch(runs[0], runs[2], runs[2].peak) == 4
    assert largest_micro_batch(runs[0], runs[2], int(fixed + slope) - 1) == 0
    with pytest.raises(ConfigError):
        per_sample_bytes(runs[0], runs[0])


def test_offload_tiers_and_ddp_move_bytes_by_arithmetic():
    cfg = MODELS["qwen2.5-0.5b"] | {"num_hidden_layers": 2}
    kw = dict(world_size=2, micro_batch=1, seq_len=128, loss=runner_loss)
    fast = trace_step(cfg, tier="fast", **kw)
    assert fast.ddp_buckets == 4 * fast.trainable and fast.peak == sum(fast.raw.values()) + fast.ddp_buckets
    zero2, offload = trace_step(cfg, tier="zero2", **kw), trace_step(cfg, tier="zero2_offload", **kw)
    assert offload.raw == zero2.raw
    assert offload.peak == zero2.peak - zero2.raw["OptState"] > 0
    assert offload.host == zero2.raw["OptState"] + 8 * zero2.trainable // 2
    minimal = trace_step(cfg, tier="minimal", **kw)
    assert 0 < minimal.peak < trace_step(cfg, tier="zero3", **kw).peak and minimal.host > 0


@pytest.mark.sweep  # 35-60 s on 2 cores; its figures: python -m bench.memory_model
def test_a_7b_trace_runs_on_fakes_within_the_host():
    """An 8B model at zero3 over 8 ranks (FSDP2's wrapping and tracker, the slower path) traces on a 2-core machine
    with 24 GiB: every byte it counts is a fake's. Its time is a figure of python -m bench.memory_model (every tier's
    time and resident memory), not a bound here: a timed test fails on a loaded machine for nothing."""
    cfg = MODELS["llama-3.1-8b"]
    r = trace_step(cfg, tier="zero3", world_size=8, micro_batch=1, seq_len=2048, loss=runner_loss)
    assert r.fake and r.params > 8e9 and r.peak * r.world_size > 64 * 2**30  # the gang's bytes: only fakes fit here
    assert r.parts["parameters"] > 0 and r.parts["optimizer"] > 0


# --- the formula (jobspec/plan/memory.py) held to the trace on generated configs --------------------------------

GRID = [  # (family, hidden, intermediate, layers, heads, kv heads, vocab, tied): shapes no preset has
    ("llama", 384, 1024, 3, 6, 2, 48_000, False),
    ("llama", 512, 1792, 2, 8, 8, 96_000, True),
    ("llama", 640, 1728, 3, 10, 5, 160_000, False),
    ("gpt2", 384, 1536, 3, 6, None, 40_000, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(  # each shape at two or three tiers, each tier on two shapes by default
    ("shape", "tier"),
    half_fraction([GRID, ["fast", "zero2", "zero2_offload", "zero3", "minimal"]],
                  ids=[lambda g: f"{g[0]}-h{g[1]}-v{g[6]}"]),
)  # fmt: skip
def test_the_formula_is_within_10_percent_of_the_trace(shape, tier):
    """The memory model's bytes without its fixed context and fragmentation allowance, against the traced step:
    generated shapes (GQA or not, tied or untied heads, vocabularies 40k-160k), every tier, 4 ranks, a micro-batch
    that accumulates (the runner's usual case)."""
    from jobspec.catalog.presets import ModelShape
    from jobspec.plan import memory

    fam, h, i, layers, heads, kv, vocab, tied = shape
    s = ModelShape(fam, layers=layers, hidden=h, heads=heads, kv_heads=kv, vocab=vocab, max_positions=1024,
                   intermediate=i, tie_embeddings=tied)  # fmt: skip
    traced = trace_step(s, tier=tier, world_size=4, micro_batch=4, seq_len=512, loss=runner_loss)
    e = memory.estimate(s, tier=tier, seq_len=512, micro_batch=4, world_size=4)
    model = e.gpu_bytes - e.overhead
    assert abs(model / traced.peak - 1) < 0.10, (e.breakdown(), traced.parts, traced.peak)
    assert e.host == pytest.approx(traced.host, rel=0.10, abs=1)  # what the offload tiers keep on the host


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "tier"), half_fraction([[GRID[0], GRID[3]], ["fast", "zero3"]],
                                                         ids=[lambda g: f"{g[0]}-h{g[1]}"]))
def test_the_formula_counts_the_packed_mask_as_the_trace_does(shape, tier):
    """`data.packing` under sdpa: the (b, 1, s, s) block-diagonal mask replaces SDPA's is_causal. The formula's packed
    step stays within 10% of the traced one, and what packing adds is the traced addition to within 25% (the mask,
    and a copy per layer without checkpointing)."""
    from jobspec.catalog.presets import ModelShape
    from jobspec.plan import memory

    fam, h, i, layers, heads, kv, vocab, tied = shape
    s = ModelShape(fam, layers=layers, hidden=h, heads=heads, kv_heads=kv, vocab=vocab, max_positions=2048,
                   intermediate=i, tie_embeddings=tied)  # fmt: skip
    traced = {p: trace_step(s, tier=tier, world_size=4, micro_batch=4, seq_len=1024, loss=runner_loss, packed=p)
              for p in (False, True)}  # fmt: skip
    est = {p: memory.estimate(s, tier=tier, seq_len=1024, micro_batch=4, world_size=4, packed=p) for p in (False, True)}
    assert abs((est[True].gpu_bytes - est[True].overhead) / traced[True].peak - 1) < 0.10
    added, traced_added = est[True].activations - est[False].activations, traced[True].peak - traced[False].peak
    assert traced_added > 0 and abs(added / traced_added - 1) < 0.25, (added, traced_added)


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "tier"), half_fraction([["llama", "qwen3"], ["fast", "zero2", "zero3"]]))
def test_the_formula_follows_a_head_dim_that_is_not_hidden_over_heads(tier, model_type):
    """A config that names its head_dim (queries 1024 wide on a 640-wide model, as Qwen3-4B and Gemma have them),
    with and without Qwen3's norms on queries and keys: the shape read from it counts the parameters transformers
    builds (Qwen3's two norms of head_dim weights a layer aside), and the formula stays within 10%."""
    from jobspec.catalog.model_config import shape_from_config
    from jobspec.plan import memory

    cfg = {"model_type": model_type, "hidden_size": 640, "intermediate_size": 1792, "num_hidden_layers": 3,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 40_000,
           "max_position_embeddings": 2048, "tie_word_embeddings": False}  # fmt: skip
    shape = shape_from_config(cfg)
    traced = trace_step(cfg, tier=tier, world_size=4, micro_batch=4, seq_len=1024, loss=runner_loss)
    assert shape.params + (2 * 128 * 3 if model_type == "qwen3" else 0) == traced.params
    e = memory.estimate(shape, tier=tier, seq_len=1024, micro_batch=4, world_size=4)
    assert abs((e.gpu_bytes - e.overhead) / traced.peak - 1) < 0.10, (e.breakdown(), traced.parts, traced.peak)


# --- what a GPU decides where the CPU would decide otherwise (trace.gpu_decisions) ------------------------------

GPT2_DROPOUT = {"model_type": "gpt2", "n_embd": 256, "n_inner": 1024, "n_layer": 2, "n_head": 4, "n_positions": 512,
                "vocab_size": 4096}  # fmt: skip  # no pdrop keys: transformers' GPT-2 default, 0.1 each


def test_gpu_autocast_runs_cudas_fp32_ops_in_fp32():
    """CUDA's autocast runs LayerNorm and GELU's `pow` in fp32 where the CPU's keeps bf16: a GPT-2 block at `fast`
    saves more (what an H100 measured: bench/gpu records); Llama-style blocks upcast explicitly and do not change.
    FSDP2 tiers run without autocast (accelerate's FSDP2 path) and do not change either."""
    gpt2 = {gpu: _trace_gpu("tiny", "fast", gpu) for gpu in (True, False)}
    assert gpt2[True].peak > gpt2[False].peak
    assert _trace_gpu("llama-tiny", "fast", True).peak == _trace_gpu("llama-tiny", "fast", False).peak
    assert _trace_gpu("tiny", "zero2", True).peak == _trace_gpu("tiny", "zero2", False).peak


def _trace_gpu(preset: str, tier: str, gpu: bool):
    return trace_step(PRESETS[preset], tier=tier, world_size=1, micro_batch=2, seq_len=128, loss=runner_loss, gpu=gpu)


def test_dropout_keeps_what_a_gpus_kernels_keep():
    """GPT-2's configs train with dropout. A GPU drops attention out inside the SDPA kernel and keeps 1-byte masks of
    the residual branches; on the CPU SDPA falls back to its math path, which keeps (b, h, s, s) tensors. The trace
    keeps the GPU's, and the formula counts the masks."""
    from jobspec.catalog.model_config import shape_from_config
    from jobspec.plan import memory

    none = GPT2_DROPOUT | {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    run = {name: trace_step(cfg, tier="zero2", world_size=4, micro_batch=4, seq_len=512, loss=runner_loss, gpu=gpu)
           for name, cfg, gpu in (("gpu", GPT2_DROPOUT, True), ("cpu", GPT2_DROPOUT, False), ("none", none, True))}
    masks = run["gpu"].peak - run["none"].peak
    assert 0 < masks < (run["cpu"].peak - run["none"].peak) / 4
    est = {name: memory.estimate(shape_from_config(cfg), tier="zero2", seq_len=512, micro_batch=4, world_size=4)
           for name, cfg in (("gpu", GPT2_DROPOUT), ("none", none))}  # fmt: skip
    assert est["gpu"].activations - est["none"].activations == pytest.approx(masks, rel=0.25)


CONFIGS = {  # config.json shapes no preset has, each with what sets its memory apart
    "phi3-fused": {"model_type": "phi3", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 3,
                   "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32064, "pad_token_id": 0,
                   "tie_word_embeddings": False},
    "gpt2-dropout": GPT2_DROPOUT | {"n_layer": 3, "vocab_size": 50257},
    "qwen2-mha-tied": {"model_type": "qwen2", "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 2,
                       "num_attention_heads": 6, "num_key_value_heads": 6, "vocab_size": 151936,
                       "tie_word_embeddings": True},
    "mistral-gqa": {"model_type": "mistral", "hidden_size": 640, "intermediate_size": 1792, "num_hidden_layers": 3,
                    "num_attention_heads": 10, "num_key_value_heads": 2, "vocab_size": 32768, "sliding_window": 256,
                    "tie_word_embeddings": False},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(  # each config at two or three tiers, each tier on two configs by default
    ("name", "tier_ranks"),
    half_fraction([list(CONFIGS), [("fast", 4), ("zero2", 4), ("zero3", 4), ("minimal", 4), ("minimal", 1)]],
                  ids=[None, lambda t: f"{t[0]}-{t[1]}"]),
)  # fmt: skip
def test_the_formula_is_within_10_percent_on_config_json_shapes(name, tier_ranks):
    """Shapes read from config.json as `jobspec plan` reads them: Phi-3's fused projections, GPT-2 with its dropout,
    a tied 152k vocabulary on two small blocks (the step peaks at the end of backward, at the embedding's
    reduce-scatter), grouped-query attention with a sliding window; `minimal` on one GPU too."""
    from jobspec.catalog.model_config import shape_from_config
    from jobspec.plan import memory

    tier, ranks = tier_ranks
    cfg = CONFIGS[name]
    traced = trace_step(cfg, tier=tier, world_size=ranks, micro_batch=2, seq_len=512, loss=runner_loss)
    e = memory.estimate(shape_from_config(cfg), tier=tier, seq_len=512, micro_batch=2, world_size=ranks)
    assert abs((e.gpu_bytes - e.overhead) / traced.peak - 1) < 0.10, (e.breakdown(), traced.raw, traced.peak)


def test_a_tied_tail_gathered_again_for_the_final_norms_backward_is_counted():
    """A tied embedding shares accelerate's tail unit with the final norm: FSDP2 reshards it after the output layer's
    backward and gathers it again for the norm's, and during that copy-out the all-gather buffer (2 bytes a parameter
    of the embedding) is alive beside the gathered weights, the head's 16-bit gradient and every saved activation.
    On 8 ranks with activation checkpointing and a loss chunk smaller than the embedding, that is the peak (Gemma's
    zero2_offload was 7 % under without it); the model without the moment is 4 % under here."""
    from jobspec.catalog.model_config import shape_from_config
    from jobspec.plan import memory

    cfg = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 12,
           "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 128000,
           "tie_word_embeddings": True}  # fmt: skip
    traced = trace_step(cfg, tier="zero2_offload", world_size=8, micro_batch=1, seq_len=256, loss=runner_loss)
    assert traced.raw["All Gather"] == 2 * (128000 + 1) * 1024  # at the peak: the tail's (embedding, norm) buffer
    e = memory.estimate(shape_from_config(cfg), tier="zero2_offload", seq_len=256, micro_batch=1, world_size=8)
    assert (e.gpu_bytes - e.overhead) / traced.peak == pytest.approx(1.0, abs=0.01), (e.breakdown(), traced.raw)


LORA_CONFIGS = {  # (config.json, LoRA targets)
    "llama-gqa": ({"model_type": "llama", "hidden_size": 640, "intermediate_size": 1792, "num_hidden_layers": 4,
                   "num_attention_heads": 10, "num_key_value_heads": 2, "vocab_size": 32000,
                   "tie_word_embeddings": True}, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "gpt2": ({"model_type": "gpt2", "n_embd": 512, "n_inner": 2048, "n_layer": 4, "n_head": 8, "vocab_size": 32000,
              "n_positions": 1024, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, ["c_attn", "c_fc"]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "tier"),
    [("llama-gqa", "fast"), ("gpt2", "zero2_offload"), ("gpt2", "zero3"),
     # the sweep tier (pytest -m sweep): the rest of the matrix (5-15 s each on 2 cores)
     *(pytest.param(name, tier, marks=pytest.mark.sweep)
       for name, tier in [("llama-gqa", "zero2"), ("llama-gqa", "zero2_offload"), ("llama-gqa", "zero3"),
                          ("gpt2", "fast"), ("gpt2", "zero2")])],
)  # fmt: skip
def test_the_formula_is_within_10_percent_with_lora(name, tier):
    """LoRA with and without activation checkpointing: with it, what the step keeps after the last block and in the
    recomputed layer dominates the per-sample bytes (the formula had them 57 % under on the slope before)."""
    from jobspec.catalog.model_config import shape_from_config
    from jobspec.plan import memory

    cfg, targets = LORA_CONFIGS[name]
    lora = LoraSpec(rank=8, targets=targets)
    shape, lora_shape = shape_from_config(cfg), memory.LoraShape(8, tuple(targets))
    peaks, model = {}, {}
    for mbs in (2, 4):
        peaks[mbs] = trace_step(cfg, tier=tier, world_size=4, micro_batch=mbs, seq_len=1024, loss=runner_loss,
                                lora=lora).peak  # fmt: skip
        e = memory.estimate(shape, tier=tier, seq_len=1024, micro_batch=mbs, world_size=4, lora=lora_shape)
        model[mbs] = e.gpu_bytes - e.overhead
    assert abs(model[4] / peaks[4] - 1) < 0.10, (model, peaks)
    assert abs((model[4] - model[2]) / (peaks[4] - peaks[2]) - 1) < 0.15, (model, peaks)  # the per-sample slope


def _saved_bytes(q, k, v) -> int:
    """Bytes autograd keeps for backward of one causal SDPA call (inputs it already holds included)."""
    import torch

    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return sum(saved)


def test_narrow_values_are_traced_as_a_fused_kernel_keeps_them():
    """DeepSeek-V2's latent attention: q/k 192 wide a head, v 128. The CPU's flash kernel refuses them and SDPA's math
    path would keep (b, h, s, s) probabilities; the trace (gpu_decisions) runs them as CUDA's memory-efficient kernel
    does: no (s, s) tensor among what backward keeps, the output as wide as v."""
    import torch

    from runner.train.trace import gpu_decisions

    b, h, s = 1, 4, 2048  # long enough that one (s, s) matrix outweighs q, k, v and the output
    q, k = (torch.randn(b, h, s, 192, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(b, h, s, 128, dtype=torch.bfloat16, requires_grad=True)
    scores = b * h * s * s * 2
    assert _saved_bytes(q, k, v) >= scores  # what the plain CPU run keeps
    with gpu_decisions():
        assert _saved_bytes(q, k, v) < scores / 2
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert out.shape == (b, h, s, 128) and torch.allclose(out.float(), ref, atol=3e-2)


@pytest.mark.gpu
def test_on_a_gpu_narrow_values_keep_no_score_matrix():
    """The assumption the trace makes above, checked where a GPU is lent: CUDA's SDPA takes q/k 192 and v 128 in a
    fused kernel (memory-efficient or cuDNN), keeping no (b, h, s, s) tensor for backward."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or ROCm GPU")
    b, h, s = 1, 16, 2048
    q, k = (torch.randn(b, h, s, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert _saved_bytes(q, k, v) < b * h * s * s * 2 / 2


def test_an_inline_config_json_is_traced_as_its_own_family():
    """`model.architecture` written as a hub model's config.json (examples/families/): the trace builds that family's
    blocks, every expert included, not a dense Llama of the same width."""
    from jobspec.plan.planner import model_shape
    from jobspec.spec.loader import load_spec
    from runner.train.trace import spec_model

    spec = load_spec(Path(__file__).parents[3] / "examples" / "families" / "olmoe-1b-7b.yaml")
    model = spec_model(spec)
    assert isinstance(model, dict) and model["model_type"] == "olmoe" and model["num_experts"] == 64
    assert model_shape(spec).experts == 64
