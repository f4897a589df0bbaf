"""SimPO and ORPO: reference-free preference objectives, equal to TRL's own trainers on the same batch of a real tiny
model (length-normalised log-probs; ORPO's NLL over the whole chosen chat), planned as two rows a pair, trained by
`python -m runner` (what `jobspec run` executes), resumed exactly and shrunk in process by an injected OOM."""

from __future__ import annotations

import math
import warnings
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jobspec.contract import EXIT_OK
from jobspec.errors import ConfigError
from runner.train.objectives import REWARDS, Objective, odds_ratio_loss, simpo_loss
from tests.runner import train_helpers as th
from tests.runner.train.test_dpo import text_pairs

OBJECTIVES = ("simpo", "orpo")


def _training(objective: str, **extra) -> dict:
    params = {"beta": 2.0, "simpo_gamma": 0.7} if objective == "simpo" else {"beta": 0.2}
    return {"objective": objective, **params, "global_batch": 4, "learning_rate": 1e-3, "warmup_steps": 0,
            "steps": 8, **extra}  # fmt: skip


def _spec(tmp_path, objective, data, **extra):
    return th.tiny_spec(tmp_path / "run", data={"path": str(data), "max_seq_len": 64},
                     training=_training(objective, **extra), checkpoints={"every_steps": 4})  # fmt: skip


def _trl(objective: str):
    """TRL's trainer class for the objective and a stand-in for its `self`: what its loss methods read."""
    pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trl.experimental warns that its API may change
        from trl.experimental.cpo import CPOTrainer
        from trl.experimental.orpo import ORPOTrainer
    same = lambda t: t  # noqa: E731  # one process: gathering is the identity
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=same)
    fake = SimpleNamespace(is_encoder_decoder=False, aux_loss_enabled=False, accelerator=accelerator)
    cls = CPOTrainer if objective == "simpo" else ORPOTrainer
    fake.concatenated_inputs, fake.get_batch_logps = cls.concatenated_inputs, cls.get_batch_logps
    fake.concatenated_forward = partial(cls.concatenated_forward, fake)
    if objective == "simpo":  # CPOConfig(loss_type="simpo", cpo_alpha=0): SimPO
        fake.__dict__.update(loss_type="simpo", cpo_alpha=0.0, label_smoothing=0.0, alpha=0.0)
        fake.cpo_loss = partial(cls.cpo_loss, fake)
    else:
        fake.odds_ratio_loss = partial(cls.odds_ratio_loss, fake)
    return cls, fake


def _trl_batch(data, ids, pad_id):
    """The pairs `ids` of the train rows as TRL's collated batch: each chat's whole token ids, right-padded, its
    attention mask and its labels (the ids where they are completion targets, -100 elsewhere), unshifted."""
    out = {}
    for side, member in (("chosen", 0), ("rejected", 1)):
        seqs = [data.train.streams[int(data.train.records[2 * i + member])] for i in ids]
        width = max(len(t) for t, _ in seqs)
        x = torch.full((len(ids), width), pad_id, dtype=torch.long)
        y = torch.full((len(ids), width), -100, dtype=torch.long)
        for b, (tokens, flags) in enumerate(seqs):
            x[b, : len(tokens)] = torch.from_numpy(tokens.astype(np.int64))
            y[b, : len(tokens)] = torch.from_numpy(np.where(flags, tokens, -100).astype(np.int64))
        out |= {f"{side}_input_ids": x, f"{side}_attention_mask": (torch.arange(width) < torch.tensor(
            [len(t) for t, _ in seqs])[:, None]).long(), f"{side}_labels": y}  # fmt: skip
    return out


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_the_loss_and_metrics_equal_trls_trainer_on_a_real_batch(tmp_path, objective):
    """TRL's own get_batch_loss_metrics (its forward, log-probs and loss) on the model and pairs the step trains."""
    from runner.train.recipe import Recipe

    worker = Recipe(_spec(tmp_path, objective, th.write_jsonl(tmp_path / "p.jsonl", text_pairs(12)), steps=1))
    try:
        worker.setup()
        stepper, data = worker.stepper, worker.data
        ids = [0, 3, 5, 7]
        batch = data.collate(ids)
        stepper.preference_sums = []
        stepper._set_nll_scale(ids, [], "train")  # a step of this one micro-batch
        loss = float(stepper.loss_sum(batch).detach()) / len(ids)
        ours = stepper.objective.metrics(stepper.preference_sums[0].tolist(), len(ids))
        model = worker.accelerator.unwrap_model(worker.model)  # the chunked head is plain outside its targets
        cls, fake = _trl(objective)
        fake.beta, fake.simpo_gamma = stepper.objective.beta, stepper.objective.gamma
        fake.pad_token_id = fake.padding_value = data.pad_id
        with torch.no_grad():
            trl_loss, trl_metrics = cls.get_batch_loss_metrics(fake, model, _trl_batch(data, ids, data.pad_id))
    finally:
        worker.cleanup()
    assert loss == pytest.approx(float(trl_loss), abs=1e-5)
    assert set(ours) == set(trl_metrics) - {"nll_loss"} | ({"nll_loss"} if objective == "orpo" else set())
    for name, value in ours.items():  # logits/*: DPOTrainer's definition (the next test), not these trainers'
        if not name.startswith("logits/"):
            assert value == pytest.approx(float(trl_metrics[name]), abs=1e-5), name
    assert ours["logps/chosen"] > -20  # length-normalised: a per-token mean, not a sum


