"""logs: print, --previous, and -f that ends when the pod ends (and survives dropped streams)."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from jobspec.cluster import errors
from jobspec.cluster.client import ClusterClient
from jobspec.cluster.kubeconfig import load_connection
from jobspec.cluster.logs import follow_log, print_log
from jobspec.cluster.retry import RetryPolicy
from jobspec.cluster.submit import submit

from .fake_api import FakeApi
from .objects import make_objects

DONE = {"terminated": {"exitCode": 0, "reason": "Completed"}}


@pytest.fixture
def pod_name(api: FakeApi, client: ClusterClient) -> str:
    submit(client, make_objects(), "ml")
    return api.add_pod("ml", "train", 0)["metadata"]["name"]


def bounded(fn: Callable[[], None], seconds: float = 10.0) -> None:
    """Run fn in a thread; fail (instead of hanging the suite) if it does not return in time."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as err:  # re-raised below, in the test's thread
            failure.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not return within {seconds} s"
    if failure:
        raise failure[0]


def test_print_log_of_index(api: FakeApi, client: ClusterClient, pod_name: str) -> None:
    api.logs[("ml", pod_name)] = b"loading model\nstep 1 loss 2.0\n"
    out = io.StringIO()
    print_log(client, "ml", "train", 0, out)
    assert out.getvalue() == "loading model\nstep 1 loss 2.0\n"
    req = api.calls("GET", "/log")[0]
    assert req.query == {"container": "runner"}


def test_follow_ends_when_the_pod_ends(api: FakeApi, client: ClusterClient, pod_name: str) -> None:
    def finish() -> None:
        api.set_pod("ml", pod_name, "Succeeded", DONE)

    api.streams[("ml", pod_name)] = [
        [
            b"2025-01-01T00:00:01.5Z step 1\n",
            0.05,
            b"2025-01-01T00:00:02Z ste",
            0.05,
            b"p 2\n",
            finish,
        ]
    ]
    out = io.StringIO()
    bounded(lambda: follow_log(client, "ml", "train", 0, out))
    assert out.getvalue() == "step 1\nstep 2\n"
    (req,) = api.calls("GET", "/log")
    assert req.query == {"container": "runner", "follow": "true", "timestamps": "true"}


def test_follow_reopens_a_dropped_stream_without_repeating_lines(
    api: FakeApi, client: ClusterClient, pod_name: str
) -> None:
    def finish() -> None:
        api.set_pod("ml", pod_name, "Failed", {"terminated": {"exitCode": 75}})

    api.streams[("ml", pod_name)] = [
        [b"2025-01-01T00:00:01.1Z a\n", b"2025-01-01T00:00:02.2Z b\n", b"2025-01-01T00:00:02.2Z b2\n"],
        # the server resends from the whole second: b and b2 again, then new lines
        [b"2025-01-01T00:00:02.2Z b\n2025-01-01T00:00:02.2Z b2\n2025-01-01T00:00:02.7Z c\n", finish],
    ]
    out = io.StringIO()
    bounded(lambda: follow_log(client, "ml", "train", 0, out))
    assert out.getvalue() == "a\nb\nb2\nc\n"
    first, second = api.calls("GET", "/log")
    assert "sinceTime" not in first.query and second.query["sinceTime"] == "2025-01-01T00:00:02Z"


def test_follow_reopens_a_quiet_stream(api: FakeApi, kubeconfig: Path, pod_name: str) -> None:
    def finish() -> None:
        api.set_pod("ml", pod_name, "Succeeded", DONE)

    api.streams[("ml", pod_name)] = [
        [b"2025-01-01T00:00:01Z a\n", 1.0],  # then silence, longer than follow_idle
        [b"2025-01-01T00:00:01Z a\n2025-01-01T00:00:09Z b\n", finish],
    ]
    out = io.StringIO()
    with ClusterClient(
        load_connection(str(kubeconfig)), follow_idle=0.3, policy=RetryPolicy(sleep=lambda s: None)
    ) as c:
        bounded(lambda: follow_log(c, "ml", "train", 0, out))
    assert out.getvalue() == "a\nb\n"


