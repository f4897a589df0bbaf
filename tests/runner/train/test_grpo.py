"""GRPO (`training.objective: grpo`): the loss and KL metric equal to TRL 1.16's own `GRPOTrainer._compute_loss` on a
batch the runner sampled, advantages as TRL computes them, a tiny model that learns a verifiable reward on the CPU,
a resumed run that trains on the same completions as an uninterrupted one, the KL term with LoRA, and specs and data
refused with the field and the fix."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.errors import ConfigError
from runner.rl.rollout import group_advantages
from runner.train import grpo
from runner.train.step import token_losses
from tests.runner import train_helpers as th

LOWERCASE = '''
def lowercase(completions, trainer_state, log_metric, log_extra, **columns):
    """The fraction of the completion's characters that are ASCII lowercase letters (and, as TRL's reward functions
    may, two metrics of its own and a completions-table column)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    log_metric("texts/chars", sum(len(t) for t in texts) / len(texts))
    log_metric("texts/step", trainer_state.global_step)
    log_metric("texts/steps", trainer_state.max_steps)
    log_metric("step", -1.0)  # a record's own field: never replaced
    log_extra("texts", texts)
    return [sum("a" <= ch <= "z" for ch in t) / max(len(t), 1) for t in texts]
'''


def prompts(n: int = 32) -> list[dict]:
    return [{"prompt": f"say a word ({i})", "answer": str(i % 5)} for i in range(n)]


def _sections(tmp_path, data_file, rewards=None, **training) -> dict:
    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(LOWERCASE)
    rewards = rewards or [{"kind": "python", "file": str(reward_file), "function": "lowercase"}]
    grpo_spec = {"num_generations": 4, "max_completion_length": 12, "rewards": rewards, **training.pop("grpo", {})}
    return {"data": {"path": str(data_file), "max_seq_len": 40},
            "training": {"objective": "grpo", "global_batch": 4, "learning_rate": 3e-3, "warmup_steps": 0,
                         "steps": 4, "grpo": grpo_spec, **training},
            "checkpoints": {"every_steps": 4}}  # fmt: skip


def _spec(tmp_path, **training):
    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    return th.tiny_spec(tmp_path / "run", **_sections(tmp_path, data_file, **training))


def _trl_grpo(beta: float, temperature: float, loss_type: str = "dapo", epsilon_high: float = 0.2,
              sapo: dict | None = None) -> SimpleNamespace:  # fmt: skip
    """A stand-in for TRL 1.16's GRPOTrainer `self`: what its `_compute_loss` reads at its defaults (token-level
    ratios, epsilon 0.2), `loss_type`, `epsilon_high` and SAPO's temperatures, one process, no accumulation."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer

    same = lambda t, **_: t  # noqa: E731  # one process: gathering and reducing are the identity
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), beta=beta, temperature=temperature, loss_type=loss_type,
        max_completion_length=12,  # _sections' grpo.max_completion_length
        importance_sampling_level="token", epsilon_low=0.2, epsilon_high=epsilon_high, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1,
                             **{"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, **(sapo or {})}),
        accelerator=SimpleNamespace(num_processes=1, reduce=same, gather=same, autocast=nullcontext,
                                    is_main_process=True),
        _metrics={"train": defaultdict(list)},
    )  # fmt: skip
    fake._get_per_token_logps_and_entropies = partial(GRPOTrainer._get_per_token_logps_and_entropies, fake)
    return fake


@pytest.mark.parametrize(("beta", "temperature", "loss_type", "iterations"),
                         [(0.0, 1.0, "dapo", 1), (0.04, 0.7, "dapo", 1), (0.0, 1.0, "grpo", 1),
                          (0.04, 0.7, "dr_grpo", 1), (0.04, 0.7, "dapo", 2), (0.0, 1.0, "cispo", 2),
                          (0.04, 0.7, "sapo", 2)],
                         ids=["no-kl", "kl-tempered", "grpo", "dr_grpo-kl", "iterations-kl", "cispo",
                              "sapo-kl"])  # fmt: skip
def test_the_loss_and_kl_equal_trls_grpo_trainer_on_a_batch_it_sampled(tmp_path, beta, temperature, loss_type,
                                                                        iterations):  # fmt: skip
    """Four prompts' groups sampled by the runner from a real tiny model, given random advantages (and reference
    log-probs moved off the policy): the step's loss (over the batch's completion tokens for dapo, each completion's
    mean over the completions for grpo, over completions x max_completion_length for dr_grpo), and its KL metric,
    equal TRL's own `GRPOTrainer._compute_loss` (its fused LM head at the same temperature) on the same prompt and
    completion ids, to 1e-5. With num_iterations 2, the log-probs at sampling (moved off the policy, as after an
    update) make the ratio move: the clip at [0.8, 1.28] (epsilon_high 0.28) binds and the clip ratios are TRL's;
    cispo's weights clipped at epsilon_high 1.3 (its cispo_clip_ratio TRL's), sapo's gate at temperatures 0.9 / 1.3."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from runner.train.recipe import Recipe

    high = {"cispo": 1.3}.get(loss_type, 0.28) if iterations > 1 else None
    sapo = {"sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.3} if loss_type == "sapo" else {}
    grpo_spec = {"temperature": temperature, "loss_type": loss_type, "num_iterations": iterations,
                 "epsilon_high": high, **sapo}
    worker = Recipe(_spec(tmp_path, steps=1, grpo=grpo_spec))
    try:
        worker.setup()
        stepper, data = worker.stepper, worker.data
        stepper.objective = dataclasses.replace(stepper.objective, beta=beta)
        ids = [0, 3, 5, 9]
        batch = stepper.rollouts.batches(ids, len(ids))[0]
        groups = stepper.rollouts.made[2]
        rng = np.random.default_rng(0)
        advantages = torch.from_numpy(rng.normal(0, 1, len(batch.advantages)).astype(np.float32))
        with torch.no_grad():
            logps = -token_losses(stepper.model, stepper.head, batch.input_ids, batch.labels, temperature=temperature)
        ref = (logps + torch.from_numpy(rng.normal(0, 0.3, logps.shape).astype(np.float32))) * (batch.labels >= 0)
        if iterations > 1:  # what the runner scored at sampling is the policy's own: ratio 1 before any update
            assert batch.old_logps is not None and torch.allclose(batch.old_logps, logps, atol=1e-5)
        old = (logps + torch.from_numpy(rng.normal(0, 0.3, logps.shape).astype(np.float32))) * (batch.labels >= 0)
        batch = dataclasses.replace(batch, advantages=advantages, ref_logps=ref if beta else None,
                                    old_logps=old if iterations > 1 else None)  # fmt: skip
        stepper.preference_sums = []
        loss = float(stepper.loss_sum(batch).detach()) / stepper.objective.denominator(batch.targets, len(ids))
        ours = grpo.metrics(stepper.preference_sums[0].tolist(), beta, stepper.extremes[0].tolist(), loss_type)
        model = worker.accelerator.unwrap_model(worker.model)
        completions = [c for i in ids for c in groups[i].completions]
        prompt_rows = [data.prompt_ids(i).tolist() for i in ids for _ in range(4)]
        model_copy = type(model)(model.config)
        model_copy.load_state_dict(model.state_dict())
    finally:
        worker.cleanup()
    width, length = max(map(len, prompt_rows)), max(map(len, completions))
    pad = data.pad_id
    inputs = {
        "prompt_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompt_rows]),
        "prompt_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_rows]),
        "completion_ids": torch.tensor([c + [pad] * (length - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in completions]),
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(float(sum(map(len, completions)))),
    }
    def per_completion_token(values: torch.Tensor) -> torch.Tensor:  # as TRL lays them out (the prompt's part cut off)
        rows = [values[r, len(p) - 1 : len(p) - 1 + len(c)] for r, (p, c) in enumerate(zip(prompt_rows, completions,
                                                                                           strict=True))]  # fmt: skip
        return torch.stack([torch.nn.functional.pad(v, (0, length - len(v))) for v in rows])

    if beta:
        inputs["ref_per_token_logps"] = per_completion_token(ref)
    if iterations > 1:
        inputs["old_per_token_logps"] = per_completion_token(old)
    add_fused_lm_head(model_copy, temperature=temperature, outputs=("log_probs", "entropy"))
    trainer = _trl_grpo(beta, temperature, loss_type, high or 0.2, sapo)
    with torch.no_grad():
        want = float(GRPOTrainer._compute_loss(trainer, model_copy, inputs))
    assert batch.targets == sum(map(len, completions))
    assert loss == pytest.approx(want, abs=1e-5)
    theirs = {k: v[0] for k, v in trainer._metrics["train"].items()}
    if beta:
        assert ours["kl"] == pytest.approx(theirs["kl"], rel=1e-4, abs=1e-6) and ours["kl"] > 0.01
    else:
        assert "kl" not in ours
    names = grpo.clip_names(loss_type)
    assert {n for n in theirs if "clip" in n} == set(names)  # the clip metrics TRL logs for this loss type
    for name in names:  # one pass per batch: ratio 1, nothing clipped at TRL's
        if iterations == 1:
            assert ours[name] == theirs[name] == 0.0, name
        else:
            assert ours[name] == pytest.approx(theirs[name], abs=1e-6), name
    if iterations > 1 and loss_type == "dapo":
        assert 0.05 < ours["clip_ratio/region_mean"] < 0.95 and ours["clip_ratio/high_mean"] > 0
        assert ours["clip_ratio/high_max"] > ours["clip_ratio/high_mean"] >= ours["clip_ratio/low_min"]
    if loss_type == "cispo":
        assert 0.05 < ours[grpo.CISPO_CLIP] < 0.95
    # the policy's entropy over the vocabulary at the temperature, over the completion tokens (one micro-batch: TRL's
    # per-micro-batch mean is the same)
    assert ours["entropy"] == pytest.approx(theirs["entropy"], rel=1e-5) and ours["entropy"] > 1.0


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls_group_normalised_rewards(scale):
    """TRL's sum_then_normalize: reward minus the group's nan-mean, over (std + 1e-4) of the group (unbiased) or of
    the step; a completion no reward applied to gets 0; a group of equal rewards is counted as zero-std."""
    rewards = np.array([1.0, 0.0, np.nan, 0.5])
    step_std = 0.7
    got, flat = group_advantages(rewards, scale, step_std)
    t = torch.tensor(rewards)
    mean = torch.nanmean(t)
    std = torch.tensor([1.0, 0.0, 0.5]).std()
    want = t - mean
    if scale == "group":
        want = want / (std + 1e-4)
    elif scale == "batch":
        want = want / (step_std + 1e-4)
    assert np.allclose(got, torch.nan_to_num(want, nan=0.0).numpy())
    assert got[2] == 0.0 and not flat
    assert group_advantages(np.array([0.3, 0.3]), scale, step_std)[1]


def test_a_tiny_model_learns_a_verifiable_reward_on_the_cpu(tmp_path):
    """12 steps of 4 prompts x 4 completions, rewarded by the fraction of lowercase letters (a Python reward file the
    spec names): the mean reward of the last 3 steps is well above the first 3's, and every TRL metric is logged."""
    code, _ = th.train_in_process(_spec(tmp_path, steps=12, log_every=1, learning_rate=1e-2))
    assert code == EXIT_OK
    recs = th.records(tmp_path / "run")
    assert [r["step"] for r in recs] == list(range(1, 13))
    first, last = np.mean([r["reward"] for r in recs[:3]]), np.mean([r["reward"] for r in recs[-3:]])
    assert last > first + 0.15, (first, last)
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/lowercase/mean", "rewards/lowercase/std",
                 "completions/mean_length", "completions/max_length", "completions/clipped_ratio",
                 "completions/mean_terminated_length"):  # fmt: skip
        assert all(np.isfinite(r[name]) for r in recs), name
    assert all(r["rewards/lowercase/mean"] == pytest.approx(r["reward"]) for r in recs)
    assert all(r["clip_ratio/region_mean"] == 0.0 for r in recs)
    assert all(0 < r["entropy"] < np.log(512) for r in recs)  # nats, at most the byte vocabulary's uniform
    assert [(r["texts/step"], r["texts/steps"]) for r in recs] == [(s, 12) for s in range(12)]  # trainer_state
    assert all(r["texts/chars"] > 0 for r in recs)
    assert "kl" not in recs[0]
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_top_k_1_samples_every_completion_of_a_group_alike(tmp_path, monkeypatch):
    """`training.grpo.top_k: 1` reaches the sampler: each group's completions are the greedy one, so every group's
    rewards are equal (frac_reward_zero_std 1, reward_std 0) and nothing is learned from them. The repetition penalty
    reaches it too."""
    from runner.rl import rollout

    made = []

    class Recorded(rollout.GumbelNoise):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(rollout, "GumbelNoise", Recorded)
    code, _ = th.train_in_process(_spec(tmp_path, steps=2, log_every=1, grpo={"top_k": 1, "repetition_penalty": 1.2}))
    assert code == EXIT_OK
    recs = th.records(tmp_path / "run")
    assert all(r["frac_reward_zero_std"] == 1.0 and r["reward_std"] == 0.0 for r in recs), recs
    assert made and all(n.repetition_penalty == 1.2 and n.top_k == 1 for n in made)


def test_a_resumed_run_samples_and_trains_as_an_uninterrupted_one(tmp_path):
    """8 steps straight, and 4 then 4 more from the checkpoint: each completion's draws are its own (seed, step,
    prompt, index), so the resumed steps sample the same completions and log the same rewards and losses."""
    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    th.train_and_resume(tmp_path, _sections(tmp_path, data_file, steps=8, log_every=1))
    full, part = th.records(tmp_path / "full"), th.records(tmp_path / "part")
    assert [r["step"] for r in part] == [5, 6, 7, 8]
    for a, b in zip(full[4:], part, strict=True):
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)
        assert b["completions/mean_length"] == a["completions/mean_length"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)


def test_num_iterations_trains_each_sampled_batch_that_many_steps_and_the_clip_binds_after_the_first(tmp_path):
    """num_iterations 2, epsilon 0.001: steps 1-2 train one sampled batch (the same prompts, completions and rewards),
    steps 3-4 the next; the first step of each has the ratio 1 (the log-probs at sampling are the policy's), the
    second a moved policy, so the narrow clip binds there. An epoch is twice as many steps."""
    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    sections = _sections(tmp_path, data_file, steps=4, log_every=1, learning_rate=3e-2,
                         grpo={"num_iterations": 2, "epsilon": 0.001})  # fmt: skip
    code, worker = th.train_in_process(th.tiny_spec(tmp_path / "run", **sections))
    assert code == EXIT_OK
    recs = th.records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for a, b in ((recs[0], recs[1]), (recs[2], recs[3])):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
    assert recs[0]["reward"] != recs[2]["reward"] or recs[0]["completions/mean_length"] != recs[2][
        "completions/mean_length"]  # fmt: skip
    assert recs[0]["clip_ratio/region_mean"] == recs[2]["clip_ratio/region_mean"] == 0.0
    assert recs[1]["clip_ratio/region_mean"] > 0 and recs[3]["clip_ratio/region_mean"] > 0
    assert [worker.step_ids(s) for s in range(4)] == [worker.step_ids(0)] * 2 + [worker.step_ids(2)] * 2
    per_epoch = len(prompts()) // 4  # 32 prompts, global batch 4
    spec = th.tiny_spec(tmp_path / "epochs", **{**sections, "training": {
        **sections["training"], "steps": None, "epochs": 1.0}})  # fmt: skip
    from runner.data.dataset import total_steps

    assert total_steps(spec, worker.order) == 2 * per_epoch
    from jobspec.plan.job_length import job_length

    assert job_length(spec).steps == total_steps(spec, worker.order)  # `jobspec plan` counts the runner's steps


def test_a_run_resumed_in_the_middle_of_a_batchs_iterations_trains_on_that_batch(tmp_path):
    """num_iterations 2, a checkpoint after step 3 (the first of step 3-4's batch): the checkpoint holds the batch
    (each rank's own items in its shard), and the resumed run trains steps 4-6 as the uninterrupted one did."""
    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    sections = _sections(tmp_path, data_file, steps=6, log_every=1, learning_rate=3e-2,
                         grpo={"num_iterations": 2, "beta": 0.0})  # fmt: skip
    sections["checkpoints"] = {"every_steps": 3}
    th.train_and_resume(tmp_path, sections, at=3)
    full, part = th.records(tmp_path / "full"), th.records(tmp_path / "part")
    assert [r["step"] for r in part] == [4, 5, 6]
    for a, b in zip(full[3:], part, strict=True):
        assert b["reward"] == a["reward"] and b["loss"] == pytest.approx(a["loss"], abs=1e-6), (a, b)
        assert b["clip_ratio/region_mean"] == pytest.approx(a["clip_ratio/region_mean"], abs=1e-9)


@pytest.mark.parametrize("loss_type", ["grpo", *(pytest.param(t, marks=pytest.mark.sweep)
                                                  for t in ("dr_grpo", "cispo", "sapo"))])  # fmt: skip
def test_the_other_loss_types_do_not_depend_on_the_micro_batch(tmp_path, loss_type):
    """grpo and sapo (each completion's token mean), dr_grpo (over completions x max_completion_length) and cispo,
    averaged over the whole step: 2 steps at micro-batch 4 and at micro-batch 1 log the same losses (the second after
    the same updates). Weights are not compared: Adam turns summation-order noise in a near-zero gradient into a
    full step."""
    losses = {}
    for mbs in (4, 1):
        data_file = th.write_jsonl(tmp_path / f"p{mbs}.jsonl", prompts())
        sections = _sections(tmp_path, data_file, steps=2, log_every=1, micro_batch=mbs, grpo={"loss_type": loss_type})
        code, _ = th.train_in_process(th.tiny_spec(tmp_path / f"run{mbs}", **sections))
        assert code == EXIT_OK
        losses[mbs] = [r["loss"] for r in th.records(tmp_path / f"run{mbs}")]
    assert len(losses[4]) == 2 and losses[4] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)


def test_completions_do_not_depend_on_how_a_step_is_batched(tmp_path):
    """A step sampled 4 prompts a generate call, and again 1 prompt a call (as after an OOM halved it): the same
    completions, token for token."""
    from runner.train.recipe import Recipe

    worker = Recipe(_spec(tmp_path, steps=1))
    try:
        worker.setup()
        rollouts = worker.stepper.rollouts
        rollouts.step = 3
        ids = [1, 2, 7, 30]
        rollouts.batches(ids, 4)
        wide = {i: g.completions for i, g in rollouts.made[2].items()}
        rollouts.made = None
        rollouts.batches(ids, 1)
        narrow = {i: g.completions for i, g in rollouts.made[2].items()}
        rollouts.step, rollouts.made = 4, None
        rollouts.batches(ids, 4)
        later = {i: g.completions for i, g in rollouts.made[2].items()}
    finally:
        worker.cleanup()
    assert wide == narrow
    assert later != wide  # another step draws afresh


def test_the_kl_term_with_lora_starts_at_zero_and_is_logged_at_every_kind_of_tier(tmp_path):
    """beta > 0 with LoRA: the reference is the adapter off, so at the first step (the adapter's B = 0) the policy is
    the reference and kl = 0; later steps move away from it. The same at `fast` (DDP) and at `zero3` (FSDP2, where
    peft's `generate` passes by the root's hooks: its own parameters are gathered for it)."""
    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    logs = {}
    for tier in ("fast", "zero3"):
        sections = _sections(tmp_path, data_file, steps=4, log_every=1, learning_rate=1e-2, grpo={"beta": 0.04})
        spec = th.tiny_spec(tmp_path / tier, model={"lora": {"rank": 4, "targets": ["c_attn"]}},
                            memory={"tier": tier}, **sections)  # fmt: skip
        code, _ = th.train_in_process(spec)
        assert code == EXIT_OK
        logs[tier] = th.records(tmp_path / tier)
    kl = [r["kl"] for r in logs["fast"]]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 1e-5
    for a, b in zip(logs["fast"], logs["zero3"], strict=True):
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-7) and b["reward"] == pytest.approx(a["reward"])


def test_specs_and_prompts_that_cannot_train_are_refused_with_the_fix(tmp_path):
    from jobspec.spec.loader import parse_spec

    base = th.tiny_spec_dict(tmp_path / "run", data={"max_seq_len": 40},
                             training={"objective": "grpo", "global_batch": 4})  # fmt: skip
    with pytest.raises(ConfigError, match=r"needs `training.grpo.rewards`"):
        parse_spec(json.dumps(base))
    base["training"]["grpo"] = {"max_completion_length": 40, "beta": 0.1, "rewards": [{"kind": "accuracy"}]}
    with pytest.raises(ConfigError) as err:
        parse_spec(json.dumps(base))
    assert "leaves no room for the prompt" in str(err.value) and "set model.lora" in str(err.value)
    base["training"]["grpo"] = {"max_completion_length": 8, "rewards": [{"kind": "python"}]}
    with pytest.raises(ConfigError, match=r"a python reward needs `file`"):
        parse_spec(json.dumps(base))
    sft = th.tiny_spec_dict(tmp_path / "run", training={"grpo": {"rewards": [{"kind": "accuracy"}]}})
    with pytest.raises(ConfigError, match=r"`training.grpo` is GRPO's"):
        parse_spec(json.dumps(sft))


@pytest.mark.parametrize(
    ("record", "message"),
    [({"question": "q"}, "'prompt' is missing"), ({"prompt": ""}, "'prompt' is empty"),
     ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "ends with an assistant")],
    ids=["no-prompt", "empty", "ends-with-reply"],
)  # fmt: skip
def test_a_bad_prompt_record_is_refused_by_file_line_and_field(tmp_path, record, message):
    from runner.data.prompts import load_prompts
    from runner.data.tokenizer import ByteTokenizer

    data_file = th.write_jsonl(tmp_path / "p.jsonl", [*prompts(3), record])
    spec = th.tiny_spec(tmp_path / "run", **_sections(tmp_path, data_file))
    with pytest.raises(ConfigError) as err:
        load_prompts(spec, ByteTokenizer())
    assert f"{data_file}:4" in str(err.value) and message in str(err.value)


def test_a_reward_that_raises_exits_2_naming_it(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def reward(completions, **kw):\n    return [1 / 0 for _ in completions]\n")
    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    spec = th.tiny_spec(tmp_path / "run", **_sections(tmp_path, data_file, rewards=[{"kind": "python",
                                                                                      "file": str(bad)}]))  # fmt: skip
    spec_file = th.write_spec(tmp_path / "spec.yaml", spec.to_yaml_dict())
    code, status = th.worker_in_process(spec_file, tmp_path / "status.json")
    assert code == EXIT_CONFIG
    assert "reward 'reward' raised ZeroDivisionError" in status["reason"] and "bad.py:2" in status["reason"]


@pytest.mark.parametrize("tier", ["zero3", pytest.param("fast", marks=pytest.mark.sweep)])
def test_two_ranks_sample_and_train_what_one_process_does(tmp_path, tier):
    """The same spec on one process and on two (FSDP at `zero3`, whose ranks sample in step, `synced_gpus`; DDP at
    `fast` in the sweep tier: 37 s in CI, and the same reductions): each rank samples its share of the step's prompts
    with the completions' own seeds, the rewards, their spread and the loss are reduced over the ranks, so the two
    runs log the same steps."""
    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    logs = []
    for nproc in (1, 2):
        run = tmp_path / f"run{nproc}"
        sections = _sections(tmp_path, data_file, steps=3, log_every=1)
        spec = th.tiny_spec_dict(run, memory={"tier": tier}, **sections)
        spec_file = th.write_spec(tmp_path / f"spec{nproc}.yaml", spec)
        result = th.run_supervisor([str(spec_file), "--nproc", str(nproc)], timeout=600)
        assert result.returncode == EXIT_OK, result.stderr[-3000:]
        logs.append(th.records(run))
    for a, b in zip(*logs, strict=True):
        for key in ("reward", "reward_std", "completions/mean_length", "frac_reward_zero_std", "loss", "texts/chars"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)
        assert b["world_size"] == 2


def test_a_tier_step_down_in_the_middle_of_a_batchs_iterations_keeps_training_on_that_batch(tmp_path, monkeypatch,
                                                                                          caplog):  # fmt: skip
    """num_iterations 2, micro-batch 1, an OOM in step 4's backward (the second step on the batch sampled at step 3):
    the in-process step-down to the next tier keeps the batch, whether the state is handed over in memory or read
    back from the checkpoint it writes first (which holds the batch): both log the same steps, and nothing is
    sampled again."""
    import logging

    from runner.oom.faults import ENV_VAR

    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    sections = _sections(tmp_path, data_file, steps=6, log_every=1, micro_batch=1, learning_rate=3e-2,
                         grpo={"num_iterations": 2})  # fmt: skip
    sections["checkpoints"] = {"every_steps": 100}
    monkeypatch.setenv(ENV_VAR, "step=4,backward")
    logs = {}
    for how in ("memory", "checkpoint"):
        monkeypatch.setenv("JOBSPEC_STEP_DOWN", how)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
            code, _ = th.train_in_process(th.tiny_spec(tmp_path / how, **sections))
        assert code == EXIT_OK
        assert "is not at hand" not in caplog.text
        (event,) = [r for r in th.records(tmp_path / how, "event") if r.get("event") == "tier_change"]
        assert (event["step"], event["state"]) == (3, how)
        logs[how] = {r["step"]: r for r in th.records(tmp_path / how)}
    assert sorted(logs["memory"]) == sorted(logs["checkpoint"]) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        a, b = logs["memory"][step], logs["checkpoint"][step]
        assert a["reward"] == b["reward"] and a["loss"] == pytest.approx(b["loss"], abs=1e-6), step
    assert logs["memory"][4]["reward"] == logs["memory"][3]["reward"]  # step 4 trained step 3's batch


def test_two_ranks_resumed_in_the_middle_of_a_batchs_iterations_train_on_their_own_shares(tmp_path):
    """num_iterations 2 on two ranks (zero3): the checkpoint after step 3 holds each rank's share of the batch in that
    rank's own shard; resumed on two ranks, step 4 trains as the uninterrupted run's did."""
    import shutil

    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    sections = _sections(tmp_path, data_file, steps=4, log_every=1, learning_rate=3e-2, grpo={"num_iterations": 2})
    sections["checkpoints"] = {"every_steps": 3}
    logs = {}
    for name in ("full", "part"):
        run = tmp_path / name
        if name == "part":
            run.mkdir()
            shutil.copytree(tmp_path / "full" / "step-3", run / "step-3")
        spec = th.tiny_spec_dict(run, memory={"tier": "zero3"}, **sections)
        result = th.run_supervisor([str(th.write_spec(tmp_path / f"{name}.yaml", spec)), "--nproc", "2"], timeout=600)
        assert result.returncode == EXIT_OK, result.stderr[-3000:]
        assert "is not at hand" not in result.stderr
        logs[name] = {r["step"]: r for r in th.records(run)}
    assert sorted(logs["part"]) == [4]
    a, b = logs["full"][4], logs["part"][4]
    assert b["reward"] == a["reward"] and b["loss"] == pytest.approx(a["loss"], abs=1e-6), (a, b)


def test_the_plan_counts_the_kv_cache_of_the_sampled_rows_where_it_outgrows_the_step():
    """GRPO's rows are sampled before they are trained: at `minimal` (activation checkpointing), a 7B model without
    grouped-query attention keeps less for the step than its KV cache of the same rows, and the estimate counts the
    cache there; with grouped-query attention (Qwen2.5-7B, 4 of 28 heads) the step's activations stay the larger."""
    from jobspec.catalog.presets import ModelShape
    from jobspec.plan import memory

    mha = ModelShape(layers=32, hidden=4096, heads=32, vocab=32000, max_positions=4096, intermediate=11008,
                     family="llama", tie_embeddings=False)
    gqa = dataclasses.replace(mha, layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064)
    kw = {"tier": "minimal", "seq_len": 4096, "micro_batch": 2, "world_size": 1, "rows": 8}
    for shape, dominates in ((mha, True), (gqa, False)):
        plain, sampled = (memory.estimate(shape, sampling=s, **kw) for s in (False, True))
        cache = memory.sampling_bytes(shape, 2 * 8 * 4096, 16, "bf16")
        assert cache == shape.layers * 2 * shape.kv_width * 2 * 2 * 8 * 4096 + 16 * shape.vocab * 12
        if dominates:
            assert sampled.activations + sampled.logits == cache > plain.activations + plain.logits
        else:
            assert sampled == plain and cache < plain.activations


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_grpo_samples_and_trains_on_one_gpu(tmp_path):
    """The supervisor's path on a GPU at tier zero3 (FSDP2, `synced_gpus` sampling, bf16 autocast, the samplers'
    generators on the device): three steps, each with its rewards and completion lengths logged."""
    import subprocess
    import sys

    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    spec = th.tiny_spec_dict(tmp_path / "run", memory={"tier": "zero3"},
                             **_sections(tmp_path, data_file, steps=3, log_every=1, precision="auto"))  # fmt: skip
    spec["hardware"] = {"vendor": "cuda", "gpus": 1}
    path = th.write_spec(tmp_path / "s.yaml", spec)
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run([sys.executable, "-m", "runner", str(path)], cwd=root, env=th.runner_env(),
                            capture_output=True, text=True, timeout=th.timeout_s())  # fmt: skip
    assert result.returncode == EXIT_OK, result.stderr[-4000:]
    recs = th.records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3] and th.records(tmp_path / "run", "plan")[0]["tier"] == "zero3"
    assert all(np.isfinite(r["reward"]) and r["completions/mean_length"] > 0 for r in recs)


def test_an_oom_halves_the_sampling_and_shrinks_the_step_with_the_same_result(tmp_path, monkeypatch, caplog):
    """A forward of more than 8 rows runs out of memory (JOBSPEC_FAULT_OOM): the step's sampling, 4 prompts x 4
    completions a `generate` call, goes on at 2 prompts a call, and the step then shrinks from 4 prompts a micro-batch
    to 2. The completions are the same as an uninterrupted run's at micro-batch 2 (each has its own generator), and so
    are the rewards and the losses."""
    from runner.oom.faults import ENV_VAR

    data_file = th.write_jsonl(tmp_path / "p.jsonl", prompts())
    monkeypatch.setenv(ENV_VAR, "mbs>8")
    shrunk = th.tiny_spec(tmp_path / "shrunk", **_sections(tmp_path, data_file, steps=3, log_every=1, micro_batch=4))
    with caplog.at_level("WARNING", logger="jobspec.runner"):
        assert th.train_in_process(shrunk)[0] == EXIT_OK
    monkeypatch.delenv(ENV_VAR)
    plain = th.tiny_spec(tmp_path / "plain", **_sections(tmp_path, data_file, steps=3, log_every=1, micro_batch=2))
    assert th.train_in_process(plain)[0] == EXIT_OK
    events = [(e["step"], e["from_micro_batch"], e["to_micro_batch"]) for e in th.records(tmp_path / "shrunk", "event")
              if e.get("event") == "oom_shrink"]  # fmt: skip
    assert events == [(1, 4, 2)] and "GRPO sampling: 4 -> 2 prompts a generate call" in caplog.text
    for a, b in zip(th.records(tmp_path / "shrunk"), th.records(tmp_path / "plain"), strict=True):
        for key in ("loss", "reward", "reward_std", "completions/mean_length"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)


def test_the_checkpoints_own_generation_settings_do_not_bend_the_sampling(tmp_path):
    """A generation_config.json's repetition penalty, suppressed tokens and sampling settings (Qwen ships a
    repetition_penalty, Llama-Instruct do_sample, temperature and top_p) are not applied: the completions are those
    of the same model without them, drawn from softmax(logits / T) alone; the model's own config is put back."""
    from runner.train.recipe import Recipe

    worker = Recipe(_spec(tmp_path, steps=1))
    try:
        worker.setup()
        rollouts = worker.stepper.rollouts
        ids = [0, 1, 2, 3]
        rollouts.batches(ids, 4)
        plain = {i: g.completions for i, g in rollouts.made[2].items()}
        own = rollouts.generator.generation_config
        own.update(repetition_penalty=50.0, suppress_tokens=list(range(97, 123)), do_sample=True, temperature=0.1,
                   top_p=0.5, no_repeat_ngram_size=1)  # fmt: skip
        rollouts.made = None
        rollouts.batches(ids, 4)
        bent = {i: g.completions for i, g in rollouts.made[2].items()}
        assert rollouts.generator.generation_config is own and own.repetition_penalty == 50.0
    finally:
        worker.cleanup()
    assert bent == plain
