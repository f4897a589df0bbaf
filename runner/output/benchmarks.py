"""Benchmarks of an exported model with lm-evaluation-harness: `eval.benchmarks` at the end of a job, `jobspec eval`.

    python -m runner.output.benchmarks RUN_DIR [--tasks T ...] [--limit N] [--batch-size B] [--num-fewshot K]
                                       [--timeout S] [--model EXPORT_DIR]                     (= jobspec eval)

The model is the run's export (runner/output/export.py): a transformers directory, or a PEFT adapter merged into
its base for the evaluation, loaded by transformers onto the GPU when there is one (bf16 where supported, else
fp16; fp32 on the CPU) and handed, with its tokenizer, to lm-eval's HFLM. A task is an lm-eval task or group name
(its data set read by `datasets` through HF_HOME, the shared hub cache) or a task YAML file of the user's, which
lm-eval's TaskManager reads by its path. `check` builds every task before any model is loaded (the job: before
training), so a name lm-eval does not know, a broken YAML or a hub data set that is neither cached nor reachable
(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) is a ConfigError (exit 2) naming the entry, not a failure after hours.

Each entry runs on its own (`lm_eval.simple_evaluate`), one after another, under one deadline
(`eval.timeout_seconds`): every forward pass checks it, so a task still running then stops (`Timeout`), its
partial results are dropped and the entries after it are skipped; the results already written stay.
Results: per task (a group's subtasks too) one record in metrics.jsonl,
    {"kind": "benchmark", "step", "task", "metrics": {"eval/<task>/<metric>": value, ...}, "samples", "limit",
     "num_fewshot", "seconds"}
where <metric> is lm-eval's (`acc`, `acc_norm`, `acc_stderr`, ...), suffixed with its filter when that is not
`none` (`exact_match_strict-match`); the trackers get the same names at the export's step, and `jobspec report`
shows the latest of each task. The step is the exported checkpoint's.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.contract import EXIT_OK, METRICS_FILE
from jobspec.errors import ConfigError, JobspecError, see
from jobspec.spec.benchmarks import check_task_files, hub_tasks, is_task_file
from jobspec.spec.models import EvalSpec, JobSpec

log = logging.getLogger("jobspec.runner")
EVAL_EXTRA = "pip install 'jobspec-k8s[eval]' (lm-eval) in the image"
MAX_METRICS = 64  # per record (jobspec/report/metrics.py holds a record's `metrics` to it)
BOOTSTRAP_ITERS = 1000  # lm-eval's stderr by bootstrap for metrics without a closed form (its default, 100000, is slow)


class Timeout(Exception):
    """`eval.timeout_seconds` ran out in the middle of a task."""


@dataclass(frozen=True)
class Entry:
    """One `eval.benchmarks` entry: what the user wrote, and what lm-eval is given (a name, or the file's path)."""

    given: str
    spec: str


def entries(benchmarks: Sequence[str], base: str | Path) -> list[Entry]:
    """The entries of `benchmarks`, a task file's relative path resolved against `base`."""
    return [Entry(b, str((Path(base) / b).resolve()) if is_task_file(b) else b) for b in benchmarks]


def require_lm_eval() -> None:
    from importlib.util import find_spec

    if find_spec("lm_eval") is None:
        raise ConfigError(f"eval.benchmarks needs lm-evaluation-harness, which is not installed here: {EVAL_EXTRA}")


def offline() -> bool:
    """Whether the hub may not be asked (huggingface_hub's and datasets' own switches)."""
    on = {"1", "ON", "YES", "TRUE"}
    return any(os.environ.get(v, "").upper() in on for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def quiet_lm_eval() -> None:
    """lm-eval's per-task INFO lines off (its warnings stay; its progress bars too: tqdm's switch is process-wide)."""
    logging.getLogger("lm_eval").setLevel(max(logging.WARNING, logging.getLogger().level))


def task_manager(items: Sequence[Entry]) -> Any:
    """lm-eval's TaskManager: its own index only when a task is named (indexing its ~15,000 tasks takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=bool(hub_tasks([e.given for e in items])))


def check(items: Sequence[Entry], manager: Any, field: str = "eval.benchmarks") -> None:
    """Build every task (its data set read: from the hub cache, or downloaded into it); one ConfigError naming each
    entry that cannot be built, with its fix."""
    problems = []
    for i, item in enumerate(items):
        try:
            manager.load([item.spec])
        except Exception as err:  # lm-eval raises KeyError, ValueError, datasets' and the hub's errors
            problems.append(f"{field}[{i}] {item.given}: {_why(item, manager, err)}")
    if problems:
        raise ConfigError("\n".join(problems))


def _why(item: Entry, manager: Any, err: Exception) -> str:
    name = item.given
    if not is_task_file(name) and name not in manager.all_tasks:
        close = difflib.get_close_matches(name, manager.all_tasks, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "`lm-eval ls tasks` lists them"
        return f"lm-evaluation-harness knows no task, group or tag of this name ({hint})"
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
    cfg = getattr((manager.task_index or {}).get(name), "cfg", None) or {}
    dataset = " ".join(str(cfg[k]) for k in ("dataset_path", "dataset_name") if cfg.get(k)) or "its data set"
    home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    if offline():
        return (f"{dataset} cannot be read: it is not in the hub cache (HF_HOME={home}) and the hub is offline "
                f"(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE) ({text}); fetch it once with the hub reachable and the same "
                "HF_HOME (e.g. `lm-eval run --model dummy --tasks NAME --limit 1`, or datasets.load_dataset), or use a "
                "task YAML with a local data set")  # fmt: skip
    if is_task_file(name):
        return f"lm-evaluation-harness cannot build this task ({text}); check the YAML's dataset and prompt fields"
    return f"{dataset} cannot be read into the hub cache (HF_HOME={home}) ({text}); check that the hub is reachable"


def load_export(export_dir: Path, device: Any) -> tuple[Any, Any]:
    """(model on `device` in eval mode, tokenizer) from an export directory; a LoRA adapter merged into its base."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runner.output import export

    if not export.is_export(export_dir):
        raise ConfigError(f"{export_dir}: no jobspec export here ({export.PROVENANCE} missing): run `jobspec export "
                          "RUN_DIR` first, or give --model the export's directory")  # fmt: skip
    if device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtype = torch.float32
    if (export_dir / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(export_dir), dtype=dtype).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
    return model.to(device).eval(), tokenizer


def bounded_lm(model: Any, tokenizer: Any, batch_size: int, deadline: float) -> Any:
    """lm-eval's HFLM around the loaded model; every forward pass (and generate call) first checks `deadline`."""
    from lm_eval.models.huggingface import HFLM

    class Bounded(HFLM):  # type: ignore[misc]
        def _model_call(self, *args: Any, **kwargs: Any) -> Any:
            if time.monotonic() > deadline:
                raise Timeout
            return super()._model_call(*args, **kwargs)

        def _model_generate(self, *args: Any, **kwargs: Any) -> Any:
            if time.monotonic() > deadline:
                raise Timeout
            return super()._model_generate(*args, **kwargs)

    return Bounded(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def metric_name(task: str, key: str) -> str | None:
    """`eval/<task>/<metric>` for lm-eval's result key `metric,filter` (None for what is no metric)."""
    metric, _, filt = key.partition(",")
    if not filt:  # alias, name, sample_len, ...
        return None
    return f"eval/{task}/{metric if filt == 'none' else f'{metric}_{filt}'}"


def records(out: dict[str, Any], *, step: int | None, cfg: EvalSpec, seconds: float) -> list[dict[str, Any]]:
    """One `benchmark` record per task (and group) of lm-eval's output."""
    made = []
    samples = out.get("n-samples") or {}
    for task, values in {**(out.get("groups") or {}), **(out.get("results") or {})}.items():
        metrics = {}
        for key, value in values.items():
            name = metric_name(task, key)
            if name and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                metrics[name] = float(value)
        if not metrics:
            continue
        if len(metrics) > MAX_METRICS:
            log.warning("benchmark %s: %d metrics, the first %d kept", task, len(metrics), MAX_METRICS)
            metrics = dict(list(metrics.items())[:MAX_METRICS])
        made.append({"kind": "benchmark", "step": step, "task": task, "metrics": metrics,
                     "samples": (samples.get(task) or {}).get("effective"), "limit": cfg.limit,
                     "num_fewshot": cfg.num_fewshot, "seconds": round(seconds, 3)})  # fmt: skip
    return made


def run(export_dir: Path, items: Sequence[Entry], cfg: EvalSpec, *, device: Any, step: int | None,
        write: Callable[[dict[str, Any]], None], manager: Any = None) -> list[dict[str, Any]]:  # fmt: skip
    """Every entry on the export under one deadline; each task's records passed to `write` as it finishes. Returns
    the records; a `benchmark_timeout` event names the entries the deadline stopped or skipped."""
    require_lm_eval()
    quiet_lm_eval()
    import lm_eval

    manager = manager or task_manager(items)
    t0 = time.monotonic()
    deadline = t0 + cfg.timeout_seconds
    model, tokenizer = load_export(export_dir, device)
    lm = bounded_lm(model, tokenizer, cfg.batch_size, deadline)
    log.info("benchmarks: %s on %s (%s), limit %s, batch %d, at most %d s", ", ".join(e.given for e in items),
             export_dir, device, cfg.limit or "none", cfg.batch_size, cfg.timeout_seconds)  # fmt: skip
    done: list[dict[str, Any]] = []
    for n, item in enumerate(items):
        tic = time.monotonic()
        try:
            if tic > deadline:
                raise Timeout
            out = lm_eval.simple_evaluate(model=lm, tasks=[item.spec], task_manager=manager, limit=cfg.limit,
                                          num_fewshot=cfg.num_fewshot, log_samples=False,
                                          bootstrap_iters=BOOTSTRAP_ITERS)  # fmt: skip
        except Timeout:
            left = [e.given for e in items[n:]]
            log.warning("benchmarks: eval.timeout_seconds (%d s) ran out during %s: %s not run",
                        cfg.timeout_seconds, item.given, ", ".join(left))  # fmt: skip
            write({"kind": "event", "event": "benchmark_timeout", "step": step, "reason": f"not run: {', '.join(left)}"
                   [:4096], "seconds": round(time.monotonic() - t0, 3)})  # fmt: skip
            break
        for record in records(out or {}, step=step, cfg=cfg, seconds=time.monotonic() - tic):
            write(record)
            done.append(record)
    log.info("benchmarks done in %.1f s", time.monotonic() - t0)
    return done


def table(done: Sequence[dict[str, Any]]) -> str:
    """The results as text: one line a metric, its stderr beside it (lm-eval's `<metric>_stderr`)."""
    lines = [f"{'task':<32} {'metric':<28} {'value':>8}  stderr"]
    for r in done:
        prefix = f"eval/{r['task']}/"
        for name, value in r["metrics"].items():
            metric = name.removeprefix(prefix)
            if "_stderr" in metric:
                continue
            err = r["metrics"].get(f"{name}_stderr")
            lines.append(f"{r['task']:<32} {metric:<28} {value:>8.4f}  {'' if err is None else f'{err:.4f}'}")
    return "\n".join(lines)


# --- jobspec eval -----------------------------------------------------------------------------------


def run_spec(run_dir: Path) -> JobSpec:
    """The spec the run's newest intact checkpoint was trained with."""
    from runner.output import export

    return export.checkpoint_spec(export.resolve(run_dir))


def export_dir_of(run_dir: Path, spec: JobSpec, given: str | None) -> Path:
    """--model, else the run directory's `model/` (a copied run), else the spec's output.dir."""
    from runner.output import export

    if given:
        return Path(given)
    here = run_dir / "model"
    return here if export.is_export(here) else export.default_out(spec)


def main(argv: list[str] | None = None) -> int:
    """`jobspec eval`: the metrics table on stdout, the log on stderr; a bad input is one line and exit 2."""
    from jobspec.cli import add_eval_args

    parser = argparse.ArgumentParser(prog="jobspec eval", description=__doc__.splitlines()[0])
    add_eval_args(parser)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        print(table(evaluate_run(parser.parse_args(argv))))
    except JobspecError as err:
        print(f"error: {err}", file=sys.stderr)
        print(see(err), file=sys.stderr)  # as the CLI's errors end
        return err.exit_code
    return EXIT_OK


def evaluate_run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`jobspec eval`: the run's export on --tasks (else the spec's eval.benchmarks), results into the run."""
    import torch

    from runner.output import export
    from runner.output.metrics import Metrics
    from runner.output.tracking import Trackers

    require_lm_eval()
    run_dir = Path(args.run_dir)
    spec = run_spec(run_dir)
    field = "--tasks" if args.tasks else "eval.benchmarks"
    given = args.tasks or spec.eval.benchmarks
    if not given:
        raise ConfigError(f"{run_dir}: its spec names no eval.benchmarks; give --tasks (task names or task YAML files)")
    check_task_files(given, Path.cwd(), field)  # relative to the working directory here
    updates = {k: v for k, v in {"limit": args.limit, "batch_size": args.batch_size, "num_fewshot": args.num_fewshot,
                                 "timeout_seconds": args.timeout}.items() if v is not None}  # fmt: skip
    cfg = EvalSpec.model_validate({**spec.eval.model_dump(), "benchmarks": list(given), **updates})
    items = entries(given, Path.cwd())
    manager = task_manager(items)
    check(items, manager, field)
    out = export_dir_of(run_dir, spec, args.model)
    step = (export.read_provenance(out) or {}).get("step")
    device = torch.device("cuda" if torch.cuda.is_available() and spec.hardware.vendor != "cpu" else "cpu")
    try:
        trackers = Trackers(spec, run_dir, enabled=True, config={"spec": spec.to_yaml_dict()})
    except ConfigError as err:  # a tracker client the job's image had and this machine has not
        log.warning("trackers skipped: %s", err)
        trackers = None
    metrics = Metrics(run_dir / METRICS_FILE, enabled=True, trackers=trackers)
    try:
        return run(out, items, cfg, device=device, step=step, write=metrics.write, manager=manager)
    finally:
        metrics.close()


if __name__ == "__main__":
    sys.exit(main())
