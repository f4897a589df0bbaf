"""The `jobspec` command line.

One place catches `JobspecError` and prints it without a traceback (`--debug` brings it
back). Heavy modules are imported inside the commands that need them: `render`, `plan`
and `validate` never import torch or the kubernetes client.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jobspec import __version__, install_hint
from jobspec.cli_parser import Parser as _Parser  # exits 2, and never echoes an argument (it may be a token)
from jobspec.contract import EXIT_CONFIG, EXIT_FAILED, EXIT_NO_FIT, EXIT_OK
from jobspec.errors import ConfigError, JobspecError, see
from jobspec.spec.credentials import redact

if TYPE_CHECKING:  # the spec module costs pydantic's import; commands load it when they need it
    from jobspec.spec.models import JobSpec

EPILOG = """\
examples:
  jobspec init --model qwen-0.5b --gpus A10G:1 --data train.jsonl --lora -o my.yaml   a first spec
  jobspec run examples/quickstart.yaml                train on this machine (no cluster)
  jobspec plan examples/sft_fast.yaml                 memory per tier before you submit
  jobspec plan examples/sft_fast.yaml --gpus any      the same job on each GPU type: tier, time
  jobspec render examples/sft_fast.yaml | kubectl apply -f -
  jobspec submit examples/sft_fast.yaml && jobspec status examples/sft_fast.yaml

