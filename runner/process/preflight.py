"""Checks the supervisor runs before any heavy import: a mistake costs a second, not a minute of imports.

Everything here is light (no torch, transformers or accelerate): which packages exist is asked of
importlib without importing them (flash_attn for `model.attention: flash_attention_2` among them), data
sources are looked at on disk, fault rules are parsed as text.
`check(spec)` raises ConfigError (exit 2) with the fix; `finished(spec)` tells a re-run of a job that
has nothing left to do.
"""

from __future__ import annotations

import logging
from importlib.util import find_spec
from pathlib import Path

from jobspec.errors import ConfigError
from jobspec.plan.planner import model_shape
from jobspec.spec.models import JobSpec
from jobspec.spec.rules import flash_attention_problems
from runner.data import records
from runner.oom.faults import rules_from_env
from runner.output import tracking

log = logging.getLogger("jobspec.runner")
RUNNER_PACKAGES = ("torch", "transformers", "accelerate", "peft", "safetensors")
RUNNER_EXTRA = "pip install 'jobspec-k8s[runner]'  (from a checkout: pip install -e '.[runner]')"
DATA_EXTRA = "pip install 'jobspec-k8s[data]'"
EVAL_EXTRA = "pip install 'jobspec-k8s[eval]' (the runner images carry it; an image of your own needs it)"
# What each kind of data source needs beyond the runner extra.
DATA_PACKAGES = {"parquet": ("pyarrow",), "datasets": ("datasets",), "hub": ("datasets",)}
LIGER_FIX = (
    "pip install 'jobspec-k8s[liger]' in the image (the CUDA image carries it), or set training.loss_kernel: chunked "
    "(the same loss in plain PyTorch)"
)
FLASH_ATTN_FIX = (
    "install it in the image (pip install flash-attn --no-build-isolation; on ROCm, AMD's ROCm/flash-attention "
    "build) or set model.attention: sdpa"
)


def check(spec: JobSpec) -> None:
    """Runner packages, data sources, fault rules and tracker clients; ConfigError naming the fix."""
    missing = [name for name in RUNNER_PACKAGES if find_spec(name) is None]
    if missing:
        raise ConfigError(f"training here needs the runner extra ({', '.join(missing)} not installed): {RUNNER_EXTRA}")
    for field, source in data_sources(spec):
        kind = records.source_kind(source, field)  # raises for a missing file, an unknown format
        lacking = [name for name in DATA_PACKAGES.get(kind, ()) if find_spec(name) is None]
        if lacking:
            raise ConfigError(f"{field} {source} ({kind}) needs {', '.join(lacking)}: {DATA_EXTRA}")
    shape = model_shape(spec)  # the model's config.json checked (jobspec.catalog.model_config) before workers build it
    rules_from_env()  # bad JOBSPEC_FAULT_OOM text: ConfigError naming the variable
    tracking.check_packages(spec)
    if spec.eval.benchmarks and find_spec("lm_eval") is None:  # rank 0 builds the tasks before training (worker.py)
        raise ConfigError(f"eval.benchmarks needs lm-evaluation-harness, not installed here: {EVAL_EXTRA}, or drop "
                          "eval.benchmarks (`jobspec eval RUN_DIR` runs them where it is installed)")  # fmt: skip
    check_attention(spec)
    if spec.training.loss_kernel == "liger" and (find_spec("liger_kernel") is None or find_spec("triton") is None):
        raise ConfigError(f"training.loss_kernel liger needs liger-kernel and triton, not installed here: {LIGER_FIX}")
    liger_blocks = spec.training.block_kernels == "liger"
    if liger_blocks and (find_spec("liger_kernel") is None or find_spec("triton") is None):
        raise ConfigError("training.block_kernels liger needs liger-kernel and triton, not installed here: pip "
                          "install 'jobspec-k8s[liger]' in the image (the CUDA image carries it), or set "
                          "training.block_kernels: plain")  # fmt: skip
    if liger_blocks:  # a family Liger has no kernels for: before any worker builds the model
        from runner.internals import liger_blocks_for

        liger_blocks_for(shape.model_type or shape.family)  # a preset's shape names its family only
    if spec.memory.tier == "zero2_offload" and spec.hardware.vendor != "cpu" and find_spec("torchao") is None:
        raise ConfigError(
            "memory.tier zero2_offload steps the optimizer on the host with torchao, which is not installed: "
            "pip install 'jobspec-k8s[offload]' (the CUDA and ROCm images carry it), or choose another memory.tier"
        )
    if spec.model.quantize != "none" and find_spec("torchao") is None:
        raise ConfigError(
            f"model.quantize {spec.model.quantize} holds the base in 4 bits with torchao's NF4, not installed here: "
            "pip install 'jobspec-k8s[offload]' (the CUDA and ROCm images carry it), or set model.quantize: none"
        )