def _dpo_inputs(data, ids, pad_id):
    """The pairs `ids` as TRL's DPOTrainer collates them: the chosen then the rejected chats right-padded to one
    width, their attention mask and completion mask (1 on the completion's tokens, unshifted)."""
    seqs = [data.train.streams[int(data.train.records[2 * i + member])] for member in (0, 1) for i in ids]
    width = max(len(tokens) for tokens, _ in seqs)
    x = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention, completion = torch.zeros_like(x), torch.zeros_like(x)
    for b, (tokens, flags) in enumerate(seqs):
        x[b, : len(tokens)] = torch.from_numpy(tokens.astype(np.int64))
        attention[b, : len(tokens)] = 1
        completion[b, : len(tokens)] = torch.from_numpy(flags.astype(np.int64))
    zeros = torch.zeros(len(ids))
    return {"input_ids": x, "attention_mask": attention, "completion_mask": completion, "ref_chosen_logps": zeros,
            "ref_rejected_logps": zeros}  # fmt: skip


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_logits_metrics_equal_trls_dpo_trainer_on_a_real_batch(tmp_path, objective):
    """logits/chosen|rejected: the mean over the completion tokens of each token's mean logit, from the chunked loss
    head; TRL 1.16's DPOTrainer._compute_loss (its own fused LM head's mean_logits and its averaging) on the same
    model and pairs."""
    import copy
    from collections import defaultdict

    trl = pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    from runner.train.recipe import Recipe

    worker = Recipe(_spec(tmp_path, objective, th.write_jsonl(tmp_path / "p.jsonl", text_pairs(12)), steps=1))
    try:
        worker.setup()
        stepper, data = worker.stepper, worker.data
        assert stepper.head is not None  # the chunked head computes them, not whole logits
        ids = [0, 3, 5, 7]
        stepper.preference_sums = []
        stepper._set_nll_scale(ids, [], "train")
        stepper.loss_sum(data.collate(ids))
        ours = stepper.objective.metrics(stepper.preference_sums[0].tolist(), len(ids))
        model = copy.deepcopy(worker.accelerator.unwrap_model(worker.model))
    finally:
        worker.cleanup()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    same = lambda t: t  # noqa: E731  # one process: gather is the identity
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SimpleNamespace(device="cpu", gather=same,
                                                                          gather_for_metrics=same),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=["sigmoid"], loss_weights=[1.0], beta=0.1, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    with torch.no_grad():
        trl.DPOTrainer._compute_loss(trainer, model, _dpo_inputs(data, ids, data.pad_id), False)
    for name in ("logits/chosen", "logits/rejected"):
        assert ours[name] == pytest.approx(trainer._metrics["train"][name][0], rel=1e-3, abs=1e-7), name
    assert ours["logits/chosen"] != ours["logits/rejected"]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_the_loss_equals_trls_on_given_log_probs(objective):
    """TRL's cpo_loss (simpo) and odds_ratio_loss on the same length-normalised log-probs, over a wide range."""
    g = torch.Generator().manual_seed(1)
    chosen, rejected = -3 * torch.rand(32, generator=g) - 1e-3, -3 * torch.rand(32, generator=g) - 1e-3
    _, fake = _trl(objective)
    fake.beta, fake.simpo_gamma = 1.7, 0.4
    if objective == "simpo":
        want = fake.cpo_loss(chosen, rejected)
        got = simpo_loss(chosen, rejected, 1.7, 0.4)
    else:
        losses, r_c, r_r, ratio, log_odds = fake.odds_ratio_loss(chosen, rejected)
        want = (losses, r_c, r_r)
        got = odds_ratio_loss(chosen, rejected, 1.7)
        assert float(got[3].mean()) == pytest.approx(float(ratio), abs=1e-6)
        assert float(got[4].mean()) == pytest.approx(float(log_odds), abs=1e-6)
    for a, b in zip(got[:3], want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_a_run_by_the_runner_trains_without_a_reference(tmp_path, objective):
    """`python -m runner SPEC` (what `jobspec run` executes): the pairs' margins grow, TRL's metrics are logged, and no
    reference pass runs or is stored."""
    data = th.write_jsonl(tmp_path / "p.jsonl", text_pairs())
    sections = {"data": {"path": str(data), "max_seq_len": 64}, "checkpoints": {"every_steps": 10},
                "training": _training(objective, steps=10, learning_rate=2e-3)}  # fmt: skip
    spec = th.write_spec(tmp_path / "s.yaml", th.tiny_spec_dict(tmp_path / "run", **sections))
    result = th.run_supervisor([str(spec)])
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert "DPO reference" not in result.stderr
    assert not list((tmp_path / "run").rglob("*.reference-*.npy"))
    train = th.records(tmp_path / "run")
    names = set(Objective.of(_spec(tmp_path, objective, data).training).metric_names)
    assert names <= train[0].keys() and set(REWARDS) <= names
    first, last = train[0], train[-1]
    if objective == "simpo":  # the policy starts indifferent: margin 0, loss -log sigmoid(-gamma)
        assert first["loss"] == pytest.approx(-math.log(1 / (1 + math.exp(0.7))), abs=0.05)
    else:  # ORPO's loss is the chosen chats' NLL minus beta * logsigmoid(log odds)
        assert first["loss"] == pytest.approx(first["nll_loss"] - 0.2 * first["log_odds_ratio"], abs=1e-5)
    assert last["rewards/margins"] > first["rewards/margins"] + 0.05, [r["rewards/margins"] for r in train]
    assert np.mean([r["rewards/accuracies"] for r in train[-3:]]) > 0.5
    assert last["loss"] < first["loss"]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_a_run_resumes_exactly(tmp_path, objective):
    data = th.write_jsonl(tmp_path / "p.jsonl", text_pairs())
    sections = {"data": {"path": str(data), "max_seq_len": 64}, "training": _training(objective, steps=6),
                "checkpoints": {"every_steps": 3}}  # fmt: skip
    full, _ = th.train_and_resume(tmp_path, sections, at=3)
    a = {r["step"]: r for r in th.records(tmp_path / "full")}
    b = {r["step"]: r for r in th.records(tmp_path / "part")}
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("loss", *full.stepper.objective.metric_names):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (step, key)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_an_oom_shrinks_a_step_to_fewer_pairs_with_the_same_result(tmp_path, monkeypatch, objective):
    from runner.oom.faults import ENV_VAR

    data = th.write_jsonl(tmp_path / "p.jsonl", text_pairs())
    monkeypatch.setenv(ENV_VAR, "mbs>4")  # a forward of more than 4 rows (2 pairs) runs out of memory
    assert th.train_in_process(_spec(tmp_path / "shrunk", objective, data, micro_batch=4, steps=3))[0] == EXIT_OK
    monkeypatch.delenv(ENV_VAR)
    assert th.train_in_process(_spec(tmp_path / "plain", objective, data, micro_batch=2, steps=3))[0] == EXIT_OK
    events = th.records(tmp_path / "shrunk" / "run", "event")
    shrinks = [(e["step"], e["from_micro_batch"], e["to_micro_batch"]) for e in events if e["event"] == "oom_shrink"]
    assert shrinks == [(1, 4, 2)]
    shrunk, plain = th.records(tmp_path / "shrunk" / "run"), th.records(tmp_path / "plain" / "run")
    names = Objective.of(_spec(tmp_path, objective, data).training).metric_names
    for a, b in zip(shrunk, plain, strict=True):  # ORPO's NLL is over the step's chosen positions, not a micro-batch's
        for key in ("loss", *names):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)


