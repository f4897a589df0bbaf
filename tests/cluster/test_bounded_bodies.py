"""A broken API server: huge error and success bodies, answers dripped a byte at a time, headers without end.
The client reads a bounded prefix of any body, gives up within its timeout and retry budget, and says so in a
short message without the bearer token."""

from __future__ import annotations

import io
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jobspec.cluster import client as client_module
from jobspec.cluster import errors
from jobspec.cluster.client import MAX_BODY, ClusterClient
from jobspec.cluster.kubeconfig import load_connection
from jobspec.cluster.logs import follow_log, print_log
from jobspec.cluster.resources import JOB
from jobspec.cluster.retry import RetryPolicy
from jobspec.cluster.submit import submit
from jobspec.contract import EXIT_CLUSTER
from jobspec.errors import ClusterError

from .fake_api import TOKEN, FakeApi
from .objects import make_objects

JOB_PATH = r"/jobs/train$"
MiB = 1024**2
HUGE = 100 * MiB
ECHO = f"Authorization: Bearer {TOKEN} ".encode()  # a proxy echoing the request's header, again and again


@pytest.fixture
def running(api: FakeApi, client: ClusterClient) -> FakeApi:
    submit(client, make_objects(), "ml")
    api.requests.clear()
    return api


def real_client(kubeconfig: Path, *, timeout: float, budget: float, attempts: int = 5) -> ClusterClient:
    """A client that really waits (short backoffs), to time a give-up against the wall clock."""
    policy = RetryPolicy(attempts=attempts, initial=0.05, max_wait=0.1, jitter=0.0, budget=budget)
    return ClusterClient(load_connection(str(kubeconfig)), timeout=timeout, policy=policy)


def peak_bytes(fn: Callable[[], Any]) -> tuple[Any, BaseException | None, int]:
    """(what fn returned, what it raised, the peak of Python allocations while it ran)."""
    tracemalloc.start()
    result = raised = None
    try:
        result = fn()
    except Exception as err:  # the caller checks which
        raised = err
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, raised, peak


def test_a_100_mb_error_body_is_read_to_a_prefix_and_the_message_stays_short(running: FakeApi, client, sleeps):
    fault = running.fail("GET", JOB_PATH, 500, times=10, body=ECHO, size=HUGE)
    _, raised, peak = peak_bytes(lambda: client.get(JOB, "ml", "train"))
    assert isinstance(raised, errors.ServerError)
    msg = str(raised)
    assert TOKEN not in msg and len(msg) < 500 and "gave up after 4 attempts" in msg
    assert peak < 8 * MiB  # the whole body was 100 MB per attempt; a prefix is 64 KiB
    assert fault.sent < HUGE  # over the 4 attempts: each time the client hung up after a prefix
    assert len(sleeps) == 3  # retried as any 500, each attempt as quick as a small answer


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 422, 501])
def test_a_huge_body_with_any_error_status_is_cut(running: FakeApi, client, status: int):
    running.fail("GET", JOB_PATH, status, body=b'{"kind":"Status","message":"' + b"x" * 200 + ECHO, size=HUGE)
    with pytest.raises(errors.ApiError) as info:
        client.get(JOB, "ml", "train")
    assert TOKEN not in str(info.value) and len(str(info.value)) < 600


def test_a_status_message_is_cut_and_scrubbed(running: FakeApi, client):
    running.fail("GET", JOB_PATH, 409, message=f"conflict with {TOKEN}; " + "field is immutable; " * 2000)
    with pytest.raises(errors.Conflict) as info:
        client.get(JOB, "ml", "train")
    assert TOKEN not in str(info.value) and len(str(info.value)) < 500 and "field is immutable" in str(info.value)


def test_the_token_itself_is_never_quoted_whatever_its_shape(api: FakeApi, tmp_path: Path):
    """A token that looks like no token (a password) quoted bare by the server: the client knows what it sent."""
    secret = "correcthorsebatterystaple"
    api.fail("GET", JOB_PATH, 422, body={"kind": "Status", "message": f"bad value {secret} in the request"})
    c = ClusterClient(load_connection(str(api.kubeconfig(tmp_path, token=secret))))
    with c, pytest.raises(errors.Rejected) as info:
        c.get(JOB, "ml", "train")
    assert secret not in str(info.value) and "bad value" in str(info.value)


def test_a_100_mb_success_body_is_refused_without_being_read(running: FakeApi, client, sleeps):
    fault = running.fail("GET", JOB_PATH, 200, body=b'{"kind":"Job","x":"' + b"y" * 1000, size=HUGE)
    _, raised, peak = peak_bytes(lambda: client.get(JOB, "ml", "train"))
    assert isinstance(raised, ClusterError) and f"larger than {MAX_BODY // MiB} MiB" in str(raised)
    assert peak < 8 * MiB and fault.sent < HUGE and sleeps == []  # not retried: the next answer is as large


def test_a_success_body_without_length_is_read_to_the_bound_only(running: FakeApi, client):
    fault = running.fail("GET", JOB_PATH, 200, body=b"[" + b"1," * 1000, size=HUGE, chunked=True)
    with pytest.raises(ClusterError, match="larger than"):
        client.get(JOB, "ml", "train")
    assert fault.sent < HUGE


