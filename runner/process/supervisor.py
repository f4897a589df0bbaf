"""The in-pod supervisor behind `python -m runner SPEC [--set k=v ...] [--nproc N]`.

It loads and validates the spec (a bad one: the message and exit 2, no traceback), fetches a hub model once
for the node (runner/process/hub.py: the workers get the local snapshot as model.path) and the s3:// data sources
(runner/process/remote_data.py: the workers get the local copies as data.path ...), decides how many
processes this node runs, starts them (`python -m runner.process.worker`) with the torchrun-style variables
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, forwards the stop signals
(SIGTERM, SIGINT, SIGHUP, SIGQUIT: as SIGTERM), makes its workers die with it when it is killed (lifeline.py),
maps their exits to the contract's codes (jobspec.contract) and writes a one-line JSON termination
message (exit_code, reason, tier, step, loss) to /dev/termination-log when it exists, or to
$JOBSPEC_TERMINATION_LOG.

Processes per node: --nproc, else $JOBSPEC_NPROC_PER_NODE, else `hardware.gpus.count` (processes for
vendor cpu; capped at the GPUs visible otherwise), else 1. Several nodes: the rendered pod sets
JOBSPEC_NNODES, JOBSPEC_NODE_RANK (else JOB_COMPLETION_INDEX), JOBSPEC_MASTER_ADDR, JOBSPEC_MASTER_PORT.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobspec.cli import add_spec_args
from jobspec.contract import (
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_NNODES,
    ENV_NODE_RANK,
    ENV_NPROC_PER_NODE,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_OOM_LAST_TIER,
    EXIT_OOM_RETRY_TIER,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    RDZV_PORT,
    TERMINATION_MESSAGE_PATH,
)
from jobspec.errors import EXIT_DOCS, TROUBLESHOOTING, ConfigError, JobspecError, docs_link, see
from jobspec.spec.loader import load_spec
from jobspec.spec.models import JobSpec
from runner.checkpoint import run_files
from runner.oom import relaunch
from runner.oom.ladder import MESSAGE_LIMIT
from runner.process import hub, lifeline, preflight, redaction
from runner.sizing.hostmem import host_oom, oom_kills

log = logging.getLogger("jobspec.runner")
KILL_GRACE_S = float(os.environ.get("JOBSPEC_KILL_GRACE_S", "30"))  # after one rank fails, before SIGKILL
# Of the pod's grace period after SIGTERM, what the supervisor keeps for itself: it kills workers that have not
# stopped by then and still writes its termination message and exits before the kubelet's SIGKILL.
STOP_MARGIN_S = 10.0
# When ranks end differently, the most telling code wins (config > storage > OOM ladder > failure > preempted > ok).
_PRIORITY = [EXIT_CONFIG, EXIT_STORAGE, EXIT_OOM_LAST_TIER, EXIT_OOM_RETRY_TIER, EXIT_FAILED, EXIT_PREEMPTED, EXIT_OK]
# Caught and passed on to the workers as SIGTERM (checkpoint, exit 143): the kubelet's and `docker stop`'s SIGTERM,
# Ctrl-C, a closed terminal's SIGHUP, Ctrl-\ or `kill -QUIT`. Left to their default action, the last two would end
# this process without a termination message; the workers' lifeline would still stop them. SIGKILL cannot be caught:
# the lifeline alone covers it.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@dataclass(frozen=True)
class Topology:
    nnodes: int
    node_rank: int
    nproc: int  # processes on this node
    master_addr: str
    master_port: int
    cpu: bool  # workers train on the CPU

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc


@dataclass
class Outcome:
    exit_code: int
    reason: str
    status: dict[str, Any] = field(default_factory=dict)  # rank 0's tier, step, loss, reason

    def docs(self) -> str | None:
        """The troubleshooting section of this ending: the error class's, when a worker (or this process) named
        one, else its exit code's; None for a success or a preemption."""
        named = self.status.get("docs")
        if isinstance(named, str) and re.fullmatch(rf"{re.escape(TROUBLESHOOTING)}#[a-z0-9-]{{1,80}}", named):
            return named
        return f"{TROUBLESHOOTING}#{EXIT_DOCS[self.exit_code]}" if self.exit_code in EXIT_DOCS else None

    def message(self) -> str:
        """One JSON line of at most MESSAGE_LIMIT bytes: the reason is shortened, never the JSON cut."""
        s = self.status
        reason = redaction.scrubbed(self.reason, token_like=True)  # before it is cut: a cut secret is unrecognisable
        record = {"exit_code": self.exit_code, "reason": reason, "tier": s.get("tier"), "step": s.get("step"),
                  "loss": s.get("loss")}  # fmt: skip
        text = json.dumps(record)
        while len(text.encode()) > MESSAGE_LIMIT and record["reason"]:
            over = len(text.encode()) - MESSAGE_LIMIT
            record["reason"] = record["reason"][: max(0, len(record["reason"]) - over - 3)] + "..."
            text = json.dumps(record)
        return text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _cpu_fallback(spec: JobSpec) -> int:
    """Processes for a GPU spec on a machine without a GPU: no more than its CPUs, dividing the batch."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    asked = spec.hardware.gpus.count
    n = max(d for d in range(1, min(asked, cores) + 1) if spec.training.global_batch % d == 0)
    nodes = f"{spec.hardware.nodes} nodes x " if spec.hardware.nodes > 1 else ""
    log.warning(
        "the spec asks for %s%d %s GPU(s) (%s) and this machine has none: running 1 node x %d CPU process(es) "
        "(gloo) instead, same global batch %d; --nproc N to choose",
        nodes, asked, spec.hardware.gpus.type or "", spec.hardware.vendor, n, spec.training.global_batch,
    )  # fmt: skip
    return n


def topology(spec: JobSpec, nproc: int | None) -> Topology:
    env = os.environ
    gpus = 0 if spec.hardware.vendor == "cpu" else _visible_gpus()
    if nproc is None and env.get(ENV_NPROC_PER_NODE):
        nproc = int(env[ENV_NPROC_PER_NODE])
    if nproc is None and spec.hardware.vendor != "cpu" and not gpus:
        nproc = _cpu_fallback(spec)
    if nproc is None:
        nproc = spec.hardware.gpus.count if not gpus else min(gpus, spec.hardware.gpus.count)
        if gpus and gpus != spec.hardware.gpus.count:
            log.info(
                "%d GPUs visible, spec asks for %d per node: starting %d processes",
                gpus,
                spec.hardware.gpus.count,
                nproc,
            )
    if nproc < 1 or (gpus and nproc > gpus):
        raise ConfigError(f"--nproc {nproc}: need between 1 and {gpus or 'any number of'} processes on this node")
    nnodes = int(env.get(ENV_NNODES, "1"))
    node_rank = int(env.get(ENV_NODE_RANK, env.get("JOB_COMPLETION_INDEX", "0")))
    if nnodes > 1 and not env.get(ENV_MASTER_ADDR):
        raise ConfigError(f"{ENV_NNODES} > 1 needs {ENV_MASTER_ADDR} (set by the rendered pod)")
    addr = env.get(ENV_MASTER_ADDR, "127.0.0.1")
    port = int(env.get(ENV_MASTER_PORT, "0")) or (_free_port() if nnodes == 1 else RDZV_PORT)
    topo = Topology(nnodes, node_rank, nproc, addr, port, cpu=not gpus)
    if spec.training.global_batch % topo.world_size:
        raise ConfigError(
            f"training.global_batch {spec.training.global_batch} does not split over "
            f"{topo.world_size} processes ({nnodes} nodes x {nproc}); "
            f"use a multiple of {topo.world_size}"
        )
    return topo


class Workers:
    """The worker processes of one attempt."""

    def __init__(self, spec_path: str, overrides: list[str], topo: Topology, status_file: str, stop_grace_s: float):
        self.procs: list[subprocess.Popen] = []
        self.killed: set[int] = set()  # local ranks we SIGKILLed ourselves
        self.stop_grace_s = stop_grace_s  # after a stop signal, before SIGKILL
        self.overran = False  # a stop signal came and some worker had not stopped within stop_grace_s
        cmd = [sys.executable, "-m", "runner.process.worker", spec_path, *[a for o in overrides for a in ("--set", o)]]
        threads = str(max(1, (os.cpu_count() or 1) // topo.nproc))
        for local in range(topo.nproc):
            env = {
                **os.environ,
                "RANK": str(topo.node_rank * topo.nproc + local),
                "LOCAL_RANK": str(local),
                "WORLD_SIZE": str(topo.world_size),
                "LOCAL_WORLD_SIZE": str(topo.nproc),
                "MASTER_ADDR": topo.master_addr,
                "MASTER_PORT": str(topo.master_port),
                "JOBSPEC_STATUS_FILE": status_file,
                # Each worker stops when this process dies (lifeline.py): it knows it by pid, and gets the grace
                # this process would have given it. Popen forks from this thread, the main thread (run_attempt
                # installs signal handlers, which only the main thread may), whose exit is the process's.
                lifeline.ENV_PARENT: str(os.getpid()),
                lifeline.ENV_GRACE: str(stop_grace_s),
            }
            if topo.cpu:  # the ranks share the cores: one thread pool each would oversubscribe
                env.setdefault("OMP_NUM_THREADS", threads)
            self.procs.append(subprocess.Popen(cmd, env=env))

    def signal_all(self, sig: int) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                if sig == signal.SIGKILL:
                    self.killed.add(i)
                p.send_signal(sig)

    def wait(self, stopping: list[bool]) -> list[int]:
        """Wait for every worker. After one fails, the rest get SIGTERM and, KILL_GRACE_S later, SIGKILL
        (a rank blocked in a collective with a dead peer never returns by itself). After a stop signal (which
        `forward` passed on), the ones still running `stop_grace_s` later are killed: a worker in a long C call
        (a huge allocation) cannot see the signal, and the pod must end within its grace period."""
        deadline = stop_deadline = None
        while any(p.poll() is None for p in self.procs):
            if stopping[0] and stop_deadline is None:
                stop_deadline = time.monotonic() + self.stop_grace_s
            if stop_deadline is not None and time.monotonic() > stop_deadline and not self.overran:
                log.warning("the workers did not stop within %.0f s of the signal: killing them", self.stop_grace_s)
                self.overran = True
                self.signal_all(signal.SIGKILL)
            failed = [p for p in self.procs if p.returncode not in (None, 0)]
            if failed and deadline is None and not stopping[0]:
                log.warning("a worker exited with %s; stopping the others", failed[0].returncode)
                self.signal_all(signal.SIGTERM)
                deadline = time.monotonic() + KILL_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                self.signal_all(signal.SIGKILL)
            time.sleep(0.1)
        return [int(p.returncode) for p in self.procs]


def combine(codes: list[int], killed: set[int] = frozenset(), overran: bool = False) -> tuple[int, str]:
    """One exit code and reason for the node from its workers' return codes (negative: killed by a signal).
    `overran`: the workers in `killed` were killed for not stopping within the grace period of a stop signal."""
    if overran and any(c == -signal.SIGKILL for r, c in enumerate(codes) if r in killed):
        return EXIT_PREEMPTED, (
            "stopped by a signal; a worker did not stop within the grace period and was killed: the steps since "
            "the last checkpoint are lost (raise scheduling.termination_grace_seconds if checkpoints take longer)"
        )
    mapped = {}
    for rank, c in enumerate(codes):
        if c == -signal.SIGKILL and rank not in killed:
            return EXIT_FAILED, (
                f"worker {rank} was killed by SIGKILL: likely the host ran out of memory (the "
                "container's memory limit); raise hardware.memory or use a lower memory tier"
            )
        mapped[rank] = EXIT_PREEMPTED if c == -signal.SIGTERM else c if c in _PRIORITY else EXIT_FAILED
    code = min(mapped.values(), key=_PRIORITY.index)
    first = next(r for r, c in mapped.items() if c == code)
    reasons = {  # rank 0's own reason replaces these when it wrote one (run_attempt)
        EXIT_OK: "done",
        # without rank 0's report it was stopped before it could train (killed by the signal while starting)
        EXIT_PREEMPTED: "stopped by a signal before training started: no checkpoint written by this attempt",
        EXIT_CONFIG: "bad spec or data",
        EXIT_STORAGE: "the checkpoint volume is full, read-only or not writable",
        EXIT_OOM_RETRY_TIER: "out of memory at micro-batch 1: retry at the next tier",
        EXIT_OOM_LAST_TIER: "out of memory at the last tier",
    }
    return code, reasons.get(code, f"worker {first} failed with exit code {codes[first]}")


def termination_log() -> Path | None:
    if os.environ.get("JOBSPEC_TERMINATION_LOG"):
        return Path(os.environ["JOBSPEC_TERMINATION_LOG"])
    path = Path(TERMINATION_MESSAGE_PATH)
    return path if path.exists() and os.access(path, os.W_OK) else None


def run_attempt(spec_path: str, overrides: list[str], topo: Topology, stopping: list[bool],
                stop_grace_s: float = 120 - STOP_MARGIN_S) -> Outcome:  # fmt: skip
    """Start the workers once and wait for them (killed `stop_grace_s` after a stop signal)."""
    fd, status_file = tempfile.mkstemp(prefix="jobspec-status-", suffix=".json")
    os.close(fd)
    started: list[Workers] = []

    def forward(signum: int, frame: object) -> None:
        stopping[0] = True
        log.warning("signal %d: asking the workers to checkpoint and stop", signum)
        for workers in started:
            workers.signal_all(signal.SIGTERM)

    # Installed before the workers start: a signal meanwhile must not kill this process and orphan them.
    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        log.info(
            "starting %d worker(s): node %d of %d, world size %d, master %s:%d",
            topo.nproc,
            topo.node_rank,
            topo.nnodes,
            topo.world_size,
            topo.master_addr,
            topo.master_port,
        )
        kills = oom_kills()  # the kernel's OOM kills so far: a later one tells a host OOM
        workers = Workers(spec_path, overrides, topo, status_file, stop_grace_s)
        started.append(workers)
        if stopping[0]:  # the signal came while they were being started
            workers.signal_all(signal.SIGTERM)
        codes = workers.wait(stopping)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    code, reason = combine(codes, workers.killed, workers.overran)
    if code == EXIT_FAILED and (host := host_oom(kills, oom_kills())):
        reason = host
    try:
        status = json.loads(Path(status_file).read_text() or "{}")
    except (OSError, ValueError):
        status = {}
    finally:
        Path(status_file).unlink(missing_ok=True)
    worker_reason = status.get("reason")
    if code not in (EXIT_OK, EXIT_FAILED) and worker_reason:
        reason = worker_reason  # the worker's own words (e.g. which tier ran out of memory)
    elif code == EXIT_FAILED and worker_reason not in (None, "starting", "running"):
        reason = f"{reason}: {worker_reason}"
    return Outcome(code, reason, status)


def supervise(spec: JobSpec, spec_path: str, overrides: list[str], nproc: int | None) -> Outcome:
    """Run the job on this node, relaunched down the OOM tier ladder (runner.oom.relaunch.supervise).

    The stop signals are caught for the whole ladder, not only while workers run: one that arrives between
    two launches (the relaunch wait) starts no new launch and ends the run as preempted, with its
    termination message, instead of killing this process with the default action."""
    topo, stopping, last = topology(spec, nproc), [False], []  # stopping: set by a stop signal
    grace = max(1.0, spec.scheduling.termination_grace_seconds - STOP_MARGIN_S)

    def between(signum: int, frame: object) -> None:
        stopping[0] = True
        log.warning("signal %d between two launches: no relaunch", signum)

    def launch(tier: str) -> int:  # the workers read the tier from the tier state themselves
        if stopping[0]:
            status = last[0].status if last else {}  # the previous launch's tier, step and loss
            last[:] = [Outcome(EXIT_PREEMPTED, f"stopped by a signal before the relaunch at tier {tier}", status)]
        else:
            last[:] = [run_attempt(spec_path, overrides, topo, stopping, grace)]
        return last[0].exit_code

    # a pod with a bucket and an empty run directory (another node, a pod the Job created again): the ladder's state
    # and the metrics an earlier pod kept beside the steps, before the ladder reads them (runner/checkpoint/run_files)
    run_files.get(spec.checkpoints.dir, Path(spec.run_dir))
    previous = {s: signal.signal(s, between) for s in STOP_SIGNALS}
    try:
        r = relaunch.supervise(launch, spec.run_dir, spec.memory.tier, world_size=topo.world_size,
                               per_rank_batch=spec.training.global_batch // topo.world_size,
                               fallback=spec.memory.fallback, relaunch=topo.nnodes == 1,
                               low_bit=spec.training.optimizer == "auto")  # fmt: skip
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    same = r.exit_code == last[-1].exit_code and not (r.message and r.exit_code != EXIT_OK)
    return last[-1] if same else Outcome(r.exit_code, r.message or last[-1].reason, last[-1].status)


def with_hub_model(spec_path: str, spec: JobSpec, overrides: list[str]) -> tuple[JobSpec, list[str]]:
    """A hub `model.path` fetched once for this node (runner/process/hub.py), before any worker starts: the spec
    and the workers' overrides then name the local snapshot, so no rank downloads and all read one commit."""
    snapshot = hub.fetch_model(spec)
    if snapshot is None:
        return spec, overrides
    overrides = [*overrides, f"model.path={json.dumps(snapshot)}"]  # quoted: the value is read as YAML
    return load_spec(spec_path, overrides), overrides


