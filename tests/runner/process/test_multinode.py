"""Several nodes, on the runner's side: two supervisors on loopback, each one node of a 2-node job (gloo).

What a rendered Indexed Job gives each pod (JOBSPEC_NNODES, JOBSPEC_NODE_RANK, JOBSPEC_MASTER_ADDR/PORT) is
set by hand here, so the whole path below the pod runs: rendezvous across "nodes", an OOM on one node agreed
by both and absorbed in process, a tier step-down in process on both nodes, and a node killed mid-run: the
other fails on the collective timeout (the Job then recreates both pods), and the restarted pair resumes
from the newest checkpoint at the recorded tier with the same samples per step.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobspec.contract import ENV_MASTER_ADDR, ENV_MASTER_PORT, ENV_NNODES, ENV_NODE_RANK, EXIT_OK
from runner.checkpoint import store
from runner.data.dataset import DataOrder, load_data
from runner.data.tokenizer import ByteTokenizer
from runner.oom.faults import ENV_VAR
from runner.oom.ladder import load_state
from tests.runner.train_helpers import (
    ROOT,
    Drained,
    records,
    runner_env,
    timeout_s,
    tiny_spec,
    tiny_spec_dict,
    write_spec,
)

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 8  # 2 nodes x 1 process: 4 samples a rank a step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_nodes(spec: Path, port: int, **env: str) -> list[subprocess.Popen]:
    nodes = []
    for node in (0, 1):
        node_env = {ENV_NNODES: "2", ENV_NODE_RANK: str(node), ENV_MASTER_ADDR: "127.0.0.1",
                    ENV_MASTER_PORT: str(port), "JOBSPEC_RECORD_SAMPLES": "1", "JOBSPEC_DIST_TIMEOUT_S": "30",
                    **env}  # fmt: skip
        nodes.append(Drained([sys.executable, "-m", "runner", str(spec), "--nproc", "1"], cwd=ROOT,
                                      env=runner_env(**node_env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))  # fmt: skip
    return nodes


def finish(nodes: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    try:
        for node, proc in enumerate(nodes):
            try:
                _, err = proc.communicate(timeout=timeout_s())
            except subprocess.TimeoutExpired:
                raise AssertionError(f"node {node} did not finish in {timeout_s():.0f} s") from None
            out.append((proc.returncode, err))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
    return out


def two_nodes(tmp_path: Path, name: str, sections: dict, **env: str) -> tuple[Path, list[tuple[int, str]]]:
    run = tmp_path / name
    spec = tiny_spec_dict(run, hardware={"vendor": "cpu", "gpus": 1, "nodes": 2}, **sections)
    return run, finish(start_nodes(write_spec(tmp_path / f"{name}.yaml", spec), free_port(), **env))


def samples(run: Path) -> dict[int, dict[int, list[int]]]:
    """{rank: {step: ids}} (the last record of a step wins: a redone step is recorded again)."""
    out: dict[int, dict[int, list[int]]] = {}
    for rank in (0, 1):
        for line in (run / f"samples-rank{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rank, {})[rec["step"]] = rec["ids"]
    return out


def planned(run: Path, steps: int) -> dict[int, dict[int, list[int]]]:
    order = DataOrder(len(load_data(tiny_spec(run), ByteTokenizer()).train), GLOBAL_BATCH, 42)
    half = GLOBAL_BATCH // 2
    return {r: {k: order.step_samples(k - 1)[r * half : (r + 1) * half] for k in range(1, steps + 1)} for r in (0, 1)}


def test_an_oom_on_one_node_is_agreed_and_absorbed_in_process_on_both(tmp_path):
    sections = {"training": {"micro_batch": 4, "steps": 4}, "checkpoints": {"every_steps": 2}}
    run, ends = two_nodes(tmp_path, "shrink", sections, **{ENV_VAR: "mbs>2,rank=1"})
    assert [code for code, _ in ends] == [EXIT_OK, EXIT_OK], ends[0][1][-3000:] + ends[1][1][-3000:]
    shrinks = [r for r in records(run, "event") if r.get("event") == "oom_shrink"]
    assert [(e["step"], e["from_micro_batch"], e["to_micro_batch"], e["oom_rank"]) for e in shrinks] == [(1, 4, 2, 1)]
    assert all(r["micro_batch"] == 2 and r["world_size"] == 2 for r in records(run))
    assert samples(run) == planned(run, 4)  # both nodes: every step's samples, none lost, none twice


def test_a_tier_fault_steps_both_nodes_down_in_process(tmp_path):
    sections = {"training": {"micro_batch": 4, "steps": 4}, "checkpoints": {"every_steps": 2}}
    run, ends = two_nodes(tmp_path, "tier", sections, **{ENV_VAR: "tier=fast"})
    assert [code for code, _ in ends] == [EXIT_OK, EXIT_OK], ends[0][1][-3000:] + ends[1][1][-3000:]
    assert "relaunching" not in ends[0][1] + ends[1][1]
    change = [r for r in records(run, "event") if r.get("event") == "tier_change"]
    assert [(e["from_tier"], e["to_tier"]) for e in change] == [("fast", "zero2")]  # 2 ranks: zero2 shards
    assert load_state(run).failed_tiers() == ["fast"]
    assert samples(run) == planned(run, 4)


def test_a_killed_node_fails_its_peer_and_the_pair_resumes_with_the_same_samples(tmp_path):
    run = tmp_path / "killed"
    spec = write_spec(tmp_path / "killed.yaml", tiny_spec_dict(
        run, hardware={"vendor": "cpu", "gpus": 1, "nodes": 2},
        training={"micro_batch": 4, "steps": 400}, checkpoints={"every_steps": 3}))  # fmt: skip
    nodes = start_nodes(spec, free_port())
    deadline = time.monotonic() + timeout_s()
    while store.latest(run) is None or store.read_meta(store.latest(run))["step"] < 3:
        assert all(p.poll() is None for p in nodes), "a node ended before the first checkpoint"
        assert time.monotonic() < deadline, "waited for checkpoint step-3"
        time.sleep(0.2)
    os.killpg(nodes[1].pid, signal.SIGKILL)  # node 1's pod is gone (supervisor and worker)
    ends = finish(nodes)
    assert ends[0][0] != EXIT_OK  # node 0 cannot go on without its peer: it fails, the Job recreates both
    resumed_from = store.read_meta(store.latest(run))["step"]
    # The recreated pods: the same spec, fewer steps so that the test ends soon after the resume.
    short = tiny_spec_dict(run, hardware={"vendor": "cpu", "gpus": 1, "nodes": 2},
                           training={"micro_batch": 4, "steps": resumed_from + 2}, checkpoints={"every_steps": 3},
                           )  # fmt: skip
    ends = finish(start_nodes(write_spec(tmp_path / "again.yaml", short), free_port()))
    assert [code for code, _ in ends] == [EXIT_OK, EXIT_OK], ends[0][1][-3000:] + ends[1][1][-3000:]
    plans = records(run, "plan")
    assert plans[-1]["step"] == resumed_from and plans[-1]["tier"] == plans[0]["tier"]
    got = samples(run)
    want = planned(run, resumed_from + 2)
    for rank in (0, 1):
        for step in range(resumed_from + 1, resumed_from + 3):
            assert got[rank][step] == want[rank][step], (rank, step)