def test_a_body_nested_deeper_than_the_parser_goes_is_not_json(running: FakeApi, client):
    running.fail("GET", JOB_PATH, 200, body=b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ClusterError, match="not JSON"):
        client.get(JOB, "ml", "train")


def test_a_dripped_body_gives_up_within_the_budget(running: FakeApi, kubeconfig: Path):
    running.fail("GET", JOB_PATH, 500, times=100, body=b"x", size=10**9, drip=0.02)
    with real_client(kubeconfig, timeout=0.4, budget=1.5) as c:
        start = time.monotonic()
        with pytest.raises(errors.ApiTimeout) as info:
            c.get(JOB, "ml", "train")
    assert time.monotonic() - start < 2.5  # before: every byte came within the socket timeout, without end
    assert "the retry budget" in str(info.value) and "--request-timeout" in str(info.value)


def test_headers_without_end_give_up_within_the_budget(running: FakeApi, kubeconfig: Path):
    running.fail("GET", JOB_PATH, 200, times=100, drip_headers=0.02)
    with real_client(kubeconfig, timeout=0.4, budget=1.5) as c:
        start = time.monotonic()
        with pytest.raises((errors.ApiTimeout, errors.Unreachable)):
            c.get(JOB, "ml", "train")
    assert time.monotonic() - start < 2.5


def test_a_silent_server_costs_one_budget_not_every_attempts_timeout(running: FakeApi, kubeconfig: Path):
    running.fail("GET", JOB_PATH, delay=30, times=100)
    with real_client(kubeconfig, timeout=0.5, budget=1.2, attempts=10) as c:
        start = time.monotonic()
        with pytest.raises(errors.ApiTimeout) as info:
            c.get(JOB, "ml", "train")
    assert time.monotonic() - start < 2.0  # 10 attempts x 0.5 s would be 5 s
    assert "gave up after" in str(info.value)


def test_the_budget_counts_the_waits(running: FakeApi, kubeconfig: Path):
    """With a clock that the (fake) sleep advances: 503 forever, 20 attempts allowed, a 10 s budget."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    running.fail("GET", JOB_PATH, 503, times=100)
    policy = RetryPolicy(attempts=20, jitter=0.0, budget=10.0, sleep=sleep, clock=lambda: now[0])
    c = ClusterClient(load_connection(str(kubeconfig)), timeout=2.0, policy=policy)
    with c, pytest.raises(errors.ServerError) as info:
        c.get(JOB, "ml", "train")
    assert now[0] <= 10.0  # waits 0.5, 1, 2, 4: the next (8) would end past the budget
    assert len(running.calls("GET", "/jobs/train")) == 5
    assert "gave up after 5 attempts in 8 s, the retry budget" in str(info.value)


@pytest.mark.parametrize("command", [("status", "train"), ("list",), ("cancel", "train"), ("logs", "train")])
def test_commands_against_a_huge_error_body_exit_3_with_a_short_message(running: FakeApi, kubeconfig, cli, command):
    fault = running.fail("GET", r"/(jobs|pods)(/train)?$", 503, times=100, body=ECHO, size=HUGE)
    (code, out, err), raised, peak = peak_bytes(lambda: cli(*command, "--kubeconfig", str(kubeconfig)))
    assert raised is None and code == EXIT_CLUSTER and out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the API server could not serve") and len(last) < 500 and TOKEN not in err
    assert peak < 16 * MiB and fault.sent < HUGE  # four attempts, a prefix of each


def test_a_list_that_pages_without_end_is_stopped(running: FakeApi, client):
    page = {"kind": "JobList", "items": [], "metadata": {"continue": "same-token"}}
    running.fail("GET", r"/namespaces/ml/jobs$", 200, times=100, body=page)
    with pytest.raises(ClusterError, match="keeps paging"):
        client.list(JOB, "ml", None)
    assert len(running.calls("GET", "/namespaces/ml/jobs")) == 2


def test_a_log_past_its_bound_is_cut_with_a_note(running: FakeApi, client, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(client_module, "MAX_LOG_BYTES", MiB)
    running.add_pod("ml", "train", 0, name="train-0-a")
    running.fail("GET", r"/pods/train-0-a/log$", 200, body=b"line of the log\n", size=HUGE)
    out, notes = io.StringIO(), []
    print_log(client, "ml", "train", 0, out, note=notes.append)
    assert len(out.getvalue()) == MiB and notes and "longer than 1 MiB" in notes[0] and "-f" in notes[0]


class Sink(io.StringIO):
    """An output that counts what it is given and keeps none of it (so memory measures the reader alone)."""

    chars = 0

    def write(self, text: str) -> int:
        self.chars += len(text)
        return len(text)


def test_a_followed_line_without_end_is_printed_not_gathered(running: FakeApi, client):
    running.add_pod("ml", "train", 0, name="train-0-a")

    def finish() -> None:
        running.set_pod("ml", "train-0-a", "Succeeded", {"terminated": {"exitCode": 0}})

    running.streams[("ml", "train-0-a")] = [[b"x" * MiB] * 20 + [finish]]
    out = Sink()
    _, raised, peak = peak_bytes(lambda: follow_log(client, "ml", "train", 0, out, poll=0.01))
    assert raised is None and out.chars == 20 * MiB + 1  # and the line's end
    assert peak < 8 * MiB  # the 20 MB line is printed as it comes, not gathered
