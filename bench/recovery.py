"""Seconds from an OOM to the next completed step, in process and across a tier restart; steps lost. And a lost
node: seconds from a frozen node to its peer's exit (detected), and to the next completed step after the restart.

    python bench/recovery.py [--steps 12] [--fault-step 6] [--rounds 3] [--vendor cpu|cuda] [--keep DIR]
                             [--only oom|lost-node] [--heartbeat 5]

Runs the real runner (`python -m runner SPEC`, tiny preset) with `JOBSPEC_FAULT_OOM="step=K,backward"`:
the fault fires mid-backward, when the gradient reaches the middle transformer layer's output (after the
forward and half the backward of step K's first micro-step ran). Four scenarios, interleaved per round:
  shrink                  micro-batch 8: step K runs out at 8, shrinks and is redone in process;
  step-down               micro-batch 1: micro-batch 1 runs out, the worker checkpoints step K-1 (the
                          fallback should the process die) and rebuilds itself at the next tier in the
                          same process, handing the trained state over in memory (runner/train/handoff.py);
  step-down, checkpoint   the same with JOBSPEC_STEP_DOWN=checkpoint: the new tier reads the checkpoint back;
  relaunch                JOBSPEC_STEP_DOWN=restart: the worker exits 75 and the supervisor starts a new
                          one at the next tier (the fallback for a poisoned device or a rank-local OOM).
Recovery = time of step K's metrics record - time of the fault (the mtime of the injector's fired-step
file, written just before the error is raised). Usual step = median gap between consecutive train records
at the tier (and micro-batch) training ended with, leaving out step 1 and step K. Steps lost = steps
trained twice, from the sample ids the runner records (JOBSPEC_RECORD_SAMPLES=1: one record per finished
step): every step 1..N must be recorded, a step recorded again was lost and redone, and every run must
have trained each step on the same ids (the goal: 0 lost, same ids).

Lost node (CPU, gloo): two supervisors on loopback as the two nodes of a 2-node job (`scheduling.
heartbeat_timeout_seconds` = --heartbeat); once step 4 is trained (checkpoint step-3 behind it), one node's process
group (supervisor and worker) is frozen with SIGSTOP, rank 1's and then rank 0's (which hosts the c10d store).
Detected = the SIGSTOP -> the other node's exit (EXIT_FAILED, retried by the Job). The harness then acts as the Job
controller: it kills the frozen pod (as the node's eviction would) and starts both pods again at once (no scheduling
delay): next step = the SIGSTOP -> the first train record written after it; steps lost = the last step trained
before the freeze - the step resumed from.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from jobspec.contract import ENV_MASTER_ADDR, ENV_MASTER_PORT, ENV_NNODES, ENV_NODE_RANK, EXIT_FAILED
from runner.oom.faults import FIRED_FILE_TEMPLATE

ROOT = Path(__file__).resolve().parents[1]


def spec_dict(run_dir: Path, *, micro_batch: int, steps: int, vendor: str) -> dict[str, Any]:
    return {
        "name": "bench-recovery",
        "model": {"preset": "tiny"},
        "data": {"max_seq_len": 64},
        "training": {"global_batch": 8, "micro_batch": micro_batch, "learning_rate": 3e-3, "warmup_steps": 2,
                     "steps": steps, "precision": "fp32", "log_every": 1},
        "hardware": {"vendor": vendor, "gpus": 1},
        "memory": {"tier": "fast"},
        "checkpoints": {"dir": str(run_dir), "every_steps": 1000, "keep": 2},
    }  # fmt: skip


def run(run_dir: Path, spec: dict[str, Any], fault: str, **extra: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the runner and its children) of one run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "JOBSPEC_FAULT_OOM": fault, "JOBSPEC_RECORD_SAMPLES": "1", "PYTHONUNBUFFERED": "1",
           **extra}  # fmt: skip
    t0, cpu0 = time.perf_counter(), _child_cpu()
    proc = subprocess.run([sys.executable, "-m", "runner", str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    wall, cpu = time.perf_counter() - t0, _child_cpu() - cpu0
    if proc.returncode != 0:
        (run_dir.parent / f"{run_dir.name}.stderr").write_text(proc.stderr)
        errors = [line for line in proc.stderr.splitlines() if "Error:" in line and "[supervisor]" not in line]
        raise RunnerFailed(f"runner exited {proc.returncode}: {(errors or ['?'])[-1].strip()[:240]}")
    return wall, cpu


class RunnerFailed(Exception):
    """The runner did not finish the scenario (its stderr is kept beside the run directory)."""


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_time(rows: list[dict[str, Any]], skip: set[int]) -> float:
    """Median seconds between consecutive train records at the last record's tier and micro-batch, leaving
    out the steps in `skip`."""
    train = [r for r in rows if r.get("kind") == "train"]
    last = train[-1]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(train) if b["step"] == a["step"] + 1
            and b["step"] not in skip and all((r["tier"], r["micro_batch"]) == (last["tier"], last["micro_batch"])
                                              for r in (a, b))]  # fmt: skip
    return statistics.median(gaps) if gaps else float("nan")


def fault_time(run_dir: Path) -> float:
    """Unix time the fault fired: the injector writes its fired-step file just before raising the OOM."""
    return (run_dir / FIRED_FILE_TEMPLATE.format(rank=0)).stat().st_mtime


def recorded(run_dir: Path, steps: int) -> tuple[int, dict[int, list[int]]]:
    """(steps lost, the ids of each step) from samples-rank0.jsonl; raises when a step is missing or was
    trained twice on different ids."""
    seen: dict[int, list[int]] = {}
    lost = 0
    for line in (run_dir / "samples-rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] in seen:
            lost += 1
            if seen[rec["step"]] != rec["ids"]:
                raise SystemExit(f"{run_dir}: step {rec['step']} was trained again on other samples")
        seen[rec["step"]] = rec["ids"]
    if sorted(seen) != list(range(1, steps + 1)):
        raise SystemExit(f"{run_dir}: recorded steps {sorted(seen)}, expected 1..{steps}")
    return lost, seen


def in_process(base: Path, steps: int, k: int, vendor: str) -> dict[str, Any]:
    run_dir = base / "in_process"
    wall, cpu = run(run_dir, spec_dict(run_dir, micro_batch=8, steps=steps, vendor=vendor), f"step={k},backward")
    rows = metrics(run_dir)
    event = next(r for r in rows if r.get("event") == "oom_shrink")
    done = next(r for r in rows if r.get("kind") == "train" and r["step"] == k)
    lost, ids = recorded(run_dir, steps)
    return {"scenario": "in-process shrink", "recovery_s": done["time"] - fault_time(run_dir),
            "step_s": step_time(rows, {1, k}), "steps_lost": lost, "ids": ids,
            "detail": f"micro-batch {event['from_micro_batch']} -> {event['to_micro_batch']}",
            "wall_s": wall, "cpu_s": cpu}  # fmt: skip


def tier_step_down(base: Path, steps: int, k: int, vendor: str, how: str = "in_process") -> dict[str, Any]:
    run_dir = base / f"tier_{how}"
    spec = spec_dict(run_dir, micro_batch=1, steps=steps, vendor=vendor)
    wall, cpu = run(run_dir, spec, f"step={k},backward", JOBSPEC_STEP_DOWN=how)
    rows = metrics(run_dir)
    state = json.loads((run_dir / "tier_state.json").read_text())
    failed = state["failed"][0]
    plans = [r for r in rows if r.get("kind") == "plan"]
    fired = fault_time(run_dir)
    done = next(r for r in rows if r.get("kind") == "train" and r["step"] == k and r["time"] > fired)
    lost, ids = recorded(run_dir, steps)
    change = next((r for r in rows if r.get("event") == "tier_change"), {})
    where = {"in_process": "in process", "checkpoint": "in process, state from checkpoint", "restart": "relaunch"}
    source = change.get("state", "checkpoint")  # a relaunch has no tier_change event: it resumes a checkpoint
    return {"scenario": f"tier {failed['tier']} -> {plans[-1]['tier']}, {where[how]}",
            "recovery_s": done["time"] - fired, "step_s": step_time(rows, {1, k}), "steps_lost": lost,
            "ids": ids, "detail": f"resumed at step {plans[-1]['step']}, state from {source}",
            "wall_s": wall, "cpu_s": cpu}  # fmt: skip


def _nodes(spec: Path, log_dir: Path) -> list[subprocess.Popen]:
    """Two supervisors on loopback, nodes 0 and 1 of a 2-node job (what a rendered Indexed Job sets by hand)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for node in (0, 1):
        env = {**os.environ, ENV_NNODES: "2", ENV_NODE_RANK: str(node), ENV_MASTER_ADDR: "127.0.0.1",
               ENV_MASTER_PORT: str(port), "PYTHONUNBUFFERED": "1"}  # fmt: skip
        cmd = [sys.executable, "-m", "runner", str(spec), "--nproc", "1"]
        with open(log_dir / f"node{node}.stderr", "a") as err:
            out = subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True))
    return procs