exit codes: 0 ok, 1 job failed, 2 bad input, 3 cluster/API error, 4 plan: nothing fits
"""


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    """SPEC and --set, the same for every command that reads a spec (the runner's too)."""
    parser.add_argument("spec", metavar="SPEC", help="job spec YAML file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set training.global_batch=64 (repeatable; value parsed as YAML)",
    )


def _load(args: argparse.Namespace) -> JobSpec:
    from jobspec.spec.loader import load_spec

    return load_spec(args.spec, args.overrides)


def _here(args: argparse.Namespace, spec: JobSpec) -> tuple[JobSpec, list[str]]:
    """The spec as this machine reads it, and the overrides that make it so: relative model and data paths from the
    spec's folder, wherever the command runs (jobspec/local_paths.py), as `jobspec run` reads them."""
    from jobspec.local_paths import read_overrides
    from jobspec.spec.loader import load_spec

    items = read_overrides(args.spec, spec, args.overrides)
    overrides = [*args.overrides, *items]
    return (load_spec(args.spec, overrides) if items else spec), overrides


def cmd_validate(args: argparse.Namespace) -> int:
    from jobspec.local_paths import cluster_warnings, is_cluster_spec
    from jobspec.plan.planner import check_model

    spec = _load(args)
    check_model(_here(args, spec)[0])  # a local or inline config.json (family, sizes), attention kernel, 4-bit base
    tasks = _task_files(args.spec, spec, absent_absolute_ok=True)
    _shipped_task_files(args.spec, spec)  # what a cluster job carries: under the spec's directory, within bounds
    print(f"{args.spec}: ok ({spec.name}: {spec.world_size} rank(s), tier {spec.memory.tier})")
    for note in _notes(spec) + tasks + (cluster_warnings(args.spec, spec) if is_cluster_spec(spec) else []):
        print(f"  note: {note}", file=sys.stderr)
    return EXIT_OK


def _task_files(spec_file: str, spec: JobSpec, *, absent_absolute_ok: bool = False) -> list[str]:
    """eval.benchmarks' task YAML files and training.grpo.rewards' Python files, relative to the spec file: each must
    be what it stands for (ConfigError otherwise)."""
    from pathlib import Path

    from jobspec.spec.benchmarks import check_reward_files, check_task_files

    base = Path(spec_file).parent
    return [*check_task_files(spec.eval.benchmarks, base, absent_absolute_ok=absent_absolute_ok),
            *check_reward_files(spec, base, absent_absolute_ok=absent_absolute_ok)]  # fmt: skip


def _shipped_task_files(spec_file: str, spec: JobSpec) -> dict[str, str]:
    """The relative task files' texts, for the job's ConfigMap (ConfigError for one outside the spec's directory,
    missing, no task, or over the bound)."""
    from pathlib import Path

    from jobspec.spec.benchmarks import ship_task_files, shipped_entries, shipped_fields

    return ship_task_files(shipped_entries(spec), Path(spec_file).parent, fields=shipped_fields(spec))


def _notes(spec: JobSpec) -> list[str]:
    """Valid, but worth knowing before the job runs."""
    from jobspec.local_paths import is_cluster_spec
    from jobspec.render.images import unpublished_note

    notes = []
    if not spec.checkpoints.pvc and not spec.remote_dir and spec.hardware.vendor != "cpu":
        notes.append("checkpoints.pvc is not set: checkpoints live in the pod and are lost when it is replaced")
    if spec.checkpoints.pvc and spec.hardware.nodes > 1:
        notes.append(f"{spec.hardware.nodes} nodes write into checkpoints.pvc: it must be ReadWriteMany")
    image = spec.image.name
    unpublished = unpublished_note(spec) if is_cluster_spec(spec) else None  # a CPU spec may only run here, no image
    if unpublished:
        notes.append(unpublished)
    if image and "@" not in image:  # the spec checked the digest's shape; a tag can move under a running job
        tag = image.rpartition("/")[2].partition(":")[2] or "latest"
        notes.append(
            f"image.name {image!r} is the tag :{tag}, not a digest: a retried or later pod may pull other "
            f"code; pin it as {image}@sha256:<digest> (`crane digest {image}` prints it)"
        )
    hw = spec.hardware
    if spec.memory.tier in ("zero2_offload", "minimal") and hw.memory is None and hw.vendor != "cpu":
        notes.append(
            f"memory.tier {spec.memory.tier} keeps optimizer state in host memory, beyond the default memory "
            "request (8Gi per GPU): set hardware.memory to the host GiB `jobspec plan` shows"
        )
    if not spec.scheduling.network_policy:
        notes.append(
            "scheduling.network_policy is false: any pod in the cluster can reach this job's rendezvous port "
            "(torch's TCPStore has no authentication) unless a policy of your own covers it"
        )
    return notes


def cmd_render(args: argparse.Namespace) -> int:
    from jobspec.local_paths import cluster_warnings
    from jobspec.render import render, to_json, to_yaml
    from jobspec.render.images import unpublished_note

    spec = _load(args)
    objects = render(spec, _shipped_task_files(args.spec, spec))
    image_note = unpublished_note(spec)
    # stderr: `render | kubectl apply -f -` reads stdout only
    for line in cluster_warnings(args.spec, spec) + ([image_note] if image_note else []):
        print(f"warning: {line}", file=sys.stderr)
    sys.stdout.write(to_json(objects) if args.output == "json" else to_yaml(objects))
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from jobspec.spec.reference import json_schema_text, markdown

    sys.stdout.write(markdown() if args.markdown else json_schema_text())
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from jobspec.plan.output import plan_table
    from jobspec.plan.planner import plan_spec

    if args.rows is not None and args.rows < 1:
        raise ConfigError(f"--rows {args.rows}: expected the number of training records, 1 or more")
    if args.gpus and args.gpu_memory:
        raise ConfigError("--gpus and --gpu-memory cannot be combined: --gpus plans on each type's own memory")
    (spec, overrides), prices = _here(args, _load(args)), {}  # a relative data.path counted from the spec's folder
    if args.gpus or args.price:
        from jobspec.plan.compare import compare, compare_dict, compare_table, parse_prices, select_gpus

        prices = parse_prices(args.price)
    if args.gpus:
        reports = compare(spec, select_gpus(args.gpus), prices, args.rows)
        json_out = args.output == "json"
        print(json.dumps(compare_dict(spec, reports), indent=2) if json_out else compare_table(spec, reports))
        return EXIT_OK if any(r.runs for r in reports) else EXIT_NO_FIT
    measured = None
    if args.from_run:
        from jobspec.plan.calibration import read_run

        measured = read_run(args.from_run)
    report = plan_spec(spec, gpu_memory=args.gpu_memory, rows=args.rows, prices=prices, measured=measured)
    if args.trace:
        from dataclasses import replace

        from jobspec.plan.planner import planned_precision
        from jobspec.plan.traced import trace_tiers, with_optimizer

        traced = trace_tiers(args.spec, overrides, report.plans, spec.world_size, planned_precision(spec))
        report = replace(report, traced=with_optimizer(spec, report, traced))
    print(json.dumps(report.to_dict(), indent=2) if args.output == "json" else plan_table(report))
    return EXIT_OK if report.runs else EXIT_NO_FIT


def cmd_init(args: argparse.Namespace) -> int:
    from jobspec.plan.starter import Request, init_spec

    out_file = None if args.out in (None, "-") else args.out
    req = Request(args.model, args.gpus, args.data, args.objective, args.name, args.nodes, args.lora, args.max_seq_len,
                  file=out_file, config=args.config, data_format=args.format, quantize=args.quantize)  # fmt: skip
    text = init_spec(req)
    if args.out in (None, "-"):
        sys.stdout.write(text)
        return EXIT_OK
    from pathlib import Path

    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(f"{out} exists: pass --force to overwrite it, or -o another file")
    out.write_text(text)
    print(f"wrote {out}: check it with `jobspec validate {out}` and `jobspec plan {out}`", file=sys.stderr)
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from jobspec.local_paths import run_overrides

    spec = _load(args)
    _task_files(args.spec, spec)  # fail fast, here, with the loader's located errors
    # Relative paths from the spec's folder, files under a local run directory (jobspec/local_paths.py); the
    # user's own --set items come first, so that these absolute forms of them win
    local, said = run_overrides(args.spec, spec, args.overrides)
    for line in said:
        print(f"note: {line}", file=sys.stderr)
    argv = [sys.executable, "-m", "runner", args.spec]
    for item in [*args.overrides, *local]:
        argv += ["--set", item]
    if args.nproc:
        argv += ["--nproc", str(args.nproc)]
    sys.stdout.flush()
    os.execv(sys.executable, argv)  # the runner's supervisor owns signals and exit codes from here
    return EXIT_FAILED  # not reached


def cmd_report(args: argparse.Namespace) -> int:
    from jobspec.report import INSTALL_HINT, write_report

    report = write_report(args.run_dir, args.out)
    for path in report.files:
        print(path)
    if report.plots_missing:
        print(f"note: report.md written without plots; for the plots: {INSTALL_HINT}", file=sys.stderr)
    return EXIT_OK


def add_export_args(parser: argparse.ArgumentParser) -> None:
    """`jobspec export`'s arguments (runner/output/export.py parses the same ones)."""
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a step-N checkpoint directory, or a run directory; "
                        "either may be in object storage (s3://bucket/prefix, gs://bucket/prefix: downloaded and "
                        "verified first)")  # fmt: skip
    parser.add_argument("--out", metavar="DIR", help="where to write (default: the spec's output.dir)")
    parser.add_argument("--merge", action="store_true", help="LoRA: write merged full weights, not an adapter")
    parser.add_argument("--base", metavar="PATH", help="where model.path's base model is now (it moved or was copied)")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], help="dtype of the written weights")


