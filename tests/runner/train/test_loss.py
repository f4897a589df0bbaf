"""The chunked cross-entropy (runner/train/loss.py): equal to the full-logits loss and its gradients, on real tiny
models (GPT-2 tied, Llama tied and untied, LoRA, activation checkpointing, bf16 autocast, FSDP2), invisible outside
its context (keys, tie, logits, save_pretrained), refused where it cannot apply, and never whole in memory."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jobspec.catalog.presets import PRESETS
from runner.data.dataset import IGNORE
from runner.model.build import preset_config
from runner.train.loss import ChunkedLossHead, install_chunked_loss, linear_cross_entropy
from tests.runner.train_helpers import tiny_spec

FP32 = {"rtol": 1e-5, "atol": 1e-5}


def labels_for(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Next-token labels as the data pipeline makes them: shifted, IGNORE on the prompt and the padding."""
    y = torch.roll(ids, -1, dims=1) % vocab
    y[:, :3] = IGNORE
    y[:, -1] = IGNORE
    y[0, 5:8] = IGNORE
    return y


def full_logits_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The old path: the whole (B, T, V) logits upcast to fp32."""
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def chunked_loss(head: ChunkedLossHead, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with head.targets(labels):
        return model(input_ids=ids).logits.float().sum()


def loss_and_grads(loss_fn, model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return loss.detach(), grads


def tiny_model(preset: str, *, tied: bool = True, seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    shape = dataclasses.replace(PRESETS[preset], tie_embeddings=tied)
    model = AutoModelForCausalLM.from_config(preset_config(shape, 1, 2), attn_implementation="sdpa")
    model.config.use_cache = False
    return model.train()


# --- the autograd Function against autograd ---------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])  # 7 does not divide the 6 * 9 = 54 tokens; 1000 is one chunk
def test_the_chunked_loss_and_its_gradients_equal_autograds(bias, chunk):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(6, 9, 16, generator=g, requires_grad=True)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    b = torch.randn(300, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, 300, (6, 9), generator=g)
    labels[labels % 4 == 0] = IGNORE
    inputs = [t for t in (hidden, weight, b) if t is not None]

    ref = F.cross_entropy(F.linear(hidden, weight, b).float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                          reduction="sum")  # fmt: skip
    ref_grads = torch.autograd.grad(ref, inputs)
    per_token = linear_cross_entropy(hidden, weight, b, labels, chunk=chunk)
    assert per_token.shape == labels.shape and per_token.dtype == torch.float32
    assert torch.all(per_token[labels == IGNORE] == 0) and torch.all(per_token[labels != IGNORE] > 0)
    loss = per_token.sum()
    grads = torch.autograd.grad(loss, inputs)
    torch.testing.assert_close(loss, ref, **FP32)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **FP32)


def test_a_weighted_sum_and_all_ignored_rows():
    """The incoming gradient is per token (not only 1s), and rows without a target give no loss and no gradient."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (10,), generator=g)
    labels[:4] = IGNORE
    w = torch.rand(10, generator=g)
    ref = (F.cross_entropy(F.linear(hidden, weight), labels, ignore_index=IGNORE, reduction="none") * w).sum()
    got = (linear_cross_entropy(hidden, weight, None, labels, chunk=3) * w).sum()
    grads = torch.autograd.grad(got, (hidden, weight))
    for a, b in zip(grads, torch.autograd.grad(ref, (hidden, weight)), strict=True):
        torch.testing.assert_close(a, b, **FP32)
    assert torch.all(grads[0][:4] == 0)
    none = linear_cross_entropy(hidden, weight, None, torch.full((10,), IGNORE), chunk=4)
    assert torch.equal(none, torch.zeros(10))


