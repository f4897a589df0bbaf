"""Live progress against the fake API server: rank 0's last progress line read from a bounded log tail (strictly:
garbage ignored), shown by status, list and status -w; list's phase from the pods as status's."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from jobspec.cluster.client import ClusterClient
from jobspec.cluster.progress import TAIL_BYTES, TAIL_LINES, Progress, parse_progress
from jobspec.cluster.retry import RetryPolicy
from jobspec.cluster.status import collect_status
from jobspec.cluster.submit import submit
from jobspec.cluster.watch import watch
from jobspec.contract import EXIT_FAILED, EXIT_OK, PROGRESS_PREFIX

from .conftest import CliRun
from .fake_api import FakeApi
from .objects import make_objects

EVENT = {"event": "oom_shrink", "step": 7, "detail": "OOM: micro-batch 8 -> 4"}


def line(**changes: Any) -> str:
    data = {"step": 10, "total_steps": 100, "loss": 2.5, "tokens_per_s": 1500.0, "eta_s": 540.0, "tier": "fast",
            "micro_batch": 4, "event": EVENT, **changes}  # fmt: skip
    return f"09:00:00 INFO [rank 0] {PROGRESS_PREFIX}{json.dumps(data)}"


def test_the_last_line_is_parsed() -> None:
    text = "\n".join([line(step=9), "step 10/100 | loss 2.5", line(), "some other line"])
    assert parse_progress(text.encode()) == Progress(10, 100, 2.5, 1500.0, 540.0, "fast", 4, "oom_shrink", 7,
                                                     "OOM: micro-batch 8 -> 4")  # fmt: skip
    assert parse_progress(line(event=None, loss=None, eta_s=None)).event is None


@pytest.mark.parametrize(
    "bad",
    [
        line(extra=1),  # a key it does not know
        PROGRESS_PREFIX + json.dumps({"step": 1}),  # keys missing
        line(loss=float("nan")).replace("NaN", "NaN"),
        line(eta_s=-5),
        line(step=101),  # past the total
        line(step=True),
        line(micro_batch=0),
        line(tier="fast; rm -rf /"),
        line(event={"event": "anything", "detail": "x"}),
        line(event={"event": "oom_shrink", "detail": 3}),
        PROGRESS_PREFIX + "{not json",
        PROGRESS_PREFIX + "[" * 5000 + "]" * 5000,
        line(tier="f" * 3000),  # longer than any real line
    ],
)
def test_garbage_is_ignored_even_after_a_good_line(bad: str) -> None:
    assert parse_progress(line() + "\n" + bad) is None  # only the last progress line counts, and it is bad


def test_a_secret_in_an_event_is_redacted() -> None:
    p = parse_progress(line(event={**EVENT, "detail": "token ghp_abcdefghijklmnopqrstuvwxyz0123456789AB"}))
    assert p is not None and "ghp_abcdefghij" not in (p.event_detail or "")


def running_job(api: FakeApi, client: ClusterClient, log: bytes | None = None, name: str = "train") -> list[str]:
    submit(client, make_objects(name=name), "ml")
    api.get("jobs", "ml", name)["status"] = {"active": 2}
    pods = [api.add_pod("ml", name, i)["metadata"]["name"] for i in range(2)]
    if log is not None:
        api.logs[("ml", pods[0])] = log
    return pods


def test_status_reads_a_bounded_tail_of_rank_0(api: FakeApi, client: ClusterClient, kubeconfig: Path, cli: CliRun
                                                ) -> None:  # fmt: skip
    noise = "".join(f"noise {i}\n" for i in range(500))
    pods = running_job(api, client, (line(step=3) + "\n" + noise + line() + "\n" + noise[:800]).encode())
    code, out, err = cli("status", "train", "--kubeconfig", str(kubeconfig))
    assert code == EXIT_OK, err
    assert ("progress   step 10/100 (10%), loss 2.5, 1,500 tok/s, ETA 9m 00s, tier fast, micro-batch 4; "
            "last: OOM: micro-batch 8 -> 4 at step 7") in out  # fmt: skip
    (read,) = api.calls("GET", f"/pods/{pods[0]}/log")
    assert read.query["tailLines"] == str(TAIL_LINES) and read.query["limitBytes"] == str(TAIL_BYTES)
    assert read.query["container"] == "runner" and not api.calls("GET", f"/pods/{pods[1]}/log")  # rank 0 only
    api.logs[("ml", pods[0])] = (line() + "\n" + noise).encode()  # its last progress line is out of the tail
    assert "progress   none yet" in cli("status", "train", "--kubeconfig", str(kubeconfig))[1]


def test_a_refused_log_read_leaves_status_working(api: FakeApi, client: ClusterClient, kubeconfig: Path,
                                                  cli: CliRun) -> None:  # fmt: skip
    running_job(api, client, line().encode())
    api.fail("GET", r"/log$", 403, times=10)
    code, out, _ = cli("status", "train", "--kubeconfig", str(kubeconfig))
    assert code == EXIT_OK and "phase      Running" in out and "progress   none yet" in out


def test_list_shows_the_phase_from_pods_and_progress(api: FakeApi, client: ClusterClient, kubeconfig: Path,
                                                     cli: CliRun) -> None:  # fmt: skip
    running_job(api, client, line().encode(), name="a")
    submit(client, make_objects(name="b"), "ml")
    api.get("jobs", "ml", "b")["status"] = {"active": 2}  # the Job controller counts Pending pods as active
    rank0 = api.add_pod("ml", "b", 0)["metadata"]["name"]
    api.logs[("ml", rank0)] = line(step=5).encode()  # rank 0 trains while its peer waits for a node
    stuck = api.add_pod("ml", "b", 1, phase="Pending")
    said = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    stuck["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                      "message": said}]  # fmt: skip
    code, out, _ = cli("list", "--kubeconfig", str(kubeconfig))
    assert code == EXIT_OK
    rows = {r.split()[0]: r.split() for r in out.splitlines()[1:]}
    assert rows["a"][:11] == ["a", "Running", "-", "0/2", "10/100", "2.5", "1,500", "9m", "00s", "fast", "4"]
    assert rows["a"][11] == "oom_shrink@7"
    assert rows["b"][:4] == ["b", "Pending", "Unschedulable", "0/2"]  # not Running: one member cannot schedule
    assert rows["b"][4] == "5/100"  # and its progress, as `status` shows it (issue 43: list showed none)
    data = {j["name"]: j for j in json.loads(cli("list", "-o", "json", "--kubeconfig", str(kubeconfig))[1])}
    assert data["a"]["progress"]["step"] == 10 and data["b"]["progress"]["step"] == 5
    assert collect_status(client, "ml", "b").progress == Progress(**data["b"]["progress"])
    assert len(api.calls("GET", "/log")) == 5  # one bounded read per live job per list (and status's one)


def test_watch_prints_each_change_until_the_job_ends(api: FakeApi, client: ClusterClient) -> None:
    pods = running_job(api, client, line(step=10).encode())
    script = [
        lambda: None,  # nothing new: no line
        lambda: api.logs.update({("ml", pods[0]): (line(step=10) + "\n" + line(step=20)).encode()}),
        lambda: api.get("jobs", "ml", "train").update(
            status={"succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]}
        ),
    ]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        script[len(waits) - 1]()

    client.policy = RetryPolicy(attempts=4, sleep=sleep)
    out = io.StringIO()
    st = watch(client, "ml", "train", out, interval=5, limit=3600, first=lambda s: f"FIRST {s.phase}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "FIRST Running" and waits == [5, 5, 5]
    assert "Running  step 20/100" in lines[1] and "Succeeded" in lines[2] and len(lines) == 3
    assert st is not None and st.phase == "Succeeded"


def test_watch_is_bounded_and_survives_a_cancel(api: FakeApi, client: ClusterClient) -> None:
    running_job(api, client, line().encode())
    notes: list[str] = []
    out = io.StringIO()
    st = watch(client, "ml", "train", out, interval=10, limit=35, note=notes.append)
    assert st is not None and st.phase == "Running"
    assert notes == ["stopped watching after 35 s; the job is still Running"]
    client.policy = RetryPolicy(attempts=4, sleep=lambda _: api.objects.pop(("jobs", "ml", "train")))
    assert watch(client, "ml", "train", out, interval=10, limit=60, note=notes.append) is None
    assert "no longer exists (cancelled?)" in notes[-1]


def test_status_w_cli_json_lines_and_exit_code(api: FakeApi, client: ClusterClient, kubeconfig: Path,
                                               cli: CliRun) -> None:  # fmt: skip
    running_job(api, client, line().encode())
    api.get("jobs", "ml", "train")["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    code, out, _ = cli("status", "train", "-w", "-o", "json", "--kubeconfig", str(kubeconfig))
    assert code == EXIT_FAILED and json.loads(out.splitlines()[0])["phase"] == "Failed"


class Interrupting(RetryPolicy):
    def __init__(self) -> None:
        super().__init__(attempts=1, sleep=self.stop)

    def stop(self, _: float) -> None:
        raise KeyboardInterrupt


class TestCtrlC:
    @pytest.fixture
    def policy(self) -> RetryPolicy:  # the cli fixture's: Ctrl-C at the first wait
        return Interrupting()

    def test_ctrl_c_ends_a_watch_cleanly(self, api: FakeApi, client: ClusterClient, kubeconfig: Path, cli: CliRun
                                         ) -> None:  # fmt: skip
        running_job(api, client, line().encode())
        code, out, err = cli("status", "train", "-w", "--kubeconfig", str(kubeconfig))
        assert code == 130 and "phase      Running" in out and "Traceback" not in err
