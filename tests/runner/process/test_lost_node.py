"""A lost node, on the runner's side: two supervisors on loopback (gloo), each one node of a 2-node job, one of them
frozen mid-run with SIGSTOP on its process group (supervisor and worker: a machine that hangs, its sockets open).

The heartbeat (runner/process/heartbeat.py) must notice within `scheduling.heartbeat_timeout_seconds`: the other
node exits with the code the Job retries (EXIT_FAILED) and says which rank was lost and at which step, instead of
waiting in a collective until the collective timeout. Frozen: node 1 (rank 1), and node 0 (rank 0, which hosts the
c10d store: there the store itself stops answering). Resumed with SIGCONT afterwards, the frozen node finds that it
stalled and exits too, without writing anything. With the heartbeat off, `scheduling.collective_timeout_seconds`
bounds the wait instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobspec.contract import ENV_MASTER_ADDR, ENV_MASTER_PORT, ENV_NNODES, ENV_NODE_RANK, EXIT_FAILED
from tests.runner.train_helpers import ROOT, Drained, records, runner_env, timeout_s, tiny_spec_dict, write_spec

pytestmark = pytest.mark.slow
HEARTBEAT_S = 5  # scheduling.heartbeat_timeout_seconds in these tests
COLLECTIVE_S = 10  # scheduling.collective_timeout_seconds (its least) where the heartbeat is off
SLACK_S = 8.0  # beyond the timeout: a beat interval or two, the exit, a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_nodes(tmp_path: Path, spec: Path) -> list[subprocess.Popen]:
    port, nodes = free_port(), []
    for node in (0, 1):
        env = runner_env(**{ENV_NNODES: "2", ENV_NODE_RANK: str(node), ENV_MASTER_ADDR: "127.0.0.1",
                            ENV_MASTER_PORT: str(port), "JOBSPEC_DIST_TIMEOUT_S": "",
                            "JOBSPEC_TERMINATION_LOG": str(tmp_path / f"termination-{node}")})  # fmt: skip
        nodes.append(Drained([sys.executable, "-m", "runner", str(spec), "--nproc", "1"], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))  # fmt: skip
    return nodes


def wait_for_step(run: Path, nodes: list[subprocess.Popen], step: int) -> None:
    deadline = time.monotonic() + timeout_s()
    while not any(r["step"] >= step for r in records(run)):
        assert all(p.poll() is None for p in nodes), "a node ended before training was under way"
        assert time.monotonic() < deadline, f"waited for step {step}"
        time.sleep(0.1)


def freeze(tmp_path: Path, frozen: int, scheduling: dict, within_s: float) -> tuple[list[subprocess.Popen], str]:
    """Start the two nodes, freeze node `frozen` once step 4 is trained (a checkpoint behind it) and return the
    nodes and the survivor's stderr, once it has exited; fails when it still runs `within_s` after the SIGSTOP."""
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "lost.yaml", tiny_spec_dict(
        run, hardware={"vendor": "cpu", "gpus": 1, "nodes": 2}, training={"micro_batch": 4, "steps": 10_000},
        checkpoints={"every_steps": 3}, scheduling=scheduling))  # fmt: skip
    nodes = start_nodes(tmp_path, spec)
    survivor = nodes[1 - frozen]
    wait_for_step(run, nodes, 4)
    os.killpg(nodes[frozen].pid, signal.SIGSTOP)  # the whole pod: supervisor and worker
    lost_at = time.monotonic()
    try:
        _, err = survivor.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"node {1 - frozen} still waits {within_s:.0f} s after the loss") from None
    print(f"rank {frozen} frozen: node {1 - frozen} exited {time.monotonic() - lost_at:.1f} s after the SIGSTOP")
    return nodes, err


def snapshot(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))}


# A temporary of jobspec.shared_dir.write_atomic (`temp_name`): `.<name>.<16 hex>.tmp`
TEMPORARY = re.compile(r"\..+\.[0-9a-f]{16}\.tmp")
SHARD_IN_TEMP = re.compile(r"\.tmp-step-\d+-[0-9a-f]+/__\d+_\d+\.distcp")  # store.temp_dir of an attempt, a shard


def assert_wrote_nothing(run: Path, before: dict[str, tuple[int, int]]) -> None:
    """A pod woken after its gang moved on changed nothing in `run` since `before`: no checkpoint, metrics line,
    sample record or lease. It may have been frozen in the middle of a write: its temporary is then in `before`, and
    on waking its lease check fails and it removes that temporary without renaming it (write_atomic's `ready`).
    Or in the middle of its checkpoint shard, which its fence checks between writes (runner/checkpoint/store.py
    GUARD_S): the one write under way completes on waking, so that shard, in its attempt's temp dir that no
    attempt publishes, may have grown. Only such a temporary may be gone and such a shard longer; anything added,
    changed or otherwise removed is a write."""
    after = snapshot(run)
    own = {k for k in before.keys() - after.keys() if TEMPORARY.fullmatch(Path(k).name)}
    grown = {k for k in before.keys() & after.keys() if SHARD_IN_TEMP.fullmatch(k) and after[k][0] > before[k][0]}
    assert {k: v for k, v in after.items() if k not in grown} == {
        k: v for k, v in before.items() if k not in own | grown
    }


def end(nodes: list[subprocess.Popen]) -> None:
    for proc in nodes:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("frozen", [1, 0], ids=["rank1-frozen", "rank0-store-host-frozen"])
def test_a_frozen_node_is_detected_in_seconds_and_the_survivor_exits_retryable(tmp_path, frozen):
    nodes: list[subprocess.Popen] = []
    run, survivor = tmp_path / "run", 1 - frozen
    try:
        nodes, err = freeze(tmp_path, frozen, {"heartbeat_timeout_seconds": HEARTBEAT_S}, HEARTBEAT_S + SLACK_S)
        assert nodes[survivor].returncode == EXIT_FAILED, err[-3000:]
        assert f"gang: rank {frozen} lost" in err, err[-3000:]
        message = json.loads((tmp_path / f"termination-{survivor}").read_text())
        assert message["exit_code"] == EXIT_FAILED and f"rank {frozen} lost" in message["reason"], message
        assert message["step"] >= 4 and "newest checkpoint step-" in message["reason"], message
        if survivor == 0:  # rank 0 writes the metrics
            (event,) = [r for r in records(run, "event") if r.get("event") == "member_lost"]
            assert event["member"] == frozen and event["step"] == message["step"] and event["by"] == 0, event

        before = snapshot(run)
        os.killpg(nodes[frozen].pid, signal.SIGCONT)  # it wakes up after the gang has gone
        try:
            _, err = nodes[frozen].communicate(timeout=SLACK_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {frozen} did not end after it was resumed") from None
        assert nodes[frozen].returncode == EXIT_FAILED, err[-3000:]
        assert f"rank {frozen} stalled for" in err, err[-3000:]
        assert_wrote_nothing(run, before)
    finally:
        end(nodes)


def test_with_the_heartbeat_off_the_collective_timeout_from_the_spec_bounds_the_wait(tmp_path):
    nodes: list[subprocess.Popen] = []
    scheduling = {"heartbeat_timeout_seconds": 0, "collective_timeout_seconds": COLLECTIVE_S}
    try:
        nodes, err = freeze(tmp_path, 1, scheduling, COLLECTIVE_S + SLACK_S)
        assert nodes[0].returncode == EXIT_FAILED, err[-3000:]
        assert f"Timed out waiting {COLLECTIVE_S * 1000}ms" in err and "gang:" not in err, err[-3000:]
    finally:
        end(nodes)
