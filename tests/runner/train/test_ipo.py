"""IPO (`training.objective: ipo`): TRL's DPOTrainer with loss_type "ipo", its squared loss on length-averaged
log-ratios against the cached reference: equal to TRL's own `_compute_loss` on a real batch of a tiny model, trained
by the runner until the loss falls, planned like DPO (two rows a pair and a reference pass)."""

from __future__ import annotations

import copy
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jobspec.contract import EXIT_OK
from runner.train.dpo import METRICS, ipo_loss
from tests.runner import train_helpers as th
from tests.runner.train.test_dpo import text_pairs
from tests.runner.train.test_reference_free import _dpo_inputs


def _spec(tmp_path, data, **training):
    return th.tiny_spec(tmp_path / "run", data={"path": str(data), "max_seq_len": 64},
                        training={"objective": "ipo", "beta": 0.5, "global_batch": 4, "learning_rate": 1e-3,
                                  "warmup_steps": 0, "steps": 8, **training},
                        checkpoints={"every_steps": 8})  # fmt: skip


def _trl_dpo_trainer(beta: float) -> SimpleNamespace:
    """A stand-in for TRL 1.16's DPOTrainer `self`: what its `_compute_loss` reads, loss_type ipo, references given."""
    same = lambda t: t  # noqa: E731  # one process: gather is the identity
    return SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SimpleNamespace(device="cpu", gather=same,
                                                                          gather_for_metrics=same),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=["ipo"], loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip


def test_the_loss_and_metrics_equal_trls_dpo_trainer_with_loss_type_ipo_on_a_real_batch(tmp_path):
    """The step's loss on 4 pairs of a real tiny model (text pairs, byte tokenizer, chat template) against references
    moved off the policy (so the length averages matter), and TRL's `DPOTrainer._compute_loss` (its fused LM head,
    its completion masks and its IPO branch) on the same model, pairs and references: equal to 1e-5."""
    trl = pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    from runner.train.recipe import Recipe

    worker = Recipe(_spec(tmp_path, th.write_jsonl(tmp_path / "p.jsonl", text_pairs(12)), steps=1))
    try:
        worker.setup()
        stepper, data = worker.stepper, worker.data
        assert data.reference["train"] is not None  # IPO scores against the reference, as DPO does
        shift = np.random.default_rng(0).normal(0.0, 20.0, data.reference["train"].shape)
        data.reference["train"] = data.reference["train"] + shift
        ids = [0, 3, 5, 7]
        batch = data.collate(ids)
        stepper.preference_sums = []
        loss = float(stepper.loss_sum(batch).detach()) / len(ids)
        ours = stepper.objective.metrics(stepper.preference_sums[0].tolist(), len(ids))
        model = copy.deepcopy(worker.accelerator.unwrap_model(worker.model))
        ref = batch.reference.float()
    finally:
        worker.cleanup()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    inputs = _dpo_inputs(data, ids, data.pad_id) | {"ref_chosen_logps": ref[:, 0], "ref_rejected_logps": ref[:, 1]}
    trainer = _trl_dpo_trainer(0.5)
    with torch.no_grad():
        want = float(trl.DPOTrainer._compute_loss(trainer, model, inputs, False))
    got = {k: v[0] for k, v in trainer._metrics["train"].items()}
    assert loss == pytest.approx(want, abs=1e-5)
    assert abs(loss - 1.0) > 0.1  # not the starting loss (1 / (2 beta))^2: the shifted references count
    for name in (*METRICS, "logits/chosen", "logits/rejected"):
        assert ours[name] == pytest.approx(got[name], rel=1e-4, abs=1e-5), name


def test_ipo_loss_is_the_squared_distance_of_the_averaged_margin_from_its_target():
    chosen, rejected = torch.tensor([-10.0, -4.0]), torch.tensor([-12.0, -3.0])
    ref_c, ref_r = torch.tensor([-11.0, -4.0]), torch.tensor([-11.0, -4.0])
    n_c, n_r = torch.tensor([4.0, 0.0]), torch.tensor([2.0, 1.0])  # an empty completion counts as one token
    losses, r_c, r_r = ipo_loss(chosen, rejected, ref_c, ref_r, 0.25, n_c, n_r)
    target = 1 / (2 * 0.25)
    torch.testing.assert_close(losses, torch.tensor([(1 / 4 - (-1 / 2) - target) ** 2, (0 - 1 - target) ** 2]))
    torch.testing.assert_close(r_c, 0.25 * (chosen - ref_c))
    torch.testing.assert_close(r_r, 0.25 * (rejected - ref_r))


def test_an_ipo_run_by_the_runner_starts_at_its_target_and_lowers_the_loss(tmp_path):
    """`python -m runner SPEC` (what `jobspec run` executes): the reference pass runs, the first loss is
    (1 / (2 beta))^2 (the policy is its reference), and training lowers it as the margins grow."""
    data = th.write_jsonl(tmp_path / "p.jsonl", text_pairs())
    sections = {"data": {"path": str(data), "max_seq_len": 64}, "checkpoints": {"every_steps": 10},
                "training": {"objective": "ipo", "beta": 0.5, "global_batch": 4, "learning_rate": 2e-3,
                             "warmup_steps": 0, "steps": 10}}  # fmt: skip
    spec = th.write_spec(tmp_path / "s.yaml", th.tiny_spec_dict(tmp_path / "run", **sections))
    result = th.run_supervisor([str(spec)])
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert "DPO reference" in result.stderr  # the reference machinery's log (runner/train/reference.py)
    train = th.records(tmp_path / "run")
    assert set(METRICS) <= train[0].keys()
    assert train[0]["loss"] == pytest.approx(1.0, abs=1e-4) and abs(train[0]["rewards/margins"]) < 1e-4
    assert train[-1]["loss"] < 0.5 * train[0]["loss"], [r["loss"] for r in train]
    assert train[-1]["rewards/margins"] > 0.05


def test_ipo_is_planned_like_dpo(tmp_path):
    from jobspec.plan.job_length import job_length
    from jobspec.plan.planner import rows_per_sample

    data = th.write_jsonl(tmp_path / "p.jsonl", text_pairs(10))
    spec = _spec(tmp_path, data)
    assert rows_per_sample(spec) == 2
    assert job_length(spec).reference_tokens == 10 * 2 * 64
