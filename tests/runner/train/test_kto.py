"""KTO (`training.objective: kto`): TRL's unpaired {prompt, completion, label} records, each with its KL row (its
prompt and the previous record's completion), the loss and metrics equal to TRL 1.16's own KTOTrainer on a real batch
of a tiny model, a run by the runner that lowers the loss, bad data refused by file, line and field, and the plan's
two rows a record and reference pass."""

from __future__ import annotations

import copy
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.errors import ConfigError
from runner.data.preference import load_preference
from runner.data.tokenizer import ByteTokenizer
from runner.data.tokens import IGNORE
from runner.train import kto
from tests.runner import train_helpers as th
from tests.runner.train.test_dpo import text_pairs


def kto_records(n: int = 28) -> list[dict]:
    """Each text pair as two unpaired records: the chosen answer desirable, the rejected one not."""
    out = []
    for p in text_pairs(n):
        out += [{"prompt": p["prompt"], "completion": p["chosen"], "label": True},
                {"prompt": p["prompt"], "completion": p["rejected"], "label": False}]  # fmt: skip
    return out


def chat_records(n: int = 28) -> list[dict]:
    """The records in TRL's conversational layout (a prompt list and a completion list)."""
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "completion": [{"role": "assistant", "content": r["completion"]}], "label": r["label"]}
            for r in kto_records(n)]  # fmt: skip


def _sections(data, **training) -> dict:
    return {"data": {"path": str(data), "max_seq_len": 64},
            "training": {"objective": "kto", "beta": 0.1, "global_batch": 4, "learning_rate": 1e-3,
                         "warmup_steps": 0, "steps": 8, **training},
            "checkpoints": {"every_steps": 8}}  # fmt: skip


def _spec(tmp_path, data, **training):
    return th.tiny_spec(tmp_path / "run", **_sections(data, **training))


