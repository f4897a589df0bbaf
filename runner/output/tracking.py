"""Experiment trackers (TensorBoard, W&B, MLflow) through accelerate's tracker classes, on rank 0 only.

`metrics.jsonl` stays the canonical record; the trackers get the same numbers as it, under
`train/...` and `eval/...` names (benchmarks: `eval/<task>/<metric>`), at the optimizer step. Credentials never
pass through here: the pod gets them as env vars from Secrets (jobspec/render/env.py) and each client reads its own.

The tracker objects are accelerate's (`TensorBoardTracker`, `WandBTracker`, `MLflowTracker`), used
directly rather than through one `Accelerator`: the runner rebuilds its accelerator when it changes
tier, and the run in the trackers must not restart with it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jobspec.errors import ConfigError
from jobspec.spec.models import JobSpec

log = logging.getLogger("jobspec.runner")
GiB = 1024**3
# The client package each tracker needs, and the pip name that brings it.
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
TRAIN_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "micro_batch", "grad_accum", "gpu_util")


def wanted(spec: JobSpec) -> list[str]:
    t = spec.tracking
    return [name for name in PACKAGES if getattr(t, name) is not None]


def check_packages(spec: JobSpec) -> None:
    """ConfigError (exit 2) before any training when a tracker the spec names cannot be imported."""
    missing = [name for name in wanted(spec) if importlib.util.find_spec(PACKAGES[name][0]) is None]
    if missing:
        pips = " ".join(PACKAGES[name][1] for name in missing)
        raise ConfigError(
            f"tracking.{missing[0]}: the {', '.join(missing)} client is not installed in this environment; "
            f"install it (pip install {pips}) or remove tracking.{missing[0]} from the spec"
        )


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """Nested spec/plan values as flat hyperparameters (`training.global_batch: 32`); lists as text."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{name}."))
        elif isinstance(value, (str, int, float, bool)):
            out[name] = value
        elif value is not None:
            out[name] = str(value)
    return out


def scalars(record: Mapping[str, Any], extra: Sequence[str] = ()) -> dict[str, float]:
    """The numbers of one metrics.jsonl record, under tracker names; empty for plans and events. `extra`: the train
    record's fields beyond TRAIN_FIELDS that this run writes (a preference objective's TRL metrics, `rewards/chosen`
    ..., a mixture of experts' `router_aux_loss`), logged as `train/<name>`."""
    kind = record.get("kind")
    if kind == "eval":
        return {"eval/loss": float(record["eval_loss"])} if record.get("eval_loss") is not None else {}
    if kind == "benchmark":  # lm-evaluation-harness: already named eval/<task>/<metric>
        return {k: float(v) for k, v in (record.get("metrics") or {}).items() if isinstance(v, int | float)}
    if kind != "train":
        return {}
    out = {f"train/{k}": float(record[k]) for k in (*TRAIN_FIELDS, *extra) if isinstance(record.get(k), int | float)}
    if record.get("mem_used_bytes") is not None:
        out["train/mem_used_gib"] = record["mem_used_bytes"] / GiB
    return out


class Trackers:
    """The spec's trackers, started on the main rank (a no-op elsewhere and when none is configured)."""

    def __init__(self, spec: JobSpec, run_dir: Path, *, enabled: bool, config: Mapping[str, Any],
                 extra: Sequence[str] = ()):  # fmt: skip
        self.extra = tuple(extra)  # `scalars`' extra train fields
        self.trackers: list[Any] = []
        if not enabled or not wanted(spec):
            return
        check_packages(spec)
        t, run = spec.tracking, spec.tracking.run_name or spec.name
        from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

        if t.tensorboard is not None:
            logdir = Path(t.tensorboard.logdir or run_dir / "tensorboard")
            self.trackers.append(TensorBoardTracker(run, logdir))
        if t.wandb is not None:
            if t.wandb.mode == "offline":
                os.environ.setdefault("WANDB_MODE", "offline")
            self.trackers.append(
                WandBTracker(run, project=t.wandb.project, entity=t.wandb.entity, dir=str(run_dir), resume="allow")
            )
        if t.mlflow is not None:
            if not t.mlflow.tracking_uri and "MLFLOW_TRACKING_URI" not in os.environ:
                os.environ["MLFLOW_TRACKING_URI"] = (run_dir / "mlruns").resolve().as_uri()
            self.trackers.append(MLflowTracker(experiment_name=t.mlflow.experiment or spec.name, run_name=run))
        hparams = _flat(config)
        for tracker in self.trackers:
            tracker.start()
            tracker.store_init_configuration(hparams)
        log.info("trackers: %s", ", ".join(tr.name for tr in self.trackers))

    def log(self, record: Mapping[str, Any]) -> None:
        values = scalars(record, self.extra)
        if not values:
            return
        for tracker in self.trackers:
            try:
                tracker.log(values, step=int(record.get("step") or 0))
            except Exception as err:  # a tracker's outage must not stop training; metrics.jsonl has it all
                log.warning("tracker %s: could not log step %s: %s", tracker.name, record.get("step"), err)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.finish()
            except Exception as err:
                log.warning("tracker %s: could not finish: %s", tracker.name, err)
        self.trackers = []