def test_planned_as_two_rows_a_pair_and_validated(tmp_path):
    from jobspec.plan import memory
    from jobspec.plan.planner import estimate_kwargs, model_shape, rows_per_sample

    data = th.write_jsonl(tmp_path / "p.jsonl", text_pairs(4))
    sft = th.tiny_spec(tmp_path / "sft")
    for objective in OBJECTIVES:
        spec = _spec(tmp_path, objective, data)
        assert rows_per_sample(spec) == 2
        kw = estimate_kwargs(spec, 1, "fp32")
        assert memory.estimate(model_shape(spec), tier="fast", micro_batch=2, **kw).activations == memory.estimate(
            model_shape(sft), tier="fast", micro_batch=4, **estimate_kwargs(sft, 1, "fp32")).activations  # fmt: skip
    assert Objective.of(_spec(tmp_path, "simpo", data).training).gamma == 0.7
    assert Objective.of(th.tiny_spec(tmp_path, training={"objective": "simpo"}).training).gamma == 0.5  # TRL's default
    with pytest.raises(ConfigError, match="simpo_gamma"):
        th.tiny_spec(tmp_path, training={"objective": "orpo", "simpo_gamma": 0.5})
    with pytest.raises(ConfigError, match="simpo_gamma"):
        th.tiny_spec(tmp_path, training={"objective": "simpo", "simpo_gamma": -1})
    with pytest.raises(ConfigError, match=r"data\.streaming: false"):
        th.tiny_spec(tmp_path, data={"path": str(data), "streaming": True}, training={"objective": "orpo"})


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_with_lora_it_trains_the_adapter_and_exports_one_peft_loads(tmp_path, objective):
    """model.lora: no reference is needed (none is scored or stored), the loss is finite and falls, TRL's metrics are
    logged, ORPO's loss is still its NLL minus beta * logsigmoid(log odds), and the exported adapter, loaded by peft
    on the base that ships with it, is the trained policy (not the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = th.write_jsonl(tmp_path / "p.jsonl", text_pairs())
    lora = {"rank": 4, "targets": ["c_attn", "mlp.c_proj"]}
    spec = th.tiny_spec(tmp_path / "run", model={"lora": lora}, data={"path": str(data), "max_seq_len": 64},
                        training=_training(objective, steps=8, learning_rate=1e-2),
                        checkpoints={"every_steps": 8})  # fmt: skip
    code, worker = th.train_in_process(spec)
    assert code == EXIT_OK
    assert not list((tmp_path / "run").rglob("*.reference-*.npy"))
    train = th.records(tmp_path / "run")
    assert len(train) == 8 and all(math.isfinite(r["loss"]) for r in train)
    assert set(worker.stepper.objective.metric_names) <= train[0].keys()
    first, last = train[0], train[-1]
    if objective == "simpo":  # LoRA's B starts at 0: the policy is the base, indifferent between the members
        assert first["loss"] == pytest.approx(-math.log(1 / (1 + math.exp(0.7))), abs=0.05)
    else:
        for r in train:
            assert r["loss"] == pytest.approx(r["nll_loss"] - 0.2 * r["log_odds_ratio"], abs=1e-5)
        assert last["nll_loss"] < first["nll_loss"]
    assert last["loss"] < first["loss"], [r["loss"] for r in train]
    assert last["rewards/margins"] > first["rewards/margins"], [r["rewards/margins"] for r in train]

    adapter = tmp_path / "run" / "model"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "base" / "config.json").is_file()
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
    trained = worker.accelerator.unwrap_model(worker.model).eval()
    base = AutoModelForCausalLM.from_pretrained(adapter / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        want = trained(input_ids=ids).logits.float()
        before = base(input_ids=ids).logits.float()
        got = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits.float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - before).abs().max() > 1e-3  # the adapter moved the policy
