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

from jobspec import __version__
from jobspec.contract import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from jobspec.errors import ConfigError, JobspecError

if TYPE_CHECKING:  # the spec module costs pydantic's import; commands load it when they need it
    from jobspec.spec import JobSpec

EPILOG = """\
examples:
  jobspec run examples/quickstart.yaml                train on this machine (no cluster)
  jobspec plan examples/sft_fast.yaml                 memory per tier before you submit
  jobspec render examples/sft_fast.yaml | kubectl apply -f -
  jobspec submit examples/sft_fast.yaml && jobspec status sft-fast -n ml

exit codes: 0 ok, 1 job failed, 2 bad input, 3 cluster/API error
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default exits 2 too; keep the usage line short
        self.print_usage(sys.stderr)
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message}\n")


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
    from jobspec.loader import load_spec

    return load_spec(args.spec, args.overrides)


def cmd_validate(args: argparse.Namespace) -> int:
    spec = _load(args)
    print(f"{args.spec}: ok ({spec.name}: {spec.world_size} rank(s), tier {spec.memory.tier})")
    for note in _notes(spec):
        print(f"  note: {note}", file=sys.stderr)
    return EXIT_OK


def _notes(spec: JobSpec) -> list[str]:
    """Valid, but worth knowing before the job runs."""
    notes = []
    if not spec.checkpoints.pvc and spec.hardware.vendor != "cpu":
        notes.append("checkpoints.pvc is not set: checkpoints live in the pod and are lost when it is replaced")
    if spec.checkpoints.pvc and spec.hardware.nodes > 1:
        notes.append(f"{spec.hardware.nodes} nodes write into checkpoints.pvc: it must be ReadWriteMany")
    return notes


def cmd_render(args: argparse.Namespace) -> int:
    from jobspec.render import render, to_json, to_yaml

    objects = render(_load(args))
    sys.stdout.write(to_json(objects) if args.output == "json" else to_yaml(objects))
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    import json

    from jobspec.spec import JobSpec

    if args.markdown:
        from jobspec.reference import markdown

        print(markdown(), end="")
        return EXIT_OK

    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "jobspec job spec"
    print(json.dumps(schema, indent=2))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from jobspec.plan import plan_spec, plan_table

    report = plan_spec(_load(args), gpu_memory=args.gpu_memory)
    print(json.dumps(report.to_dict(), indent=2) if args.output == "json" else plan_table(report))
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    _load(args)  # fail fast, here, with the loader's located errors
    argv = [sys.executable, "-m", "runner", args.spec]
    for item in args.overrides:
        argv += ["--set", item]
    if args.nproc:
        argv += ["--nproc", str(args.nproc)]
    sys.stdout.flush()
    os.execv(sys.executable, argv)  # the runner's supervisor owns signals and exit codes from here
    return EXIT_FAILED  # not reached


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

    p = sub.add_parser("validate", parents=[common], help="check a spec; every problem with file, line and fix")
    add_spec_args(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "render",
        parents=[common],
        help="print the Kubernetes objects (ConfigMap, Service, Indexed Job) for kubectl apply -f -",
        description="Render the spec to Kubernetes objects. Pure: talks to no cluster.",
    )
    add_spec_args(p)
    p.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml", help="output format (default yaml)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("schema", parents=[common], help="print the spec's JSON Schema (for editors and CI)")
    p.add_argument("--markdown", action="store_true", help="print the spec reference as Markdown tables instead")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser(
        "plan",
        parents=[common],
        help="estimated GPU memory per tier, micro-batch, accumulation, and the tier auto picks",
        description="Memory plan per tier from the memory model (no GPU needed). The runner re-checks it on the GPU.",
    )
    add_spec_args(p)
    p.add_argument("--gpu-memory", metavar="SIZE", help="plan for this GPU memory (e.g. 24Gi), not the spec's GPU")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table", help="output format")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "run",
        parents=[common],
        help="train on this machine (CPU or local GPUs), no cluster",
        description="Run the job here with the in-container runner (needs: pip install 'jobspec[runner]').",
    )
    add_spec_args(p)
    p.add_argument("--nproc", type=int, metavar="N", help="processes on this machine (default: one per GPU, or 1)")
    p.set_defaults(func=cmd_run)

    try:
        from jobspec.cluster.cli import add_cluster_commands
    except ImportError:  # pragma: no cover - the cluster package is part of the distribution
        pass
    else:
        add_cluster_commands(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CONFIG
    try:
        return args.func(args)
    except JobspecError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `jobspec render ... | head`
        sys.stderr.close()
        return EXIT_OK
    except OSError as err:
        if debug:
            raise
        print(f"error: {ConfigError(str(err))}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