def with_object_data(spec_path: str, spec: JobSpec, overrides: list[str]) -> tuple[JobSpec, list[str]]:
    """Every `s3://` data source downloaded once for this node into the data cache (runner/process/remote_data.py),
    before any worker starts: the spec and the workers' overrides then name the local copies."""
    from jobspec.spec.object_store import is_url

    d = spec.data
    if not any(is_url(p) for p in (d.path, d.eval_path, *(s.path for s in d.sources or ()))):
        return spec, overrides  # the usual case: remote_data (and the numpy it imports) not loaded
    from runner.process import remote_data

    local = remote_data.localize(spec)
    overrides = [*overrides, *local]
    return load_spec(spec_path, overrides), overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner", description="Train the job a spec describes.")
    add_spec_args(parser)
    parser.add_argument("--nproc", type=int, default=None, help="processes on this node (CPU: gloo ranks)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s [supervisor] %(message)s",
        datefmt="%H:%M:%S",
    )
    redaction.install()
    try:
        spec = load_spec(args.spec, args.overrides)
        spec, overrides = with_hub_model(args.spec, spec, args.overrides)
        spec, overrides = with_object_data(args.spec, spec, overrides)
        preflight.check(spec)  # a missing file, extra or bad fault rule: seconds, not a minute of imports
        done = preflight.finished(spec)
        if done:
            log.info("%s", done)
            outcome = Outcome(EXIT_OK, "done (already complete)")
        else:
            outcome = supervise(spec, str(Path(args.spec).resolve()), overrides, args.nproc)
    except JobspecError as err:
        print(redaction.scrubbed(str(err)), file=sys.stderr)
        outcome = Outcome(err.exit_code, str(err).splitlines()[0], {"docs": docs_link(err)})
    if outcome.exit_code != EXIT_OK:
        level = logging.WARNING if outcome.exit_code == EXIT_PREEMPTED else logging.ERROR
        log.log(level, "exit %d: %s", outcome.exit_code, outcome.reason)
        if outcome.docs():  # the last line, as the CLI's errors end: where the fix is explained
            print(see(outcome.docs()), file=sys.stderr)
    path = termination_log()
    if path is not None:
        try:
            path.write_text(outcome.message() + "\n")
        except OSError as err:
            log.warning("cannot write the termination message to %s: %s", path, err)
    return outcome.exit_code