def _split(tokens: np.ndarray, flags: np.ndarray) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a stored record: before and from its first target, as TRL splits them."""
    start = int(np.flatnonzero(flags)[0])
    return tokens[:start].tolist(), tokens[start:].tolist()


def test_each_record_is_its_chat_and_its_kl_row_text_and_conversational_alike(tmp_path):
    text = th.write_jsonl(tmp_path / "t.jsonl", kto_records(6))
    chat = th.write_jsonl(tmp_path / "c.jsonl", chat_records(6))
    a = load_preference(_spec(tmp_path, text), ByteTokenizer())
    b = load_preference(_spec(tmp_path, chat), ByteTokenizer())
    assert len(a.train.streams) == 2 * 12  # every record and its KL row, in file order
    for k in range(len(a.train.streams)):
        assert all(np.array_equal(u, v) for u, v in zip(a.train.streams[k], b.train.streams[k], strict=True))
    streams = a.train.streams
    for i in range(12):  # TRL's add_kl_completion_ids: completions shifted by one (the first gets the last's)
        prompt, _ = _split(*streams[2 * i])
        _, before = _split(*streams[2 * ((i - 1) % 12)])
        kl_ids, kl_flags = streams[2 * i + 1]
        assert kl_ids.tolist() == prompt + before
        assert kl_flags.tolist() == [False] * len(prompt) + [True] * len(before)
    assert a.labels["train"].tolist() == [True, False] * 6
    ids = [0, 1, 2]
    batch = a.collate(ids)
    assert batch.input_ids.shape[0] == 6 and batch.targets == 3  # 3 records' chats, then their 3 KL rows
    records = a.train.records[2 * np.array(ids)] // 2
    assert batch.desirable.tolist() == a.labels["train"][records].tolist()
    _, y = a.train[0]  # only the completion (the answer and its end of turn) is scored
    assert int((y != IGNORE).sum()) == len(_split(*streams[int(a.train.records[0])])[1])


def test_preference_pairs_are_unpaired_as_trl_unpairs_them(tmp_path):
    """TRL's KTOTrainer takes {prompt, chosen, rejected} too (`unpair_preference_dataset`): each pair is two records,
    the chosen completion desirable and the rejected one not; here one after the other, so the rows are those of the
    same records written unpaired."""
    pairs = th.write_jsonl(tmp_path / "p.jsonl", text_pairs(5))
    unpaired = th.write_jsonl(tmp_path / "u.jsonl", kto_records(5))
    a = load_preference(_spec(tmp_path, pairs), ByteTokenizer())
    b = load_preference(_spec(tmp_path, unpaired), ByteTokenizer())
    assert a.labels["train"].tolist() == b.labels["train"].tolist() == [True, False] * 5
    assert len(a.train.streams) == len(b.train.streams) == 20
    for k in range(20):
        assert all(np.array_equal(u, v) for u, v in zip(a.train.streams[k], b.train.streams[k], strict=True))


def _trl_kto(beta: float, weights: tuple[float, float]) -> SimpleNamespace:
    """A stand-in for TRL 1.16's KTOTrainer `self`: what its `_compute_loss` reads (precomputed references, the KL
    term on, loss_type kto)."""
    pytest.importorskip("trl")
    from trl import KTOTrainer

    same = lambda t: t  # noqa: E731  # one process: gathering is the identity
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SimpleNamespace(device=torch.device("cpu"),
                                                                          gather_for_metrics=same),
        calculate_KL=True, precompute_ref_logps=True, loss_type="kto", beta=beta, desirable_weight=weights[0],
        undesirable_weight=weights[1], aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    fake._compute_kl_logps = partial(KTOTrainer._compute_kl_logps, fake)
    return fake


@pytest.mark.parametrize(("kl_shift", "weights"), [(-2.0, (1.0, 1.0)), (3.0, (1.3, 0.7))],
                         ids=["kl-positive", "kl-clamped-weighted"])  # fmt: skip
def test_the_loss_and_metrics_equal_trls_kto_trainer_on_a_real_batch(tmp_path, kl_shift, weights):
    """The step's loss on 6 records of a real tiny model (their KL rows scored without gradients) against references
    moved off the policy, and TRL's own `KTOTrainer._compute_loss` (its collator's batch of the same prompt,
    completion and KL completion ids, its fused LM head, its KL pass and loss): equal to 1e-5. The KL references are
    shifted down (kl > 0) or up (kl clamped at 0)."""
    from trl import KTOTrainer
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference
    from trl.trainer.utils import add_fused_lm_head

    from runner.train.recipe import Recipe

    data_file = th.write_jsonl(tmp_path / "k.jsonl", kto_records(12))
    worker = Recipe(_spec(tmp_path, data_file, steps=1, desirable_weight=weights[0], undesirable_weight=weights[1]))
    try:
        worker.setup()
        stepper, data = worker.stepper, worker.data
        rng = np.random.default_rng(1)
        ref = data.reference["train"]
        data.reference["train"] = ref + np.stack([rng.normal(0, 3, len(ref)), rng.normal(kl_shift, 0.5, len(ref))], 1)
        ids = [0, 2, 3, 5, 8, 11]
        batch = data.collate(ids)
        assert 0 < int(batch.desirable.sum()) < len(ids)
        stepper.preference_sums = []
        loss = float(stepper.loss_sum(batch).detach()) / len(ids)
        ours = stepper.objective.metrics(stepper.preference_sums[0].tolist(), len(ids))
        model = copy.deepcopy(worker.accelerator.unwrap_model(worker.model))
        streams, records = data.train.streams, data.train.records
        examples = []
        for b, i in enumerate(ids):
            prompt, completion = _split(*streams[int(records[2 * i])])
            kl_prompt, kl_completion = _split(*streams[int(records[2 * i + 1])])
            assert kl_prompt == prompt
            examples.append({"prompt_ids": prompt, "completion_ids": completion, "KL_completion_ids": kl_completion,
                             "label": bool(batch.desirable[b]), "ref_logps": float(batch.reference[b, 0]),
                             "ref_KL_logps": float(batch.reference[b, 1])})  # fmt: skip
    finally:
        worker.cleanup()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    trainer = _trl_kto(0.1, weights)
    inputs = DataCollatorForUnpairedPreference(pad_token_id=data.pad_id)(examples)
    with torch.no_grad():
        want = float(KTOTrainer._compute_loss(trainer, model, inputs, False))
    got = {k: v[0] for k, v in trainer._metrics["train"].items()}
    assert loss == pytest.approx(want, abs=1e-5)
    assert (got["kl"] > 0.5) == (kl_shift < 0) and (got["kl"] == 0) == (kl_shift > 0)
    assert set(kto.METRICS) <= set(got)
    for name in kto.METRICS:
        assert ours[name] == pytest.approx(got[name], rel=1e-4, abs=1e-5), name


def test_kto_loss_weighs_each_label_against_the_clamped_kl():
    policy, reference = torch.tensor([-5.0, -6.0, -4.0]), torch.tensor([-6.0, -5.0, -4.0])
    kl_policy, kl_reference = torch.tensor([-8.0, -9.0, -7.0]), torch.tensor([-9.0, -9.5, -7.5])  # kl = 2/3
    desirable = torch.tensor([True, False, True])
    losses, rewards, kl = kto.kto_loss(policy, reference, kl_policy, kl_reference, desirable, 0.5, 2.0, 0.5)
    assert float(kl) == pytest.approx(2 / 3)
    want = [2 * (1 - torch.sigmoid(torch.tensor(0.5 * (1 - 2 / 3)))), 0.5 * (1 - torch.sigmoid(torch.tensor(
        0.5 * (2 / 3 + 1)))), 2 * (1 - torch.sigmoid(torch.tensor(0.5 * (0 - 2 / 3))))]  # fmt: skip
    torch.testing.assert_close(losses, torch.stack(want))
    torch.testing.assert_close(rewards, torch.tensor([0.5, -0.5, 0.0]))
    _, _, clamped = kto.kto_loss(policy, reference, kl_reference, kl_policy, desirable, 0.5)
    assert float(clamped) == 0.0


def test_a_kto_run_by_the_runner_starts_at_one_half_and_lowers_the_loss(tmp_path):
    """`python -m runner SPEC` (what `jobspec run` executes): the reference pass scores every record and KL row, the
    first loss is 1 - sigmoid(0) = 0.5 (the policy is its reference), and training lowers it as the rewards part."""
    data = th.write_jsonl(tmp_path / "k.jsonl", kto_records())
    sections = _sections(data, steps=10, learning_rate=2e-3)
    spec = th.write_spec(tmp_path / "s.yaml", th.tiny_spec_dict(tmp_path / "run", **sections))
    result = th.run_supervisor([str(spec)])
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert "DPO reference" in result.stderr  # the reference machinery's log (runner/train/reference.py)
    stored = list((tmp_path / "run").rglob("*.reference-*.npy"))
    assert len(stored) == 1 and np.load(stored[0]).shape == (2 * 56,)  # 56 records, each with its KL row
    train = th.records(tmp_path / "run")
    first = train[0]
    assert first["loss"] == pytest.approx(0.5, abs=1e-4) and first["kl"] == pytest.approx(0.0, abs=1e-4)
    assert np.mean([r["loss"] for r in train[-3:]]) < 0.4, [r["loss"] for r in train]
    margins = [r["rewards/margins"] for r in train if "rewards/margins" in r]
    assert margins[-1] > 0.5, margins


def test_a_kto_run_resumes_exactly_and_an_oom_shrinks_a_step_with_the_same_records(tmp_path, monkeypatch):
    """Resumed from step 4: the same losses and metrics (the KL rows are fixed per record, the references cached).
    An injected OOM shrinks the first step from 4 records to 2 micro-batches of 2: the loss is the same step's mean
    (each micro-batch keeps its own KL estimate, as TRL's per-batch one, so the loss moves by the estimate only)."""
    from runner.oom.faults import ENV_VAR

    data = th.write_jsonl(tmp_path / "k.jsonl", kto_records())
    sections = _sections(data, steps=6) | {"checkpoints": {"every_steps": 3}}
    th.train_and_resume(tmp_path, sections, at=3)
    a = {r["step"]: r for r in th.records(tmp_path / "full")}
    b = {r["step"]: r for r in th.records(tmp_path / "part")}
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("loss", *(k for k in kto.METRICS if k in a[step])):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (step, key)
    monkeypatch.setenv(ENV_VAR, "mbs>2")  # a forward of more than 2 rows runs out (the KL rows have their own)
    assert th.train_in_process(_spec(tmp_path / "shrunk", data, micro_batch=4, steps=1))[0] == EXIT_OK
    events = th.records(tmp_path / "shrunk" / "run", "event")
    assert [(e["from_micro_batch"], e["to_micro_batch"]) for e in events if e["event"] == "oom_shrink"] == [(4, 2)]
    assert th.records(tmp_path / "shrunk" / "run")[0]["loss"] == pytest.approx(0.5, abs=1e-4)  # policy = reference


BAD = [
    ({"prompt": "p", "completion": "a"}, "k.jsonl:3: 'label' is missing: KTO .* needs a boolean 'label'"),
    ({"prompt": "p", "completion": "a", "label": 1}, "k.jsonl:3: 'label' is int: KTO"),
    ({"prompt": "p", "completion": "a", "label": "true"}, "k.jsonl:3: 'label' is str: KTO"),
    ({"prompt": "p", "label": True}, r"k.jsonl:3: 'completion' is missing: KTO's records .* \{'prompt', 'completion', "
     "'label'}"),
    ({"prompt": 3, "completion": "a", "label": False}, "k.jsonl:3: 'prompt' is int"),
]


@pytest.mark.parametrize(("line", "words"), BAD)
def test_a_bad_record_names_the_file_line_and_field(tmp_path, line, words):
    data = th.write_jsonl(tmp_path / "k.jsonl", [*kto_records(1), line])
    with pytest.raises(ConfigError, match=words):
        load_preference(_spec(tmp_path, data), ByteTokenizer())


@pytest.mark.parametrize("label", [True, False])
def test_records_of_one_label_are_refused(tmp_path, label):
    data = th.write_jsonl(tmp_path / "k.jsonl", [r for r in kto_records(6) if r["label"] is label])
    kind = "true" if label else "false"
    with pytest.raises(ConfigError, match=rf"data\.path .*k\.jsonl: all 6 records have 'label' {kind}.* add records "
                       "of the other label"):  # fmt: skip
        load_preference(_spec(tmp_path, data), ByteTokenizer())


def test_a_missing_label_in_the_worker_exits_2_without_traceback(tmp_path):
    data = th.write_jsonl(tmp_path / "k.jsonl", [*kto_records(2), {"prompt": "p", "completion": "a"}])
    spec = th.write_spec(tmp_path / "s.yaml", th.tiny_spec_dict(tmp_path / "run", **_sections(data)))
    result = th.run_supervisor([str(spec)])
    assert result.returncode == EXIT_CONFIG, result.stderr[-2000:]
    assert "k.jsonl:5: 'label' is missing: KTO (TRL's KTOTrainer) needs a boolean 'label'" in result.stderr
    assert "Traceback" not in result.stderr


def test_kto_is_planned_as_two_rows_a_record_with_a_reference_pass_and_its_fields_checked(tmp_path):
    from jobspec.plan.job_length import job_length
    from jobspec.plan.planner import rows_per_sample

    data = th.write_jsonl(tmp_path / "k.jsonl", kto_records(5))
    spec = _spec(tmp_path, data)
    assert rows_per_sample(spec) == 2
    assert job_length(spec).reference_tokens == 10 * 2 * 64
    assert (spec.training.desirable_weight, spec.training.undesirable_weight) == (1.0, 1.0)  # TRL's defaults
    with pytest.raises(ConfigError, match="desirable_weight"):
        th.tiny_spec(tmp_path, training={"objective": "dpo", "desirable_weight": 2.0})
    with pytest.raises(ConfigError, match="undesirable_weight"):
        th.tiny_spec(tmp_path, training={"objective": "kto", "undesirable_weight": 0})
    with pytest.raises(ConfigError, match=r"data\.format"):
        th.tiny_spec(tmp_path, data={"path": str(data), "format": "preference"}, training={"objective": "kto"})