def test_follow_waits_for_the_pod_to_start(api: FakeApi, kubeconfig: Path) -> None:
    with ClusterClient(load_connection(str(kubeconfig)), policy=RetryPolicy(sleep=lambda s: None)) as setup:
        submit(setup, make_objects(), "ml")
    name = api.add_pod("ml", "train", 0, phase="Pending")["metadata"]["name"]
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the pod starts after the second poll
        waits.append(seconds)
        if len(waits) == 2:
            api.set_pod("ml", name, "Running", {"running": {}})

    api.streams[("ml", name)] = [[b"2025-01-01T00:00:01Z hi\n", lambda: api.set_pod("ml", name, "Succeeded", DONE)]]
    notes: list[str] = []
    out = io.StringIO()
    with ClusterClient(load_connection(str(kubeconfig)), policy=RetryPolicy(sleep=sleep)) as c:
        bounded(lambda: follow_log(c, "ml", "train", 0, out, note=notes.append))
    assert out.getvalue() == "hi\n" and waits == [2.0, 2.0]
    assert notes == [f"waiting for index 0 of job train to start: pod {name} is ContainerCreating"]


def test_follow_gives_up_waiting_after_the_bound(api: FakeApi, client: ClusterClient, sleeps: list[float]) -> None:
    submit(client, make_objects(), "ml")
    with pytest.raises(errors.NotReady, match="did not start within 10 s"):
        follow_log(client, "ml", "train", 1, io.StringIO(), start_wait=10, poll=2)
    assert sleeps == [2.0] * 5


def test_follow_points_at_the_next_attempt(api: FakeApi, client: ClusterClient, pod_name: str) -> None:
    api.get("jobs", "ml", "train")["status"] = {"active": 1}

    def retry_at_next_tier() -> None:
        api.set_pod("ml", pod_name, "Failed", {"terminated": {"exitCode": 75}})
        api.add_pod("ml", "train", 0, name="train-0-retry", created="2025-01-01T00:09:00Z")

    api.streams[("ml", pod_name)] = [[b"2025-01-01T00:00:01Z oom\n", retry_at_next_tier]]
    notes: list[str] = []
    bounded(lambda: follow_log(client, "ml", "train", 0, io.StringIO(), note=notes.append))
    assert notes and "continues in pod train-0-retry" in notes[0]


def test_previous_reads_the_restarted_container(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    name = api.add_pod("ml", "train", 0, restarts=1)["metadata"]["name"]
    api.previous_logs[("ml", name)] = b"crashed\n"
    out = io.StringIO()
    print_log(client, "ml", "train", 0, out, previous=True)
    assert out.getvalue() == "crashed\n" and api.calls("GET", "/log")[0].query["previous"] == "true"


def test_previous_reads_the_previous_attempt(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    old = api.add_pod(
        "ml",
        "train",
        0,
        phase="Failed",
        name="train-0-old",
        created="2025-01-01T00:01:00Z",
        state={"terminated": {"exitCode": 75}},
    )
    api.add_pod("ml", "train", 0, name="train-0-new", created="2025-01-01T00:02:00Z")
    api.logs[("ml", old["metadata"]["name"])] = b"OOM at fast\n"
    out, notes = io.StringIO(), []
    print_log(client, "ml", "train", 0, out, previous=True, note=notes.append)
    assert out.getvalue() == "OOM at fast\n" and notes == ["showing the previous attempt of index 0: pod train-0-old"]


def test_previous_without_history(client: ClusterClient, pod_name: str) -> None:
    with pytest.raises(errors.NotReady, match="no previous log"):
        print_log(client, "ml", "train", 0, io.StringIO(), previous=True)


def test_logs_of_a_pod_that_has_not_started(api: FakeApi, client: ClusterClient) -> None:
    submit(client, make_objects(), "ml")
    api.add_pod("ml", "train", 0, phase="Pending")
    with pytest.raises(errors.NotReady, match=r"has not started yet \(ContainerCreating\).*-f"):
        print_log(client, "ml", "train", 0, io.StringIO())
    with pytest.raises(errors.NotReady, match="no pod for index 1 yet"):
        print_log(client, "ml", "train", 1, io.StringIO())


def test_logs_of_a_missing_job(client: ClusterClient) -> None:
    with pytest.raises(errors.NotFound, match='job "ghost" does not exist in namespace "ml"'):
        print_log(client, "ml", "ghost", 0, io.StringIO())