def test_bf16_weights_give_bf16_gradients_close_to_autograds():
    """Pure 16-bit weights (no autocast): gradients come back in bf16, as autograd gives them."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(500, 32, generator=g) * 0.2).bfloat16().requires_grad_()
    labels = torch.randint(0, 500, (64,), generator=g)
    ref = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
    got = linear_cross_entropy(hidden, weight, None, labels, chunk=10).sum()
    ref_grads, grads = torch.autograd.grad(ref, (hidden, weight)), torch.autograd.grad(got, (hidden, weight))
    assert [t.dtype for t in grads] == [torch.bfloat16, torch.bfloat16]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3)  # both softmax in fp32 over the same bf16 logits
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=0, atol=0)  # one chunk's rows each: the same products
    # the weight's, summed over 7 chunks in bf16 (one rounding each): measured within 0.9 % of the largest, 5 seeds
    assert (grads[1].float() - ref_grads[1].float()).abs().max() <= 2e-2 * ref_grads[1].float().abs().max()


# --- on whole models ----------------------------------------------------------------------------------------------

MODELS = [("tiny", True), ("llama-tiny", True), ("llama-tiny", False)]  # GPT-2 tied; Llama tied and untied


@pytest.mark.parametrize(("preset", "tied"), MODELS)
@pytest.mark.parametrize("variant", ["plain", "lora", "checkpointing", "lora+checkpointing"])
def test_through_the_model_loss_and_every_gradient_equal_the_full_logits_path(preset, tied, variant):
    model = tiny_model(preset, tied=tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    if "lora" in variant:
        from peft import LoraConfig, get_peft_model

        targets = ["c_attn"] if preset == "tiny" else ["q_proj", "v_proj"]
        config = LoraConfig(r=4, target_modules=targets, fan_in_fan_out=preset == "tiny", init_lora_weights=False)
        model = get_peft_model(model, config)  # init_lora_weights=False: B != 0, every adapter gets a gradient
    if "checkpointing" in variant:  # as the engine switches it on (transformers 4.x and 5)
        from runner.train.engine import enable_checkpointing

        enable_checkpointing(model, lora="lora" in variant)
    ids = torch.randint(3, 512, (3, 40), generator=torch.Generator().manual_seed(0))
    labels = labels_for(ids, 512)
    old_loss, old = loss_and_grads(lambda: full_logits_loss(model, ids, labels), model)

    head = install_chunked_loss(model, chunk=11)  # 120 tokens: 11 chunks, the last of 10
    assert head is not None
    new_loss, new = loss_and_grads(lambda: chunked_loss(head, model, ids, labels), model)
    torch.testing.assert_close(new_loss, old_loss, **FP32)
    assert new.keys() == old.keys()
    if "lora" in variant:
        assert all("lora_" in n for n in new) and len(new) == 2 * 2 * len(targets)  # (A, B) x 2 layers x targets
    for name in old:
        torch.testing.assert_close(new[name], old[name], **FP32, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("preset", "tied"), MODELS)
def test_bf16_autocast_on_cpu_is_close_to_the_full_logits_path(preset, tied):
    """Measured (GPT-2 / Llama, 120 tokens, vocab 512): loss within 2e-4 relative; gradients within 3e-2 of the
    largest (the old path rounds the logits to bf16 before its fp32 softmax, the chunked one does not)."""
    model = tiny_model(preset, tied=tied)
    ids = torch.randint(3, 512, (3, 40), generator=torch.Generator().manual_seed(1))
    labels = labels_for(ids, 512)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        old_loss, old = loss_and_grads(lambda: full_logits_loss(model, ids, labels), model)
        head = install_chunked_loss(model, chunk=16)
        assert head is not None
        new_loss, new = loss_and_grads(lambda: chunked_loss(head, model, ids, labels), model)
    torch.testing.assert_close(new_loss, old_loss, rtol=1e-3, atol=0.0)
    for name in old:
        assert new[name].dtype == old[name].dtype == torch.float32
        scale = old[name].abs().max().item()
        assert (new[name] - old[name]).abs().max().item() <= 5e-2 * scale, name


def test_under_torch_compile_the_head_runs_eagerly_with_the_same_gradients():
    """`training.compile` compiles the model in place before the Stepper installs the head: dynamo breaks the graph
    at the chunked loss (torch.compiler.disable) and traces the rest. aot_eager: dynamo and AOTAutograd, no C++."""
    ref, model = tiny_model("tiny"), tiny_model("tiny")
    ids = torch.randint(3, 512, (3, 40), generator=torch.Generator().manual_seed(3))
    labels = labels_for(ids, 512)
    old_loss, old = loss_and_grads(lambda: full_logits_loss(ref, ids, labels), ref)
    model.compile(backend="aot_eager")
    try:
        head = install_chunked_loss(model, chunk=11)
        assert head is not None
        for _ in range(2):  # the second call runs the compiled graphs
            new_loss, new = loss_and_grads(lambda: chunked_loss(head, model, ids, labels), model)
            torch.testing.assert_close(new_loss, old_loss, **FP32)
            for name in old:
                torch.testing.assert_close(new[name], old[name], **FP32, msg=lambda m, n=name: f"{n}: {m}")
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    finally:
        torch.compiler.reset()


# --- invisible outside its context --------------------------------------------------------------------------------


@pytest.mark.parametrize(("preset", "tied"), MODELS)
def test_outside_its_context_the_model_is_the_plain_model(preset, tied, tmp_path):
    plain = tiny_model(preset, tied=tied)
    model = tiny_model(preset, tied=tied)
    keys = list(model.state_dict())
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    head = install_chunked_loss(model)
    assert head is not None and head.linear is model.get_output_embeddings()
    assert list(model.state_dict()) == keys and type(model.get_output_embeddings()) is nn.Linear
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
        with head.targets(labels_for(ids, 512)):
            assert model(input_ids=ids).logits.shape == (2, 12, 1)
        assert model(input_ids=ids).logits.shape == (2, 12, 512)  # the context is closed again

    model.save_pretrained(tmp_path / "head")
    plain.save_pretrained(tmp_path / "plain")
    from safetensors import safe_open

    def saved(d):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)

    a, b = saved(tmp_path / "head"), saved(tmp_path / "plain")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "head" / "config.json").read_text()) == json.loads(
        (tmp_path / "plain" / "config.json").read_text()
    )
    head.remove()
    assert "forward" not in vars(model.get_output_embeddings())


# --- where it cannot apply ----------------------------------------------------------------------------------------


def test_a_lora_wrapped_output_layer_keeps_the_full_logits(caplog):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama-tiny", tied=False), LoraConfig(r=2, target_modules=["lm_head"]))
    with caplog.at_level(logging.INFO, logger="jobspec.runner"):
        assert install_chunked_loss(model) is None
    assert "full logits" in caplog.text and "not a plain nn.Linear" in caplog.text


def _capped_or_scaled(kind: str):
    """A 1-layer Gemma 2 (final soft cap 30) or Granite (logits / 16) with its own transform of the logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)  # fmt: skip
    if kind == "softcap":
        return Gemma2ForCausalLM(Gemma2Config(**sizes, head_dim=16, final_logit_softcapping=30.0))
    return GraniteForCausalLM(GraniteConfig(**sizes, logits_scaling=16.0))