def cmd_export(args: argparse.Namespace) -> int:
    if _missing_runner_extra():
        raise ConfigError(f"jobspec export needs the runner extra ({_missing_runner_extra()} is not installed): "
                          f"{install_hint('runner')} (CPU is enough)")  # fmt: skip
    argv = [sys.executable, "-m", "runner.output.export", args.checkpoint]
    for flag in ("out", "base", "dtype"):
        if getattr(args, flag):
            argv += [f"--{flag}", getattr(args, flag)]
    argv += ["--merge"] if args.merge else []
    sys.stdout.flush()
    os.execv(sys.executable, argv)  # torch and transformers load there, never in this process
    return EXIT_FAILED  # not reached


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    """`jobspec eval`'s arguments (runner/output/benchmarks.py parses the same ones)."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (the spec's checkpoints.dir) with its export")
    parser.add_argument("--tasks", nargs="+", metavar="TASK", help="lm-evaluation-harness task names or task YAML "
                        "files (relative to the working directory); default: the spec's eval.benchmarks")  # fmt: skip
    parser.add_argument("--limit", type=int, metavar="N", help="samples per task (default: the spec's eval.limit)")
    parser.add_argument("--batch-size", type=int, metavar="B", help="requests per forward pass (eval.batch_size)")
    parser.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples (eval.num_fewshot)")
    parser.add_argument("--timeout", type=int, metavar="SECONDS", help="time all tasks may take (eval.timeout_seconds)")
    parser.add_argument("--model", metavar="DIR", help="the export to evaluate (default: RUN_DIR/model or output.dir)")


def cmd_eval(args: argparse.Namespace) -> int:
    from importlib.util import find_spec

    missing = _missing_runner_extra() or ("lm_eval" if find_spec("lm_eval") is None else None)
    if missing:
        raise ConfigError(f"jobspec eval needs the runner and eval extras ({missing} is not installed): "
                          f"{install_hint('runner,eval')}")  # fmt: skip
    argv = [sys.executable, "-m", "runner.output.benchmarks", args.run_dir]
    argv += ["--tasks", *args.tasks] if args.tasks else []
    for flag in ("limit", "batch_size", "num_fewshot", "timeout", "model"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    sys.stdout.flush()
    os.execv(sys.executable, argv)  # torch, transformers and lm-eval load there, never in this process
    return EXIT_FAILED  # not reached


def _missing_runner_extra() -> str | None:
    """The first package of the runner extra that cannot be imported, without importing any of them."""
    from importlib.util import find_spec

    return next((name for name in ("torch", "transformers", "accelerate", "peft") if find_spec(name) is None), None)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's parser must not reset a --debug given before the subcommand.
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks, debug logs")
    parser = _parser = _Parser(
        prog="jobspec",
        description="Validate, plan, render, submit and run GPU fine-tuning jobs described by one YAML spec.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"jobspec {__version__}")
    sub = _parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser(
        "init",
        parents=[common],
        help="write a first spec, commented, with the tier and micro-batch the plan chooses",
        description="Write a commented spec for a model, GPUs, data and objective, with the tier and micro-batch "
        "`jobspec plan` would choose filled in and explained. Refuses (exit 2) what cannot fit, naming the smallest "
        "change that would: more GPUs, LoRA, a shorter max_seq_len.",
    )
    p.add_argument("--model", required=True, metavar="MODEL", help="a preset, a local model directory, or a hub id "
                   "whose config.json is in this machine's Hugging Face cache or given with --config")  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="a hub model's config.json as a local file (where the hub cannot "
                   "be reached): written into the spec as model.architecture")  # fmt: skip
    p.add_argument("--gpus", required=True, metavar="TYPE:COUNT", help="GPU type and count per node, e.g. A100-80GB:2")
    p.add_argument("--data", required=True, metavar="PATH", help="training data (data.path): file, directory or hub id")
    p.add_argument("--objective", default="sft", metavar="sft|dpo|ipo|kto|simpo|orpo|grpo",
                   help="training objective (default sft)")  # fmt: skip
    p.add_argument("--format", metavar="FORMAT", help="data.format, e.g. text: raw documents for continued pretraining")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (rank 16) instead of all weights")
    p.add_argument("--quantize", metavar="nf4|auto", help="with --lora: the frozen base in 4 bits (model.quantize)")
    p.add_argument("--max-seq-len", type=int, default=2048, metavar="N",
                   help="data.max_seq_len (default 2048; capped at the model's positions)")  # fmt: skip
    p.add_argument("--name", metavar="NAME", help="the job's name (default: from the model and objective)")
    p.add_argument("-o", "--out", metavar="FILE", help="write the spec here (default: print it)")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("validate", parents=[common], help="check a spec; every problem with file, line and fix")
    add_spec_args(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "render",
        parents=[common],
        help="print the Kubernetes objects (ConfigMap, Service, NetworkPolicy, Indexed Job) for kubectl apply -f -",
        description="Render the spec to Kubernetes objects. Pure: talks to no cluster.",
    )
    add_spec_args(p)
    p.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml", help="output format (default yaml)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser(
        "schema",
        parents=[common],
        help="print the spec's JSON Schema (for editors and CI)",
        description="Print the JSON Schema of a spec file. The same schema ships in the package as "
        "jobspec/schema/jobspec.schema.json: name it in the first line of a spec, "
        "`# yaml-language-server: $schema=PATH`, for completion and checks in editors.",
    )
    p.add_argument("--markdown", action="store_true", help="print the spec reference as Markdown tables instead")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser(
        "plan",
        parents=[common],
        help="GPU memory, micro-batch, step time and job duration per tier; compare GPU types and costs",
        description="Memory plan per tier from the memory model (no GPU needed; the runner re-checks it on the "
        "GPU), and each tier's step time, tokens/s and job duration from the model's FLOPs per token, the GPU's "
        "peak and an assumed efficiency per tier (printed under the table). Exits 4 when nothing fits.",
    )
    add_spec_args(p)
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="plan for this GPU memory, not the spec's GPU: e.g. 24Gi or 80GB; a number without a unit is GiB",
    )
    p.add_argument(
        "--gpus",
        metavar="any|TYPE,...",
        help="compare GPU types of the catalogue (any = all) at the spec's GPU count: tier, time, cost",
    )
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="GPU=PRICE,...",
        help="price per GPU-hour for the cost column, e.g. --price H100=2.49,A100-80GB=1.79 (repeatable)",
    )
    p.add_argument(
        "--rows",
        type=int,
        metavar="N",
        help="training records in the data, for the duration of an epochs-based job whose data plan cannot count",
    )
    p.add_argument(
        "--from",
        dest="from_run",
        metavar="RUN_DIR",
        help="correct the plan by what a run measured (its metrics.jsonl): bytes per sample and time per step, "
        "tier by tier, shown beside the model's figures",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also trace the runner's own training step on fake tensors at each tier's micro-batch (torch's memory "
        f"tracker; seconds to a minute a tier; needs {install_hint('trace')}) and show its bytes beside the model's",
    )
    p.add_argument("-o", "--output", choices=["table", "json"], default="table", help="output format")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "run",
        parents=[common],
        help="train on this machine (CPU or local GPUs), no cluster",
        description=f"Run the job here with the in-container runner (needs: {install_hint('runner')}).",
    )
    add_spec_args(p)
    p.add_argument("--nproc", type=int, metavar="N", help="processes on this machine (default: one per GPU, or 1)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "export",
        parents=[common],
        help="write a checkpoint as a Hugging Face model directory (or PEFT adapter); CPU only",
        description="Export a checkpoint to a directory that transformers (and peft, for LoRA) load without "
        "jobspec: config, safetensors weights, tokenizer, provenance. Works on a copied checkpoint directory.",
    )
    add_export_args(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "report",
        parents=[common],
        help="plots and a one-page summary of a run from its metrics.jsonl",
        description="Write report.md, report.html and PNG plots (loss, learning rate, tokens/s, memory, with OOM "
        "shrinks and tier changes marked) for a run directory (the spec's checkpoints.dir). The plots need "
        f"matplotlib: {install_hint('report')}; without it only the summary is written.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    p.add_argument("--out", metavar="DIR", help="output directory (default RUN_DIR/report)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "eval",
        parents=[common],
        help="benchmarks (lm-evaluation-harness) of a run's exported model; results into its metrics",
        description="Run lm-evaluation-harness tasks (names, or task YAML files of your own) on a run's exported "
        "model and print each task's metrics; they are appended to RUN_DIR/metrics.jsonl (`jobspec report` shows "
        f"them) and sent to the spec's trackers. Needs {install_hint('runner,eval')}; a GPU when there is one.",
    )
    add_eval_args(p)
    p.set_defaults(func=cmd_eval)

    from jobspec.image.cli import add_image_commands

    add_image_commands(sub, common)
    try:
        from jobspec.cluster.cli import add_cluster_commands
    except ImportError:  # pragma: no cover - the cluster package is part of the distribution
        pass
    else:
        add_cluster_commands(sub, common)
    return parser


# Pydantic searches the entry points of every installed distribution for plugins the first time a
# model is built: importlib.metadata reads each one's metadata (5-10 ms CPU here, more in a large
# environment) in a command that builds its models once and exits. These commands run in this process
# alone, so they skip the search unless the user set the variable (then their value stands); `run` and
# `export` start the runner, and the cluster commands the client's credential plugins: those get the
# environment as the user gave it. See docs/benchmarks.md, "CLI start-up".
PYDANTIC_PLUGINS_ENV = "PYDANTIC_DISABLE_PLUGINS"
_NO_PYDANTIC_PLUGINS = frozenset({cmd_validate, cmd_render, cmd_plan, cmd_schema, cmd_init})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CONFIG
    plugins_off = args.func in _NO_PYDANTIC_PLUGINS and PYDANTIC_PLUGINS_ENV not in os.environ
    if plugins_off:  # before the command imports pydantic; undone below for a caller of main() (tests)
        os.environ[PYDANTIC_PLUGINS_ENV] = "__all__"
    try:
        return args.func(args)
    except JobspecError as err:
        return _report(err, err.exit_code, debug)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `jobspec render ... | head`
        sys.stderr.close()
        return EXIT_OK
    except OSError as err:
        return _report(ConfigError(str(err)), EXIT_CONFIG, debug)
    finally:
        if plugins_off:
            os.environ.pop(PYDANTIC_PLUGINS_ENV, None)


def _report(err: Exception, code: int, debug: bool) -> int:
    """The error line (and with --debug the traceback first); the exit code stays the error's."""
    if debug:
        import traceback

        sys.stderr.write(redact(traceback.format_exc()))  # messages are scrubbed; this covers the frames' text
    print(f"error: {redact(str(err))}", file=sys.stderr)
    print(see(err), file=sys.stderr)  # the troubleshooting section of its class
    return code


if __name__ == "__main__":
    sys.exit(main())
