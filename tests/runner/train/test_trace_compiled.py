"""`training.compile` in the plan: the trace takes off what compiled blocks keep less for backward
(runner/train/trace_compiled.py), measured as inductor's compiled blocks keep it, and the formula counts the same
(jobspec/plan/activations.py COMPILE_SAVED_BYTES)."""

from __future__ import annotations

import pytest
import torch

from bench.families import tiny
from jobspec.catalog.model_config import shape_from_config
from jobspec.catalog.presets import PRESETS
from jobspec.plan import memory
from jobspec.spec.models import LoraSpec
from runner.train.trace import trace_step

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def kept(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the storages autograd keeps across a bf16-autocast forward (real tensors), the parameters' aside."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    logits.float().sum().backward()
    return sum(storages.values())


def cut(model, **kw) -> tuple[int, tuple[str, ...]]:
    eager = trace_step(model, world_size=1, micro_batch=4, seq_len=256, **kw)
    compiled = trace_step(model, world_size=1, micro_batch=4, seq_len=256, compile_scope="blocks", **kw)
    return eager.peak - compiled.peak, compiled.notes


@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
def test_the_trace_takes_off_what_inductor_compiled_blocks_keep_less_to_the_byte(preset) -> None:
    """`fast` with the CPU's autocast decisions (`gpu=False`), so that the real step on this CPU is the one traced."""
    from transformers import AutoModelForCausalLM

    from runner.model.build import preset_config, ready_for_training
    from runner.train.engine import compile_model

    traced, notes = cut(PRESETS[preset], tier="fast", gpu=False)
    torch.manual_seed(0)
    model = ready_for_training(AutoModelForCausalLM.from_config(preset_config(PRESETS[preset], 0, 1),
                                                                attn_implementation="sdpa"))  # fmt: skip
    ids = torch.randint(0, 500, (4, 256), generator=torch.Generator().manual_seed(1))
    eager = kept(model, ids)
    try:
        compile_model(model, "blocks")
        kept(model, ids)  # compiles
        compiled = kept(model, ids)
    finally:
        torch.compiler.reset()
    assert traced == eager - compiled > 0, (traced, eager, compiled)
    assert "of eager's bytes for backward" in notes[0]


@pytest.mark.parametrize("tier", ["fast", "zero2"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_formula_counts_what_the_trace_measures(tier, lora) -> None:
    spec = LoraSpec(rank=8, targets=list(LLAMA_TARGETS)) if lora else None
    shape_lora = memory.LoraShape(8, LLAMA_TARGETS) if lora else None
    traced, _ = cut(PRESETS["llama-tiny"], tier=tier, lora=spec)
    kw = {"tier": tier, "seq_len": 256, "micro_batch": 4, "world_size": 1, "lora": shape_lora}
    eager = memory.estimate(PRESETS["llama-tiny"], **kw)
    compiled = memory.estimate(PRESETS["llama-tiny"], **kw, compile_scope="blocks")
    assert eager.activations - compiled.activations == traced > 0


@pytest.mark.parametrize("name", ["mistral-7b", "phi-3-mini", "gpt2-124m", "qwen3-8b", "gemma-3-1b"])
def test_the_formula_never_counts_more_saved_than_the_trace_finds_in_a_family(name) -> None:
    """Equal where the family's blocks are the ones fitted (Mistral, Phi-3, GPT-2); less where they hold norms the
    formula does not count (Qwen 3's on q and k, Gemma 3's four a layer): the plan stays on the safe side."""
    config = tiny(name)
    traced, _ = cut(config, tier="fast")
    shape = shape_from_config(config)
    kw = {"tier": "fast", "seq_len": 256, "micro_batch": 4, "world_size": 1}
    eager, compiled = (memory.estimate(shape, **kw, compile_scope=scope).activations for scope in ("off", "blocks"))
    counted = eager - compiled
    assert 0 < counted <= traced
    if name in ("mistral-7b", "phi-3-mini", "gpt2-124m"):
        assert counted == traced


def test_checkpointed_tiers_and_blocks_that_cannot_be_measured_keep_the_eager_figure() -> None:
    assert cut(PRESETS["llama-tiny"], tier="zero3") == (0, ())  # each block keeps its input only
    lora = LoraSpec(rank=8, targets=["q_proj", "v_proj"])  # a 4-bit base: its blocks have no twin made of fakes
    saved, notes = cut(PRESETS["llama-tiny"], tier="fast", lora=lora, quantize="nf4")
    assert saved == 0 and "did not compile here" in notes[0] and "counted as eager" in notes[0]


def test_a_hybrid_model_counts_the_block_kind_that_saves_less() -> None:
    """Qwen3-Next: linear-attention layers first, full attention last. Both kinds are measured and the one that saves
    less (or keeps more: torch 2.11's compiled linear attention keeps 6.6 times eager's bytes) counts for every
    layer."""
    from runner import internals
    from runner.train import trace, trace_compiled

    config = tiny("qwen3-next-80b-a3b")
    eager = trace_step(config, tier="fast", world_size=1, micro_batch=4, seq_len=256)
    saved, notes = cut(config, tier="fast")
    net = trace._build(trace.hf_config(config), lora=None, precision="bf16", attention="sdpa", meta=True)
    with trace.gpu_decisions(), internals.packed_search(False):
        kinds, blocks = trace_compiled._measure(net, 4, 256, None, torch.bfloat16, internals.fake_mode())
    assert len(kinds) == 2 and kinds[0] != kinds[1] and blocks == net.config.num_hidden_layers
    worst = trace_compiled.BlockSaving(*min(kinds, key=lambda k: k[0] - k[1]), blocks)
    # two compiles of the same blocks once differed by 32 KB of 146 MB (CI, torch 2.11; not reproduced in two runs
    # here): a tolerance, not equality
    assert saved == pytest.approx(trace_compiled.apply(worst, eager.parts["activations"]), rel=1e-3) and saved != 0
    assert "of eager's bytes for backward" in notes[0]


def test_a_trace_leaves_later_compiles_in_the_process_whole() -> None:
    """The fake process group's start clears dynamo's tables of torch's functions, and the trace then wraps some of
    them (gpu_decisions): tables rebuilt under the wrappers broke every later compile's graph at torch.rsqrt."""
    cut(PRESETS["llama-tiny"], tier="zero2")
    try:
        out = torch.compile(lambda x: torch.rsqrt(x) * 2, backend="eager", fullgraph=True)(torch.ones(2))
    finally:
        torch.compiler.reset()
    assert out.tolist() == [2.0, 2.0]


def test_the_plan_of_a_compiled_spec_fits_a_larger_micro_batch_where_blocks_keep_their_activations() -> None:
    from jobspec.plan.planner import estimate_kwargs
    from jobspec.spec.loader import parse_spec

    text = ("name: c\nmodel: {preset: llama-1b}\ndata: {max_seq_len: 2048}\n"
            "training: {global_batch: 64, steps: 1, compile: %s}\n")  # fmt: skip
    plans = {}
    for scope in ("off", "blocks"):
        kw = estimate_kwargs(parse_spec(text % scope), 1, "bf16")
        assert kw["compile_scope"] == scope
        plans[scope] = memory.plan_all(PRESETS["llama-1b"], gpu_bytes=80 * 1024**3, global_batch=64, **kw)
    fast = {scope: next(p for p in plans[scope] if p.tier == "fast") for scope in plans}
    zero3 = {scope: next(p for p in plans[scope] if p.tier == "zero3") for scope in plans}
    assert fast["blocks"].micro_batch > fast["off"].micro_batch
    assert zero3["blocks"].micro_batch == zero3["off"].micro_batch  # checkpointed: the eager figure