@pytest.mark.parametrize("kind", ["softcap", "scale"])
def test_a_soft_capped_or_scaled_head_takes_the_chunked_loss_with_the_full_logits_gradients(kind, caplog):
    """Gemma 2 soft-caps its logits and Granite divides them after the output layer: the head applies the family's
    transform (jobspec/catalog/families.py) to each chunk, with the model's own off while it does; the loss and every
    gradient equal the full logits through transformers' own transform, whose config is left as it was."""
    model = _capped_or_scaled(kind)
    x = torch.randint(0, 128, (2, 20))
    labels = torch.roll(x, -1, dims=1)
    labels[:, -1], labels[0, :4] = IGNORE, IGNORE
    logits = model(input_ids=x).logits  # transformers' transform
    ref = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with caplog.at_level(logging.INFO, logger="jobspec.runner"):
        head = install_chunked_loss(model, chunk=7)  # several chunks, the last one short
    assert head is not None and head.transform, caplog.text
    assert ("soft cap 30.0" if kind == "softcap" else "logits x 0.0625") in caplog.text
    with head.targets(labels):
        got = model(input_ids=x).logits.float().sum()
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=name)
    key = "final_logit_softcapping" if kind == "softcap" else "logits_scaling"
    assert getattr(model.config, key) in (30.0, 16.0)  # restored after the loss
    torch.testing.assert_close(model(input_ids=x).logits, logits)  # plain forwards transform as before


def test_a_transform_the_family_table_does_not_name_keeps_the_full_logits(caplog, monkeypatch):
    """The install probe still guards what the table does not know: with Gemma 2 left out of it, the soft cap changes
    what the head returns, and the model keeps its full logits."""
    from jobspec.catalog import families

    monkeypatch.delitem(families.FAMILIES, "gemma2")
    model = _capped_or_scaled("softcap")
    with caplog.at_level(logging.INFO, logger="jobspec.runner"):
        assert install_chunked_loss(model) is None
    assert "changes what its output layer returns" in caplog.text
    assert "forward" not in vars(model.get_output_embeddings())  # removed again


