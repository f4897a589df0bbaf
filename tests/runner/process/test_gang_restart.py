"""The gang survives a lost node: two supervisors on loopback (gloo) as the two pods of a 2-node Indexed Job, and this
test as the Job controller: an index whose pod exits with the retryable code (EXIT_FAILED) gets a new pod at once;
the lost pod's own replacement arrives later (REPLACEMENT_S after the loss: a node that hangs is declared lost by
Kubernetes only after a while). Each new pod finds the gang's master at a new port, as a new pod finds rank 0's new
pod IP through the headless Service.

What must hold, for a pod frozen with SIGSTOP (rank 1, and rank 0, which hosts the c10d store) and one killed with
SIGKILL: training again within RESUME_S of the loss, every step 1..N trained, each step on the same sample ids as the
run without the fault (a step redone after the restart on the ids it had before, every step on the ids of the data
order, a pure function of the seed and the step), and the frozen process, resumed with SIGCONT once the new gang has
finished, writes nothing.

The run-directory lease: on a cluster the replacement of index 0 takes over the frozen holder's lease at once (same
hostname `<job>-0`, another PID namespace: tests/runner/checkpoint/test_lease.py). Here every pod shares one kernel and
PID namespace and the frozen holder's process still exists, so the lease is taken over when its renewals stop for
LEASE_S (JOBSPEC_LEASE_TIMEOUT_S), well before the replacement arrives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobspec.contract import ENV_MASTER_ADDR, ENV_MASTER_PORT, ENV_NNODES, ENV_NODE_RANK, EXIT_FAILED
from tests.runner.process.test_lost_node import SLACK_S, assert_wrote_nothing, end, free_port, snapshot, wait_for_step
from tests.runner.train_helpers import ROOT, records, runner_env, timeout_s, tiny_spec_dict, write_spec

pytestmark = pytest.mark.slow
HEARTBEAT_S = 3  # scheduling.heartbeat_timeout_seconds
LEASE_S = 8  # JOBSPEC_LEASE_TIMEOUT_S (see the module docstring)
RESUME_S = 120  # the goal: loss -> training again
STEPS, EVERY = 40, 3  # steps of the run; checkpoint every EVERY steps


class Controller:
    """The Job controller for the two indexes: starts pods, each new generation at a new master port."""

    def __init__(self, tmp_path: Path, spec: Path):
        self.tmp_path, self.spec = tmp_path, spec
        self.pods: dict[int, subprocess.Popen] = {}
        self.old: list[subprocess.Popen] = []  # pods replaced, kept to end them in `close`
        self.starts = 0

    def start(self, index: int, port: int) -> subprocess.Popen:
        if index in self.pods:
            self.old.append(self.pods[index])
        self.starts += 1
        env = runner_env(**{ENV_NNODES: "2", ENV_NODE_RANK: str(index), ENV_MASTER_ADDR: "127.0.0.1",
                            ENV_MASTER_PORT: str(port), "JOBSPEC_DIST_TIMEOUT_S": "", "JOBSPEC_RECORD_SAMPLES": "1",
                            "JOBSPEC_LEASE_TIMEOUT_S": str(LEASE_S),
                            "JOBSPEC_TERMINATION_LOG": str(self.tmp_path / f"termination-{self.starts}")})  # fmt: skip
        log = open(self.tmp_path / f"pod-{self.starts}-index{index}.stderr", "w")  # noqa: SIM115 (the pod's life)
        pod = subprocess.Popen([sys.executable, "-m", "runner", str(self.spec), "--nproc", "1"], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)  # fmt: skip
        log.close()
        self.pods[index] = pod
        return pod

    def stderr(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.tmp_path.glob("pod-*.stderr")))

    def close(self) -> None:
        end([*self.old, *self.pods.values()])


def sample_records(run: Path) -> dict[int, list[dict]]:
    """rank -> the sample records it wrote (JOBSPEC_RECORD_SAMPLES), in order."""
    out: dict[int, list[dict]] = {}
    for path in run.glob("samples-rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rec["rank"], []).append(rec)
    return out


def expected_ids(spec: Path) -> dict[int, dict[int, list[int]]]:
    """rank -> step -> the ids the data order gives it (the runner's own functions: a run without a fault)."""
    from jobspec.spec.loader import load_spec
    from runner.data.dataset import DataOrder, load_data, rank_slice
    from runner.data.tokenizer import ByteTokenizer

    job = load_spec(spec)
    data = load_data(job, ByteTokenizer())
    order = DataOrder(len(data.train), job.training.global_batch, job.training.seed)
    return {r: {s: rank_slice(order.step_samples(s - 1), r, 2) for s in range(1, STEPS + 1)} for r in (0, 1)}


@pytest.mark.parametrize(
    ("lost", "how", "replacement_s"),
    [(1, signal.SIGSTOP, 10), (0, signal.SIGSTOP, 30),
     # the sweep tier (pytest -m sweep): a killed node's gang restart is also test_multinode's killed-node case
     pytest.param(1, signal.SIGKILL, 10, marks=pytest.mark.sweep)],
    ids=["rank1-frozen", "rank0-store-host-frozen", "rank1-killed"],
)
def test_the_gang_restarts_together_and_trains_every_step_on_the_same_samples(tmp_path, lost, how, replacement_s):
    run, survivor = tmp_path / "run", 1 - lost
    spec = write_spec(tmp_path / "gang.yaml", tiny_spec_dict(
        run, hardware={"vendor": "cpu", "gpus": 1, "nodes": 2}, training={"micro_batch": 4, "steps": STEPS},
        checkpoints={"every_steps": EVERY}, scheduling={"heartbeat_timeout_seconds": HEARTBEAT_S}))  # fmt: skip
    jobs = Controller(tmp_path, spec)
    try:
        port = free_port()
        first = [jobs.start(i, port) for i in (0, 1)]
        wait_for_step(run, first, 4)
        os.killpg(first[lost].pid, how)
        lost_wall, lost_at = time.time(), time.monotonic()
        trained = max(r["step"] for r in records(run))
        try:
            code = first[survivor].wait(timeout=HEARTBEAT_S + SLACK_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {survivor} still waits {HEARTBEAT_S + SLACK_S:.0f} s after the loss") from None
        assert code == EXIT_FAILED, jobs.stderr()

        port = free_port()  # the new pods' master: rank 0's new pod
        jobs.start(survivor, port)  # its pod failed with the retryable code: the Job starts a new one at once
        time.sleep(max(0.0, lost_at + replacement_s - time.monotonic()))
        jobs.start(lost, port)  # the lost node's replacement
        new = [jobs.pods[0], jobs.pods[1]]
        for pod in new:
            try:
                assert pod.wait(timeout=timeout_s(RESUME_S + 60)) == 0, jobs.stderr()
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the restarted gang did not finish\n{jobs.stderr()}") from None

        again = next(r for r in records(run) if r["time"] > lost_wall)
        back_s = again["time"] - lost_wall
        print(f"rank {lost} lost ({how.name}) at step {trained}: training again after {back_s:.1f} s")
        assert again["time"] - lost_wall < RESUME_S
        assert {r["step"] for r in records(run)} == set(range(1, STEPS + 1))

        # every step trained on its own ids, on both ranks; a step redone after the restart on the ids it had
        want, seen = expected_ids(spec), sample_records(run)
        for rank in (0, 1):
            steps = {rec["step"] for rec in seen[rank]}
            assert steps == set(range(1, STEPS + 1)), f"rank {rank} misses steps {set(range(1, STEPS + 1)) - steps}"
            for rec in seen[rank]:
                assert rec["ids"] == want[rank][rec["step"]], (rank, rec)
        resumed = [r for r in records(run, "plan") if r["time"] > lost_wall]
        assert resumed and resumed[0]["step"] <= trained and resumed[0]["step"] % EVERY == 0, resumed

        if how == signal.SIGSTOP:  # the frozen pod wakes after the gang moved on: it must write nothing
            before = snapshot(run)
            os.killpg(first[lost].pid, signal.SIGCONT)
            try:
                first[lost].wait(timeout=SLACK_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {lost}'s frozen pod did not end after it was resumed") from None
            assert first[lost].returncode == EXIT_FAILED
            assert_wrote_nothing(run, before)
    finally:
        jobs.close()
