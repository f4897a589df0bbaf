"""Trackers: TensorBoard gets the same numbers as metrics.jsonl; a missing client or an inline key is exit 2."""

from __future__ import annotations

import importlib.util

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.errors import ConfigError, SpecError
from jobspec.render import render
from runner.output.tracking import scalars
from tests.runner.train_helpers import records, run_supervisor, tiny_spec, tiny_spec_dict, train_in_process, write_spec


def test_tensorboard_event_files_hold_the_loss_of_every_logged_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    code, _ = train_in_process(tiny_spec(run, tracking={"tensorboard": True}, training={"eval_every": 4}))
    assert code == EXIT_OK
    logdir = next((run / "tensorboard").iterdir())  # <logdir>/<run name>
    acc = EventAccumulator(str(logdir)).Reload()
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    expected = {r["step"]: r["loss"] for r in records(run)}
    assert loss.keys() == expected.keys()
    assert all(loss[s] == pytest.approx(expected[s], rel=1e-6) for s in loss)
    assert {e.step for e in acc.Scalars("eval/loss")} == {4, 8}
    assert {"train/lr", "train/tokens_per_s", "train/micro_batch"} <= set(acc.Tags()["scalars"])


def test_a_tracker_whose_client_is_missing_fails_before_training(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    spec = tiny_spec(tmp_path / "run", tracking={"wandb": {"project": "p"}})
    from runner.train.recipe import Recipe

    with pytest.raises(ConfigError, match=r"tracking.wandb: .*pip install wandb"):
        Recipe(spec)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_the_runner_exits_2_when_the_wandb_client_is_not_installed(tmp_path):
    spec = tiny_spec_dict(tmp_path / "run", tracking={"wandb": {"project": "p", "mode": "offline"}})
    result = run_supervisor([str(write_spec(tmp_path / "s.yaml", spec))], timeout=300)
    assert result.returncode == EXIT_CONFIG, result.stderr[-2000:]
    assert "pip install wandb" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("where", ["wandb.api_key", "mlflow.token", "mlflow.password"])
def test_an_inline_tracker_credential_is_refused_and_never_echoed(tmp_path, where):
    section, key = where.split(".")
    value = "abcd1234efgh5678ijkl9012mnop3456qrst7890"
    body = {"project": "p"} if section == "wandb" else {}
    with pytest.raises(SpecError) as err:
        tiny_spec(tmp_path, tracking={section: {**body, key: value}})
    assert f"tracking.{where}" in str(err.value) and "Secret" in str(err.value)
    assert value[:8] not in str(err.value)


def test_tracker_credentials_render_as_secret_references():
    spec = tiny_spec(
        "/ckpt",
        tracking={
            "wandb": {"project": "proj", "api_key": {"secret": "wandb", "key": "api-key"}},
            "mlflow": {"tracking_uri": "https://mlflow.example", "token": {"secret": "mlf", "key": "t"}},
        },
    )
    job = next(o for o in render(spec) if o["kind"] == "Job")
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
    assert env["MLFLOW_TRACKING_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "mlf", "key": "t"}}
    assert env["WANDB_PROJECT"]["value"] == "proj" and env["MLFLOW_TRACKING_URI"]["value"] == "https://mlflow.example"


def test_tracker_values_are_the_records_numbers():
    rec = {"kind": "train", "step": 3, "loss": 1.5, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 10.0,
           "micro_batch": 4, "grad_accum": 2, "gpu_util": None, "mem_used_bytes": 2 * 1024**3}  # fmt: skip
    assert scalars(rec) == {"train/loss": 1.5, "train/lr": 1e-3, "train/tokens_per_s": 10.0,
                            "train/micro_batch": 4.0, "train/grad_accum": 2.0, "train/mem_used_gib": 2.0}  # fmt: skip
    assert scalars({"kind": "eval", "step": 3, "eval_loss": 2.0}) == {"eval/loss": 2.0}
    assert scalars({"kind": "plan", "step": 0}) == {} and scalars({"kind": "event", "step": 1}) == {}


def test_a_preference_run_gives_the_trackers_trls_metrics(tmp_path):
    """DPO's TRL-named metrics reach TensorBoard as train/<name>, with the records' values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.runner.train.test_dpo import dpo, text_pairs
    from tests.runner.train_helpers import write_jsonl

    data = write_jsonl(tmp_path / "p.jsonl", text_pairs(12))
    spec = dpo(tmp_path, data, steps=3, eval_every=None)
    spec = type(spec).model_validate({**spec.model_dump(mode="json", exclude_unset=True),
                                      "tracking": {"tensorboard": True}})  # fmt: skip
    assert train_in_process(spec)[0] == EXIT_OK
    acc = EventAccumulator(str(next((tmp_path / "run" / "tensorboard").iterdir()))).Reload()
    margins = {e.step: e.value for e in acc.Scalars("train/rewards/margins")}
    assert margins == pytest.approx({r["step"]: r["rewards/margins"] for r in records(tmp_path / "run")}, rel=1e-5)
    assert {"train/rewards/accuracies", "train/logps/chosen"} <= set(acc.Tags()["scalars"])
    assert scalars({"kind": "train", "step": 1, "router_aux_loss": 2.5}, ("router_aux_loss",)) == {
        "train/router_aux_loss": 2.5}