# --- in the runner: Stepper on the fast tier and on FSDP2 ----------------------------------------------------------


@pytest.mark.parametrize("tier", ["fast", "zero3"])
def test_the_stepper_takes_the_chunked_loss_with_the_gradients_of_the_full_logits(tmp_path, tier):
    """Installed after accelerate's prepare (FSDP2 has made [final norm, lm_head] one unit): same loss, same grads."""
    from torch.distributed.tensor import DTensor

    from runner.train.recipe import Recipe

    recipe = Recipe(tiny_spec(tmp_path / "run", training={"micro_batch": 4, "steps": 4}, memory={"tier": tier}))
    try:
        recipe.setup()
        stepper = recipe.stepper
        assert stepper.head is not None
        assert recipe.accelerator.is_fsdp2 == (tier == "zero3")
        # the install probe's forward left no FSDP2 unit gathered: the model's parameters are the optimizer's
        optimized = {id(p) for g in stepper.inner.param_groups for p in g["params"]}
        assert optimized == {id(p) for p in recipe.model.parameters()}
        batch = recipe.data.collate(list(range(4)))
        assert (batch.labels == IGNORE).any()

        def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            stepper.inner.zero_grad(set_to_none=True)
            loss = stepper.loss_sum(batch)
            recipe.accelerator.backward(loss)
            return loss.detach(), {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                                   for n, p in recipe.model.named_parameters()}  # fmt: skip

        new_loss, new = step()
        head, stepper.head = stepper.head, None
        old_loss, old = step()
        stepper.head = head
        torch.testing.assert_close(new_loss, old_loss, **FP32)
        for name in old:
            torch.testing.assert_close(new[name], old[name], **FP32, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        recipe.cleanup()


# --- memory -------------------------------------------------------------------------------------------------------


def test_the_full_fp32_logits_never_exist():
    """Peak of one forward + backward (torch's MemTracker, CPU): the old path holds several (tokens, vocab) fp32
    tensors at once, the chunked one less than half of one. Measured: old 199.6 MiB, chunked 16.1 MiB (parameters
    4.3 MiB, the head's weight gradient three times over: its own, the embedding's and their sum), one fp32 logits
    64 MiB (512 tokens x vocab 32768)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    vocab, tokens = 32768, 4 * 128
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, n_positions=128))
    ids = torch.randint(0, vocab, (4, 128))
    labels = labels_for(ids, vocab)
    logits_bytes = tokens * vocab * 4

    def peak(loss_fn) -> int:
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            loss_fn().backward()
        model.zero_grad(set_to_none=True)
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])

    old = peak(lambda: full_logits_loss(model, ids, labels))
    head = install_chunked_loss(model, chunk=16)  # 2 MiB of fp32 logits a chunk
    assert head is not None
    new = peak(lambda: chunked_loss(head, model, ids, labels))
    assert old >= 3 * logits_bytes  # logits, log-softmax, their gradient
    assert new < logits_bytes / 2, f"chunked peak {new / 2**20:.1f} MiB, one fp32 logits {logits_bytes / 2**20:.0f} MiB"


def test_the_loss_heads_backward_reads_nothing_on_the_host(monkeypatch):
    """Neither the training step's summed loss (`summed=True`: backward takes the forward's gradients, scaled) nor
    per-token losses (the preference objectives' and GRPO's, weighted by their sequence: backward recomputes each
    chunk's) compare the incoming gradient on the host (torch.equal: a device sync in every backward; it took the
    fused path only for a uniform gradient, which per-token losses almost never have). Both give autograd's
    gradients."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 12, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (2, 12), generator=g)
    labels[0, :3] = IGNORE
    compared = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or equal(a, b))
    per_token = torch.autograd.grad(linear_cross_entropy(hidden, weight, None, labels, chunk=5).sum() * 0.3,
                                    (hidden, weight))  # fmt: skip
    summed = torch.autograd.grad(linear_cross_entropy(hidden, weight, None, labels, chunk=5, summed=True).sum() * 0.3,
                                 (hidden, weight))  # fmt: skip
    assert compared == []
    ce = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    ref = torch.autograd.grad(ce * 0.3, (hidden, weight))
    for a, b, c in zip(summed, per_token, ref, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
