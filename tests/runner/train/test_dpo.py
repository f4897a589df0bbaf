"""DPO: preference pairs read in TRL's conventions, the reference computed once and cached, the sigmoid loss (equal to
TRL's own on the same log-probs), TRL's metrics, and a real tiny model that learns to prefer the chosen answers."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.errors import ConfigError
from runner.data.dataset import load_data
from runner.data.preference import load_preference
from runner.data.tokenizer import ByteTokenizer
from runner.data.tokens import IGNORE
from runner.train.dpo import METRICS, metrics, preference_loss
from tests.runner.train_helpers import (
    records,
    run_supervisor,
    tiny_spec,
    tiny_spec_dict,
    train_and_resume,
    train_in_process,
    write_jsonl,
    write_spec,
)

WORDS = ["red", "blue", "green", "gold", "gray", "pink", "teal", "navy", "lime", "rose", "sand", "jade", "ruby", "mint"]


def text_pairs(n: int = 28) -> list[dict]:
    return [{"prompt": f"name a colour {i}", "chosen": f"{WORDS[i % len(WORDS)]}.", "rejected": f"no {i}, I won't."}
            for i in range(n)]  # fmt: skip


def chat_pairs(n: int = 28) -> list[dict]:
    """The text pairs in the conversational layout (a prompt list, one assistant message each)."""
    return [{"prompt": [{"role": "user", "content": p["prompt"]}],
             "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in text_pairs(n)]  # fmt: skip


def dpo(tmp_path, data, model=None, cache=None, **training):
    return tiny_spec(tmp_path / "run", data={"path": str(data), "max_seq_len": 64, "cache_dir": cache},
                     training={"objective": "dpo", "beta": 0.1, "global_batch": 4, "learning_rate": 1e-3,
                               "warmup_steps": 0, "steps": 8, **training},
                     checkpoints={"every_steps": 6}, model=model or {})  # fmt: skip


def test_text_and_conversational_pairs_give_the_same_rows_masked_to_the_completion(tmp_path):
    text, chat = write_jsonl(tmp_path / "t.jsonl", text_pairs()), write_jsonl(tmp_path / "c.jsonl", chat_pairs())
    tok = ByteTokenizer()
    a = load_preference(dpo(tmp_path, text), tok)
    b = load_preference(dpo(tmp_path, chat), tok)
    assert len(a.train) + len(a.eval) == len(b.train) + len(b.eval) == 2 * 28  # pairs held out by data.eval_fraction
    assert len(a.eval) == 2 and a.eval_order() == [0]
    for r in range(len(a.train)):
        (xa, ya), (xb, yb) = a.train[r], b.train[r]
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    batch = a.collate([0, 1])
    assert batch.input_ids.shape[0] == 4 and batch.targets == 2  # chosen 0, chosen 1, rejected 0, rejected 1
    _, y = a.train[0]  # pair 0's chosen: only the answer and its end-of-turn are targets
    answer = len(b"red.") + 1
    assert int((y != IGNORE).sum()) == answer and (y[: len(y) - answer] == IGNORE).all()


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ({"prompt": "p", "chosen": "a"}, "'rejected' is missing"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "'prompt' is int"),
        (
            {"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "assistant", "content": "y"}]},
            "'chosen' holds no assistant message",
        ),
        ({"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "y"}]}, "both must be strings"),
    ],
)
def test_a_bad_pair_names_the_file_line_and_field(tmp_path, line, words):
    data = write_jsonl(tmp_path / "p.jsonl", [text_pairs(1)[0], line])
    with pytest.raises(ConfigError, match=rf"p\.jsonl:2: .*{words}"):
        load_preference(dpo(tmp_path, data), ByteTokenizer())


def test_pairs_need_dpo_and_dpo_needs_pairs(tmp_path):
    pairs = write_jsonl(tmp_path / "p.jsonl", text_pairs(4))
    sft = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "response": "b"}] * 4)
    with pytest.raises(ConfigError, match=r"p\.jsonl:1: a preference pair .*objective: dpo, ipo, simpo or orpo"):
        load_data(tiny_spec(tmp_path / "run", data={"path": str(pairs)}), ByteTokenizer())
    with pytest.raises(ConfigError, match=r"s\.jsonl:1: a preference objective .* needs preference pairs"):
        load_preference(dpo(tmp_path, sft), ByteTokenizer())
    with pytest.raises(ConfigError, match=r"data\.streaming: false"):
        tiny_spec(tmp_path / "run", data={"path": str(pairs), "streaming": True}, training={"objective": "dpo"})
    with pytest.raises(ConfigError, match="beta"):
        tiny_spec(tmp_path / "run", training={"objective": "dpo", "beta": 0})


def test_a_bad_pair_in_the_worker_exits_2_without_traceback(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [text_pairs(1)[0], {"prompt": "p", "chosen": "a"}])
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", data={"path": str(data)},
                                                         training={"objective": "dpo", "global_batch": 2}))  # fmt: skip
    result = run_supervisor([str(spec)])
    assert result.returncode == EXIT_CONFIG, result.stderr[-2000:]
    assert "p.jsonl:2: 'chosen' is str and 'rejected' is missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_dpo_starts_at_ln2_learns_the_pairs_and_reads_its_reference_back(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", text_pairs())
    code, worker = train_in_process(dpo(tmp_path, data))
    assert code == EXIT_OK
    train = records(tmp_path / "run")
    assert abs(train[0]["loss"] - math.log(2)) < 1e-4  # the policy is its reference at the first step
    assert abs(train[0]["rewards/margins"]) < 1e-4 and set(METRICS) <= train[0].keys()
    late = [r["rewards/accuracies"] for r in train[-4:]]
    assert np.mean(late) > 0.5 and train[-1]["loss"] < math.log(2), [r["loss"] for r in train]
    stored = list((tmp_path / "run" / "data-cache").glob("*.reference-*.npy"))
    assert len(stored) == 1
    values = np.load(stored[0])
    assert values.shape == (56,) and (values < 0).all()  # 28 pairs, none dropped (one held out for eval)
    # The trained pairs' reference: the starting model's, stored, and the one a new process reads back.
    assert np.array_equal(worker.data.reference["train"].reshape(-1), values[worker.data.train.records])


def test_with_lora_the_reference_is_the_base_with_the_adapter_off(tmp_path):
    from runner.train.recipe import Recipe
    from runner.train.reference import score_records

    data = write_jsonl(tmp_path / "p.jsonl", text_pairs())
    worker = Recipe(dpo(tmp_path, data, model={"lora": {"rank": 4, "targets": ["c_attn", "mlp.c_proj"]}},
                        learning_rate=3e-3, steps=4))  # fmt: skip
    try:
        worker.setup()
        assert worker.train() == EXIT_OK
        d = worker.data
        base = score_records(worker.stepper, d.train.streams, d.pad_id, d.max_seq_len, 8)
    finally:
        worker.cleanup()
    train = records(tmp_path / "run")
    assert abs(train[0]["loss"] - math.log(2)) < 1e-4 and train[-1]["loss"] < math.log(2)
    # The trained adapters moved the policy; with them off, the model scores the pairs as at the start.
    assert abs(train[-1]["rewards/margins"]) > 1e-3
    np.testing.assert_allclose(base[d.train.records].reshape(-1, 2), d.reference["train"], atol=1e-4)


def test_a_damaged_stored_reference_is_computed_again(tmp_path, caplog):
    data = write_jsonl(tmp_path / "p.jsonl", text_pairs(8))
    cache = tmp_path / "cache"
    assert train_in_process(dpo(tmp_path / "a", data, cache=str(cache), steps=1, eval_every=None))[0] == EXIT_OK
    (stored,) = cache.glob("*.reference-*.npy")
    good = np.load(stored)
    stored.write_bytes(stored.read_bytes()[:-8])  # a truncated file
    with caplog.at_level("INFO", logger="jobspec.runner"):
        assert train_in_process(dpo(tmp_path / "b", data, cache=str(cache), steps=1))[0] == EXIT_OK
    assert "damaged" in caplog.text and "records scored by the starting model" in caplog.text
    np.testing.assert_array_equal(np.load(stored), good)


@pytest.mark.parametrize("forge", ["shifted", "another job's"])
def test_a_rewritten_stored_reference_is_found_and_computed_again(tmp_path, caplog, forge):
    """Without JOBSPEC_CHECKPOINT_KEY a reference file in a shared cache can be rewritten with values of the right
    shape, or be another job's: records scored again at the start catch it (the first DPO loss was 0.474 or 0.708
    with such a file, not ln 2)."""
    data = write_jsonl(tmp_path / "p.jsonl", text_pairs(8))
    cache = tmp_path / "cache"
    assert train_in_process(dpo(tmp_path / "a", data, cache=str(cache), steps=1, eval_every=None))[0] == EXIT_OK
    (stored,) = cache.glob("*.reference-*.npy")
    good = np.load(stored)
    planted = good + 0.7 if forge == "shifted" else np.roll(good, 1)
    np.save(stored, planted)
    with caplog.at_level("INFO", logger="jobspec.runner"):
        assert train_in_process(dpo(tmp_path / "b", data, cache=str(cache), steps=1, eval_every=None))[0] == EXIT_OK
    assert "does not hold this model's log-probs" in caplog.text
    assert "records scored by the starting model" in caplog.text
    np.testing.assert_allclose(np.load(stored), good, rtol=1e-6)
    assert abs(records(tmp_path / "b" / "run")[0]["loss"] - math.log(2)) < 1e-4
    caplog.clear()
    with caplog.at_level("INFO", logger="jobspec.runner"):  # the file as the model would write it passes the check
        assert train_in_process(dpo(tmp_path / "c", data, cache=str(cache), steps=1, eval_every=None))[0] == EXIT_OK
    assert "log-probs from" in caplog.text and "does not hold" not in caplog.text


def test_dpo_resumes_exactly_with_the_stored_reference(tmp_path, caplog):
    data = write_jsonl(tmp_path / "p.jsonl", text_pairs())
    sections = {"data": {"path": str(data), "max_seq_len": 64, "cache_dir": str(tmp_path / "cache")},
                "training": {"objective": "dpo", "global_batch": 4, "learning_rate": 1e-3, "warmup_steps": 0,
                             "steps": 8},
                "checkpoints": {"every_steps": 4}}  # fmt: skip
    with caplog.at_level("INFO", logger="jobspec.runner"):
        full, part = train_and_resume(tmp_path, sections, at=4)
    assert "log-probs from" in caplog.text  # the second run read the reference the first one stored
    assert np.array_equal(full.data.reference["train"], part.data.reference["train"])
    a = {r["step"]: r for r in records(tmp_path / "full")}
    b = {r["step"]: r for r in records(tmp_path / "part")}
    for step in (5, 6, 7, 8):
        for key in ("loss", *METRICS):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (step, key)


def _trl_loss_and_metrics(chosen, rejected, ref_chosen, ref_rejected, beta):
    """TRL's DPOTrainer loss and metrics (its own `_compute_loss`, sigmoid) on given sequence log-probs: a model whose
    per-token log-probs are those sums at one completion token each."""
    trl = pytest.importorskip("trl")
    pairs = len(chosen)
    logps = torch.cat([chosen, rejected])[:, None]
    out = SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps), mean_logits=torch.zeros_like(logps),
                          is_top1=torch.zeros_like(logps, dtype=torch.bool))  # fmt: skip
    same = lambda t: t  # noqa: E731  # one process: gather is the identity
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SimpleNamespace(device="cpu", gather=same,
                                                                          gather_for_metrics=same),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    ids = torch.zeros(2 * pairs, 2, dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": torch.ones_like(ids),
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}  # fmt: skip
    loss = trl.DPOTrainer._compute_loss(trainer, lambda **_: out, inputs, False)
    return float(loss), {k: v[0] for k, v in trainer._metrics["train"].items()}


def test_the_loss_and_rewards_equal_trls_on_the_same_log_probs():
    g = torch.Generator().manual_seed(0)
    pairs, beta = 16, 0.3
    chosen, rejected = -40 * torch.rand(pairs, generator=g), -40 * torch.rand(pairs, generator=g)
    ref = -40 * torch.rand(pairs, 2, generator=g, dtype=torch.float64)
    trl_loss, trl_metrics = _trl_loss_and_metrics(chosen, rejected, ref[:, 0].float(), ref[:, 1].float(), beta)
    loss, sums = preference_loss(torch.cat([chosen, rejected]), ref, beta)
    ours = metrics(sums.tolist(), pairs)
    assert float(loss) / pairs == pytest.approx(trl_loss, abs=1e-5)
    for name in METRICS:
        assert ours[name] == pytest.approx(trl_metrics[name], abs=1e-5), name


def test_an_oom_shrinks_a_dpo_step_to_fewer_pairs_with_the_same_result(tmp_path, monkeypatch):
    from runner.oom.faults import ENV_VAR

    data = write_jsonl(tmp_path / "p.jsonl", text_pairs())
    monkeypatch.setenv(ENV_VAR, "mbs>4")  # a forward of more than 4 rows (2 pairs) runs out of memory
    assert train_in_process(dpo(tmp_path / "shrunk", data, micro_batch=4, steps=4))[0] == EXIT_OK
    monkeypatch.delenv(ENV_VAR)
    assert train_in_process(dpo(tmp_path / "plain", data, micro_batch=2, steps=4))[0] == EXIT_OK
    shrinks = [(e["step"], e["from_micro_batch"], e["to_micro_batch"]) for e in records(tmp_path / "shrunk" / "run",
               "event") if e.get("event") == "oom_shrink"]  # fmt: skip
    assert shrinks == [(1, 4, 2)]
    shrunk, plain = records(tmp_path / "shrunk" / "run"), records(tmp_path / "plain" / "run")
    for a, b in zip(shrunk, plain, strict=True):  # the pairs stay together: the same pairs, the same step
        for key in ("loss", *METRICS):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)


def test_an_oom_in_the_reference_pass_halves_its_forwards(tmp_path, caplog):
    from runner.train.recipe import Recipe
    from runner.train.reference import score_records

    data = write_jsonl(tmp_path / "p.jsonl", text_pairs(8))
    worker = Recipe(dpo(tmp_path, data, steps=1))
    try:
        worker.setup()
        d, model = worker.data, worker.accelerator.unwrap_model(worker.model)
        plain = score_records(worker.stepper, d.train.streams, d.pad_id, d.max_seq_len, 8)
        most = [2]  # rows a forward may have before it runs out of memory (a real torch.OutOfMemoryError)

        def oom(_module, args, kwargs):
            rows = (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[0]
            if rows > most[0]:
                raise torch.OutOfMemoryError(f"CUDA out of memory (test: {rows} rows)")

        hook = model.register_forward_pre_hook(oom, with_kwargs=True)
        try:
            with caplog.at_level("WARNING", logger="jobspec.runner"):
                shrunk = score_records(worker.stepper, d.train.streams, d.pad_id, d.max_seq_len, 8)
            most[0] = 0
            with pytest.raises(ConfigError, match="out of memory one sequence at a time"):
                score_records(worker.stepper, d.train.streams, d.pad_id, d.max_seq_len, 8)
        finally:
            hook.remove()
    finally:
        worker.cleanup()
    assert "8 -> 4 rows" in caplog.text and "4 -> 2 rows" in caplog.text
    np.testing.assert_allclose(shrunk, plain, atol=1e-4)


def test_a_dpo_pair_is_planned_and_probed_as_two_sequences(tmp_path):
    """The memory plan counts a pair's two rows (memory.estimate `rows`): a DPO micro-batch of m pairs needs what m
    SFT samples of twice the rows need, more than the same SFT spec; the probe step runs 2m sequences."""
    from jobspec.plan import memory
    from jobspec.plan.planner import estimate_kwargs, model_shape, rows_per_sample
    from runner.train.step import Stepper

    spec = dpo(tmp_path, write_jsonl(tmp_path / "pairs.jsonl", text_pairs()))
    sft = tiny_spec(tmp_path / "sft")
    assert rows_per_sample(spec) == 2 and rows_per_sample(sft) == 1
    shape = model_shape(spec)
    kw = estimate_kwargs(spec, 1, "fp32")
    pair = memory.estimate(shape, tier="fast", micro_batch=2, **kw)
    rows = memory.estimate(shape, tier="fast", micro_batch=4, **{**kw, "rows": 1})
    one = memory.estimate(shape, tier="fast", micro_batch=2, **{**kw, "rows": 1})
    assert pair.activations == rows.activations > one.activations
    seen = {}

    class Probe(SimpleNamespace):
        def _micro_step(self, batch, scale):
            seen["rows"] = batch.input_ids.shape[0]
            raise RuntimeError("stop")

    probe = Probe(rows=2, model_vocab=lambda: 50, inner=SimpleNamespace(param_groups=[], zero_grad=lambda **k: None),
                  faults=lambda *a: __import__("contextlib").nullcontext(), manual_sync=False)  # fmt: skip
    with pytest.raises(RuntimeError, match="stop"):
        Stepper.probe_step(probe, 3, 16)
    assert seen["rows"] == 6
