"""The cluster subcommands: submit, status, logs, cancel, list.

`jobspec.cli` calls `add_cluster_commands(subparsers, common_parent)`. Each handler takes the
parsed args, returns the exit code, and raises JobspecError subclasses for failures (the main
entry point prints those without a traceback). Heavy imports (the kubernetes client) happen
inside the handlers, so `jobspec render` and `--help` stay fast.
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import sys
from typing import Any

from jobspec.cluster.resources import PREFLIGHT_CHECKS
from jobspec.contract import EXIT_CLUSTER, EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from jobspec.errors import ConfigError

log = logging.getLogger(__name__)

EXIT_CODES = f"""exit codes:
  {EXIT_OK}  ok
  {EXIT_FAILED}  the job failed (status of a failed job)
  {EXIT_CONFIG}  bad input: spec, flag, kubeconfig
  {EXIT_CLUSTER}  cluster or API error: refused (RBAC), not found, unreachable, timed out, conflict
"""
DRY_RUN_MODES = ("client", "server", "none")


def add_cluster_commands(subparsers: Any, common_parent: argparse.ArgumentParser) -> None:
    """Register submit, status, logs, cancel and list on `subparsers` (from add_subparsers())."""
    conn = _connection_parent()
    fmt = argparse.RawDescriptionHelpFormatter

    def add(name: str, help_: str, description: str) -> argparse.ArgumentParser:
        return subparsers.add_parser(
            name,
            parents=[common_parent, conn],
            help=help_,
            description=description,
            epilog=EXIT_CODES,
            formatter_class=fmt,
        )

    p = add(
        "submit",
        "create the job on the cluster",
        "Render SPEC and create its ConfigMap, Service, NetworkPolicy and Job with server-side apply.\n"
        "Submitting the same spec again changes nothing and says so; a changed spec for an\n"
        "existing job is refused unless --replace (which deletes the old job first).\n"
        "First (also with --dry-run=server) it checks that the cluster has what the objects name:\n"
        "the namespace and its Pod Security level, PriorityClass, Kueue LocalQueue and ClusterQueue,\n"
        "PVCs, Secrets and their keys, ServiceAccount, GPUs on some node. Anything missing: exit 2,\n"
        "naming it and the fix; a check the submitter may not read is a warning.",
    )
    p.add_argument("spec", nargs="?", metavar="SPEC", help="job spec YAML file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY.PATH=VALUE",
        help="override a spec field (repeatable), e.g. --set training.global_batch=64",
    )
    p.add_argument(
        "--dry-run",
        nargs="?",
        const="client",
        default="none",
        metavar="{client,server}",
        help="client (the default when given bare): print the objects, contact nothing; "
        "server: ask the API server to check them (dryRun=All), persist nothing",
    )
    p.add_argument(
        "--replace", action="store_true", help="delete an existing job of this name (and its pods) first, then submit"
    )
    p.add_argument(
        "--skip-check",
        action="append",
        default=[],
        choices=PREFLIGHT_CHECKS,
        metavar="NAME",
        help="leave out one pre-submit check (repeatable): " + ", ".join(PREFLIGHT_CHECKS) + "; e.g. gpu on a "
        "cluster that adds GPU nodes on demand",
    )
    p.set_defaults(func=cmd_submit)

    p = add(
        "status",
        "show a job's phase, pods and last report",
        "Job phase (and why it is not running), each index's newest pod (phase, restarts, attempts),\n"
        "the runner's last reported tier, step and loss, and its live progress: step/total, loss,\n"
        "tokens/s, ETA, tier, micro-batch, last OOM or tier change (rank 0's last progress line, read\n"
        "from a bounded tail of its log). -w follows it until the job ends. Exits 1 when the job failed.",
    )
    p.add_argument("name", metavar="NAME|SPEC", help=_TARGET_HELP)
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    p.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="then print a line at each change (phase, reason, progress) until the job ends; -o json: a JSON "
        "object per line. Ctrl-C stops it",
    )
    p.add_argument(
        "--interval", type=_seconds, default=10.0, metavar="SECONDS", help="with -w: time between polls (default 10s)"
    )
    p.add_argument(
        "--watch-for",
        type=_long_seconds,
        default=24 * 3600.0,
        metavar="DURATION",
        help="with -w: stop after this long even if the job runs on, e.g. 90m, 12h (default 24h)",
    )
    p.set_defaults(func=cmd_status)

    p = add(
        "logs",
        "print or follow a job's log",
        "Print the log of one index's newest pod; -f follows it until that pod ends.",
    )
    p.add_argument("name", metavar="NAME|SPEC", help=_TARGET_HELP)
    p.add_argument("-f", "--follow", action="store_true", help="stream until the pod ends (waits for it to start)")
    p.add_argument("--index", type=int, default=0, metavar="N", help="completion index (node rank); default 0")
    p.add_argument(
        "--previous",
        action="store_true",
        help="the previous run: a restarted container's, else the index's previous pod",
    )
    p.set_defaults(func=cmd_logs)

    p = add(
        "cancel",
        "delete a job, its pods, Service, ConfigMap and NetworkPolicy",
        "Delete everything jobspec created for NAME (found by its job label).",
    )
    p.add_argument("name", metavar="NAME|SPEC", help=_TARGET_HELP)
    p.add_argument("--wait", action="store_true", help="return only once the job's pods are gone")
    p.set_defaults(func=cmd_cancel)

    p = add("list", "list the jobs jobspec created", "Jobs carrying the label app.kubernetes.io/managed-by=jobspec.")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace (needs cluster-wide list)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    p.set_defaults(func=cmd_list)


def _connection_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("cluster connection")
    g.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, then the in-cluster service account)",
    )
    g.add_argument("--context", metavar="NAME", help="kubeconfig context (default: its current-context)")
    g.add_argument(
        "-n",
        "--namespace",
        metavar="NS",
        help="namespace (default: the spec's, when the command is given a spec file; then the context's; "
        "then 'default')",
    )
    g.add_argument(
        "--request-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="time for one answer of the API server, e.g. 30, 30s, 2m (default 30s); a call and its retries "
        "give up after 60 s, or one such timeout if longer",
    )
    return p


def _seconds(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*", text)
    value = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)] if m else 0.0
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration from 1ms to 60m, e.g. 30 or 30s or 2m")
    return value


def _long_seconds(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*", text)
    value = float(m.group(1)) * {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}[m.group(2)] if m else 0.0
    if not 1 <= value <= 7 * 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration from 1s to 7d, e.g. 90m or 12h")
    return value


_TARGET_HELP = "job name, or the job's spec file (its name, and its namespace when written in it)"


def _name(args: argparse.Namespace) -> str:
    """The job NAME, or the name in a spec file; a spec's written namespace lands in `args.spec_namespace`.

    A job name is an RFC 1123 label: an argument with a '.' or a '/' is read as a spec file.
    """
    from jobspec.cluster.kubeconfig import DNS_LABEL

    args.spec_namespace = None
    if "." in args.name or "/" in args.name:
        from jobspec.spec.loader import load_spec

        spec = load_spec(args.name)
        # As for submit: the spec's namespace counts only when written in it; its default must not hide the context's.
        args.spec_namespace = spec.namespace if "namespace" in spec.model_fields_set else None
        return spec.name
    if not DNS_LABEL.match(args.name):
        raise ConfigError(
            f"{args.name!r} is not a valid job name (lower-case letters, digits and '-') nor a spec file (*.yaml)"
        )
    return args.name


def _connect(args: argparse.Namespace) -> tuple[Any, str]:
    """(client, namespace) for commands that work on existing objects: -n, the spec's namespace, the context's."""
    from jobspec.cluster.kubeconfig import load_connection, validate_namespace

    conn = load_connection(args.kubeconfig, args.context)
    chosen = args.namespace or getattr(args, "spec_namespace", None) or conn.namespace
    namespace = validate_namespace(chosen or "default")
    return _client(args, conn), namespace


def _client(args: argparse.Namespace, conn: Any) -> Any:
    from jobspec.cluster.client import ClusterClient

    log.debug("cluster: %s", conn.describe())
    # retry_policy: a seam for tests (no sleeping); never set by the parser.
    return ClusterClient(conn, timeout=args.request_timeout, policy=getattr(args, "retry_policy", None))


def _extra_flags(args: argparse.Namespace) -> str:
    flags = [f" --{k} {shlex.quote(v)}" for k, v in (("context", args.context), ("kubeconfig", args.kubeconfig)) if v]
    return "".join(flags)


def _dry_run_mode(args: argparse.Namespace) -> str:
    mode = args.dry_run
    if mode not in DRY_RUN_MODES and args.spec is None:  # `--dry-run spec.yaml`: the bare flag took the path
        args.spec, mode = mode, "client"
    if mode not in DRY_RUN_MODES:
        raise ConfigError(f"--dry-run={mode}: expected client or server")
    if args.spec is None:
        raise ConfigError("submit needs a SPEC file, e.g. jobspec submit examples/sft_fast.yaml")
    return mode


def cmd_submit(args: argparse.Namespace) -> int:
    from pathlib import Path

    from jobspec.cluster.kubeconfig import context_namespace, load_connection, validate_namespace
    from jobspec.cluster.output import format_submit
    from jobspec.cluster.preflight import preflight
    from jobspec.cluster.submit import in_namespace, submit
    from jobspec.render import render, to_yaml
    from jobspec.render.images import unpublished_note
    from jobspec.spec.benchmarks import ship_task_files, shipped_entries, shipped_fields
    from jobspec.spec.loader import load_spec

    mode = _dry_run_mode(args)
    spec = load_spec(args.spec, args.overrides)
    # The spec's namespace counts only when written in it (or --set); its default must not hide the context's.
    chosen = args.namespace or (
        spec.namespace if "namespace" in getattr(spec, "model_fields_set", {"namespace"}) else None
    )
    conn = None
    if mode == "client":
        chosen = chosen or context_namespace(args.kubeconfig, args.context)
    else:
        conn = load_connection(args.kubeconfig, args.context)
        chosen = chosen or conn.namespace
    namespace = validate_namespace(chosen or spec.namespace or "default")
    if spec.namespace != namespace:
        spec = load_spec(args.spec, [*args.overrides, f'namespace="{namespace}"'])  # quoted: "no" is no bool
    objects = in_namespace(render(spec, ship_task_files(shipped_entries(spec), Path(args.spec).parent,
                                                            fields=shipped_fields(spec))), namespace)
    note = unpublished_note(spec)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    if mode == "client":
        sys.stdout.write(to_yaml(objects))
        return EXIT_OK
    with _client(args, conn) as client:
        checks = preflight(client, objects, namespace, skip=args.skip_check)
        for warning in checks.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        checks.raise_if_missing(namespace)
        result = submit(client, objects, namespace, replace=args.replace, dry_run=mode == "server")
    sys.stdout.write(format_submit(result, _extra_flags(args)))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from jobspec.cluster.output import format_status, to_json
    from jobspec.cluster.status import collect_status

    name = _name(args)
    client, namespace = _connect(args)
    if args.watch:
        return _watch(args, client, namespace, name)
    with client:
        st = collect_status(client, namespace, name)
    sys.stdout.write(to_json(st.to_dict()) if args.output == "json" else format_status(st))
    return EXIT_FAILED if st.failed_job else EXIT_OK


def _watch(args: argparse.Namespace, client: Any, namespace: str, name: str) -> int:
    from jobspec.cluster.output import format_status
    from jobspec.cluster.watch import watch

    def note(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    with client:
        try:
            st = watch(client, namespace, name, sys.stdout, interval=args.interval, limit=args.watch_for,
                       json_lines=args.output == "json", first=format_status, note=note)  # fmt: skip
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
    return EXIT_FAILED if st is None or st.failed_job else EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    from jobspec.cluster.logs import follow_log, print_log

    name = _name(args)
    if args.index < 0:
        raise ConfigError(f"--index {args.index}: expected 0 or more")
    if args.follow and args.previous:
        raise ConfigError("--follow and --previous cannot be combined: a previous run has ended")

    def note(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    client, namespace = _connect(args)
    with client:
        if not args.follow:
            print_log(client, namespace, name, args.index, sys.stdout, previous=args.previous, note=note)
            return EXIT_OK
        try:
            follow_log(client, namespace, name, args.index, sys.stdout, note=note)
        except KeyboardInterrupt:
            return 130
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    from jobspec.cluster.cancel import cancel
    from jobspec.cluster.output import format_cancel

    name = _name(args)
    client, namespace = _connect(args)
    with client:
        result = cancel(client, namespace, name, wait=args.wait)
    sys.stdout.write(format_cancel(result))
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    from jobspec.cluster.listing import list_jobs
    from jobspec.cluster.output import format_list, to_json

    client, namespace = _connect(args)
    with client:
        jobs = list_jobs(client, None if args.all_namespaces else namespace)
    if args.output == "json":
        sys.stdout.write(to_json([j.to_dict() for j in jobs]))
    else:
        sys.stdout.write(format_list(jobs, all_namespaces=args.all_namespaces))
    return EXIT_OK