def _until(what: str, ready: Callable[[], bool], procs: list[subprocess.Popen], seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RunnerFailed(f"{what}: a node ended or the wait ran out")
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def lost_node(base: Path, frozen: int, heartbeat_s: int) -> dict[str, Any]:
    run_dir = base / f"lost_rank{frozen}"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {**spec_dict(run_dir, micro_batch=4, steps=100_000, vendor="cpu"),
            "hardware": {"vendor": "cpu", "gpus": 1, "nodes": 2},
            "scheduling": {"heartbeat_timeout_seconds": heartbeat_s}}  # fmt: skip
    spec["checkpoints"]["every_steps"] = 3
    path = base / f"lost_rank{frozen}.yaml"
    path.write_text(yaml.safe_dump(spec))

    def train() -> list[dict[str, Any]]:
        return [r for r in metrics(run_dir) if r.get("kind") == "train"] if (run_dir / "metrics.jsonl").exists() else []

    procs = _nodes(path, base)
    try:
        _until("training", lambda: any(r["step"] >= 4 for r in train()), procs)
        os.killpg(procs[frozen].pid, signal.SIGSTOP)
        stopped, t0 = time.time(), time.monotonic()
        trained = max(r["step"] for r in train())
        code = procs[1 - frozen].wait(timeout=heartbeat_s + 120)
        detected = time.monotonic() - t0
        if code != EXIT_FAILED:
            raise RunnerFailed(f"the surviving node exited {code}, not {EXIT_FAILED}")
    finally:
        _kill(procs)  # the frozen pod goes (its node's eviction); the Job starts both again
    procs = _nodes(path, base)
    try:
        _until("the restart", lambda: any(r["time"] > stopped for r in train()), procs)
    finally:
        _kill(procs)
    plan = [r for r in metrics(run_dir) if r.get("kind") == "plan"][-1]
    after = next(r for r in train() if r["time"] > stopped)
    return {"scenario": f"lost node: rank {frozen} frozen" + (" (hosts the store)" if frozen == 0 else ""),
            "detected_s": detected, "recovery_s": after["time"] - stopped, "steps_lost": trained - plan["step"],
            "detail": f"trained to step {trained}, resumed from step {plan['step']}"}  # fmt: skip


def report_lost_node(rounds: list[dict[str, Any]], failed: list[str], heartbeat_s: int, n: int) -> None:
    print(f"Lost node (cpu, 2 nodes x 1 process on loopback, heartbeat timeout {heartbeat_s} s, SIGSTOP after step 4, "
          f"restart at once; medians of {n} rounds):")  # fmt: skip
    for why in failed:
        print(f"  lost node FAILED {why}")
    for name in dict.fromkeys(r["scenario"] for r in rounds):
        rs = [r for r in rounds if r["scenario"] == name]
        med = {k: statistics.median(r[k] for r in rs) for k in ("detected_s", "recovery_s")}
        print(f"  {name:42s} lost -> detected {med['detected_s']:5.2f} s; lost -> next completed step "
              f"{med['recovery_s']:5.2f} s; steps lost {sorted({r['steps_lost'] for r in rs})}")  # fmt: skip
        print(f"      {rs[0]['detail']}; detected per round: " + ", ".join(f"{r['detected_s']:.2f} s" for r in rs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fault-step", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--vendor", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("--only", choices=("oom", "lost-node"), default=None, help="one family of scenarios")
    parser.add_argument("--heartbeat", type=int, default=5, help="lost node: scheduling.heartbeat_timeout_seconds")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="jobspec-recovery-"))
    if args.only != "oom":
        lost, why = [], []
        for i in range(args.rounds):
            for frozen in (1, 0):
                try:
                    lost.append(lost_node(base / f"round{i}", frozen, args.heartbeat))
                except (RunnerFailed, subprocess.TimeoutExpired) as err:
                    why.append(f"round {i}, rank {frozen} frozen: {err}")
        report_lost_node(lost, why, args.heartbeat, args.rounds)
    if args.only == "lost-node":
        return
    scenarios = {
        "shrink": lambda d: in_process(d, args.steps, args.fault_step, args.vendor),
        "step-down": lambda d: tier_step_down(d, args.steps, args.fault_step, args.vendor, "in_process"),
        "step-down, checkpoint": lambda d: tier_step_down(d, args.steps, args.fault_step, args.vendor, "checkpoint"),
        "relaunch": lambda d: tier_step_down(d, args.steps, args.fault_step, args.vendor, "restart"),
    }
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios}
    failed: dict[str, list[str]] = {name: [] for name in scenarios}
    for i in range(args.rounds):  # interleaved: each round runs every scenario once, in turn
        for name, scenario in scenarios.items():
            try:
                rounds[name].append(scenario(base / f"round{i}"))
            except RunnerFailed as err:
                failed[name].append(f"round {i}: {err}")
    first = next((rs[0]["ids"] for rs in rounds.values() if rs), None)
    print(f"OOM recovery ({args.vendor}, tiny preset, global batch 8, fault mid-backward at step {args.fault_step}; "
          f"medians of {args.rounds} interleaved rounds):")  # fmt: skip
    for name, rs in rounds.items():
        for why in failed[name]:
            print(f"  {name:60s} FAILED {why}")
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in ("recovery_s", "step_s", "wall_s", "cpu_s")}
        ratio = statistics.median(r["recovery_s"] / r["step_s"] for r in rs)
        lost = sorted({r["steps_lost"] for r in rs})
        same = "same ids" if all(r["ids"] == first for r in rs) else "OTHER IDS"
        print(
            f"  {rs[0]['scenario']:60s} OOM -> next step {med['recovery_s']:5.2f} s = {ratio:4.1f} usual steps "
            f"({med['step_s']:.3f} s); steps lost {lost}, {same}; run {med['wall_s']:.1f} s wall, "
            f"{med['cpu_s']:.1f} s CPU"
        )
        print(f"      {rs[0]['detail']}; per round: " + ", ".join(f"{r['recovery_s']:.2f} s" for r in rs))


if __name__ == "__main__":
    main()
