"""Which checkpoints a run may continue: the same job, model, data and global batch, or an explicit `force`.

Every checkpoint's meta.json carries a `lineage`: the fields whose change would make a resume continue a
different training (job name, model, data and its token rows, global batch, seed). On resume they are
compared with the spec's; a difference is refused before any work, naming each field with both values,
unless `checkpoints.resume: force`. Everything else may change on a resume and is only logged: the
micro-batch (it never changes the training, only how it is cut), learning rate, steps, tier, hardware.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np

from jobspec.errors import ConfigError
from jobspec.spec.models import JobSpec

log = logging.getLogger("jobspec.runner")
# Data settings that change which token rows exist (num_workers, pvc and mount_path do not).
DATA_FIELDS = ("path", "format", "prompt_field", "response_field", "messages_field", "max_seq_len", "packing",
               "eval_path", "eval_fraction")  # fmt: skip


def rows_digest(rows: list[tuple[np.ndarray, np.ndarray]]) -> str:
    """A cheap fingerprint of the token rows: their count, every length, and the first and last 64 rows."""
    lengths = getattr(rows, "lengths", None)  # runner.data.tokens.Rows: all lengths without building each row
    h = hashlib.sha256(np.asarray([len(x) for x, _ in rows] if lengths is None else lengths, dtype=np.int64).tobytes())
    for x, y in rows[:64] + rows[-64:]:
        h.update(x.tobytes())
        h.update(y.tobytes())
    return f"{len(rows)}:{h.hexdigest()[:16]}"


def lineage(spec: JobSpec, train_rows: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """The values a resume must find unchanged, by field path."""
    # Where the hub cache lives and which Secret holds the token never change the training.
    model = spec.model.model_dump(mode="json", exclude={"attention", "hub_cache", "hub_token"})
    # several sources: their paths, weights and formats make the samples (a name is only a label in the metrics)
    sources = {"sources": {"__all__": {"path", "weight", "format"}}}
    data = spec.data.model_dump(mode="json", include={**dict.fromkeys(DATA_FIELDS, True), **sources})
    if spec.data.text_field != "text":  # text records' field (at its default left out, as for every run before it)
        data["text_field"] = spec.data.text_field
    if spec.data.streaming:  # a stream's order (only then: the lineage of every other run stays as it was)
        data |= {"streaming": True, "shuffle_buffer": spec.data.shuffle_buffer}
    objective = {}  # only for a preference objective: the lineage of every SFT run stays as it was
    if spec.training.objective != "sft":
        objective = {"training.objective": spec.training.objective, "training.beta": spec.training.beta}
        if spec.training.objective == "simpo":
            objective["training.simpo_gamma"] = spec.training.gamma
        if spec.training.grpo is not None:  # its sampling, rewards and loss make the trained steps (the sampling
            # filters added since only where set: a run from before them resumes as it was)
            grpo = spec.training.grpo
            later = {k for k, off in (("top_k", 0), ("top_p", 1.0), ("min_p", None), ("loss_type", "dapo"),
                                      ("repetition_penalty", 1.0), ("num_iterations", 1), ("epsilon", 0.2),
                                      ("epsilon_high", None), ("sapo_temperature_pos", 1.0),
                                      ("sapo_temperature_neg", 1.05)) if getattr(grpo, k) == off}  # fmt: skip
            objective["training.grpo"] = grpo.model_dump(mode="json", exclude=later)
        if spec.training.objective == "kto":
            objective |= {"training.desirable_weight": spec.training.desirable_weight,
                          "training.undesirable_weight": spec.training.undesirable_weight}  # fmt: skip
    # SGD keeps no state an AdamW could resume from, nor the reverse (only where set: every other run's stays as it was)
    optimizer = {"training.optimizer": "sgd"} if spec.training.optimizer == "sgd" else {}
    return {
        **objective,
        **optimizer,
        "name": spec.name,
        **{f"model.{k}": v for k, v in model.items()},
        **{f"data.{k}": v for k, v in data.items()},
        "data (token rows)": rows_digest(train_rows),
        "training.global_batch": spec.training.global_batch,
        "training.seed": spec.training.seed,
    }


def check_resume(saved: dict[str, Any] | None, now: dict[str, Any], *, where: str, force: bool) -> None:
    """Refuse (ConfigError, exit 2) a resume across a change of lineage, unless forced (then warn)."""
    if saved is None:
        log.warning("%s has no lineage (written by an older jobspec): resuming without checking it", where)
        return
    keys = [*now, *(k for k in saved if k not in now)]  # a value only one side has changed too (streaming on/off)
    changed = [(k, saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)]
    if not changed:
        return
    lines = "\n".join(f"  {k}: checkpoint {_show(old)}, spec now {_show(new)}" for k, old, new in changed)
    if force:
        log.warning("checkpoints.resume force: resuming %s although these changed:\n%s", where, lines)
        return
    raise ConfigError(
        f"{where} belongs to a different training than this spec; resuming it would not continue the same run:\n"
        f"{lines}\n"
        "  to start fresh: point checkpoints.dir at an empty directory (or remove the old one);\n"
        "  to fine-tune from it: export it (jobspec export) and use the export as model.path;\n"
        "  to resume anyway: set checkpoints.resume: force"
    )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