def data_sources(spec: JobSpec) -> list[tuple[str, str]]:
    """(field, path) of every data source the spec names: data.path or each data.sources[i].path, data.eval_path."""
    named = [("data.path", spec.data.path)]
    named += [(f"data.sources[{i}].path", s.path) for i, s in enumerate(spec.data.sources or ())]
    return [(field, path) for field, path in [*named, ("data.eval_path", spec.data.eval_path)] if path is not None]


def check_attention(spec: JobSpec) -> None:
    """`model.attention: flash_attention_2` must be runnable as asked, never quietly replaced by sdpa.

    Without the flash_attn package transformers raises an ImportError only once the model is built (after
    a minute of imports and the weights' load), or, where the `kernels` package is installed, fetches a
    flash kernel from the Hub, which a pod without network cannot. The kernel also needs a GPU and 16-bit
    inputs: with `hardware.vendor: cpu` or `training.precision: fp32` it fails in the first forward pass
    (jobspec/spec/rules.py refuses those when the spec loads; the same rule is asked again here).
    """
    if spec.model.attention != "flash_attention_2":
        return
    for field, message, hint in flash_attention_problems(spec):  # the spec's own rule, for a spec built past it
        raise ConfigError(f"{field} {message}: {hint}")
    asked = "model.attention flash_attention_2"
    if find_spec("flash_attn") is None:
        raise ConfigError(f"{asked} needs the flash_attn package, which is not installed here: {FLASH_ATTN_FIX}")


def finished(spec: JobSpec) -> str | None:
    """A message when the run directory already holds the last step and its export; None otherwise.

    Read from the newest complete checkpoint's meta.json (total_steps as that run computed it) and the
    export's provenance; anything unreadable, or a newest checkpoint that fails its manifest, means "not
    known to be finished" and the workers decide (they resume from the newest intact one).
    """
    from runner.checkpoint.steps import latest

    root = Path(spec.run_dir)  # with an object store: what this pod has staged (the workers read the bucket)
    newest = latest(root)
    if newest is None:  # a fresh run: no torch imported here (runner/checkpoint/steps.py)
        return None
    from runner.checkpoint import files, store

    if store.verify(newest) is not None:
        return None
    try:
        meta = store.read_meta(newest)
        step, total = int(meta["step"]), int(meta["total_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    wanted = spec.training.steps if spec.training.steps is not None else total  # epochs: as computed then
    if step < wanted or step != total:
        return None
    out = Path(spec.export_dir)
    if spec.output.export:
        try:
            exported = files.read_json(out / "jobspec_export.json", 2**20, "provenance file")  # no FIFO/link hang
        except (OSError, ValueError):
            return None
        if exported.get("step") != step:
            return None
    where = f"; the model is at {out}" if spec.output.export else ""
    return (
        f"nothing to do: {newest} is step {step} of {total}, the run is complete{where}. To train again, "
        f"point checkpoints.dir at an empty directory (or remove {root}); to train longer, raise training.steps"
    )
