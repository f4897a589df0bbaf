"""Retries, timeouts and error mapping, against a real HTTP server."""

from __future__ import annotations

import socket
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path

import pytest

from jobspec.cluster import errors
from jobspec.cluster.client import ClusterClient
from jobspec.cluster.kubeconfig import load_connection
from jobspec.cluster.resources import JOB
from jobspec.cluster.retry import HttpStatus, RetryPolicy, retry_after
from jobspec.cluster.status import collect_status
from jobspec.cluster.submit import submit
from jobspec.contract import EXIT_CLUSTER

from .fake_api import TOKEN, FakeApi
from .objects import make_objects

JOB_PATH = r"/jobs/train$"


@pytest.fixture
def running(api: FakeApi, client: ClusterClient) -> FakeApi:
    submit(client, make_objects(), "ml")
    api.requests.clear()
    return api


def test_500_then_success_is_retried_once(running: FakeApi, client: ClusterClient, sleeps: list[float]) -> None:
    running.fail("GET", JOB_PATH, 500)
    assert client.get(JOB, "ml", "train")["metadata"]["name"] == "train"
    assert len(running.calls("GET", "/jobs/train")) == 2
    assert len(sleeps) == 1 and 0.5 <= sleeps[0] <= 1.0  # first backoff: 0.5 s + up to 0.5 s jitter


def test_5xx_backoff_grows_and_gives_up_after_the_budget(
    running: FakeApi, client: ClusterClient, sleeps: list[float]
) -> None:
    running.fail("GET", JOB_PATH, 503, times=10)
    with pytest.raises(errors.ServerError) as info:
        client.get(JOB, "ml", "train")
    assert len(running.calls("GET", "/jobs/train")) == 4  # policy.attempts
    assert len(sleeps) == 3
    assert [0.5 <= sleeps[0] <= 1.0, 1.0 <= sleeps[1] <= 1.5, 2.0 <= sleeps[2] <= 2.5] == [True] * 3
    assert "gave up after 4 attempts" in str(info.value)
    assert info.value.exit_code == EXIT_CLUSTER


def test_429_waits_for_retry_after(running: FakeApi, client: ClusterClient, sleeps: list[float]) -> None:
    running.fail("GET", JOB_PATH, 429, headers={"Retry-After": "1"}, message="too many requests")
    client.get(JOB, "ml", "train")
    assert sleeps == [1.0]  # at least Retry-After; the 0.5-1.0 s backoff is shorter


def test_429_retry_after_really_waits(running: FakeApi, kubeconfig: Path) -> None:
    """The same with the real sleep: about one second, as the server asked."""
    with ClusterClient(load_connection(str(kubeconfig)), policy=RetryPolicy(jitter=0.0)) as real:
        running.fail("GET", JOB_PATH, 429, headers={"Retry-After": "1"})
        start = time.monotonic()
        real.get(JOB, "ml", "train")
    assert 1.0 <= time.monotonic() - start < 3.0


def test_retry_after_is_capped(running: FakeApi, client: ClusterClient, sleeps: list[float]) -> None:
    running.fail("GET", JOB_PATH, 429, headers={"Retry-After": "3600"})
    client.get(JOB, "ml", "train")
    assert sleeps == [client.policy.max_retry_after]


def test_retry_after_http_date_and_garbage() -> None:
    soon = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=5), usegmt=True)
    assert 3.0 <= retry_after(HttpStatus(429, "", b"", {"Retry-After": soon})) <= 5.0
    assert retry_after(HttpStatus(429, "", b"", {"retry-after": "soon"})) is None
    assert retry_after(HttpStatus(429, "", b"", {})) is None


def test_connection_reset_is_retried(running: FakeApi, client: ClusterClient, sleeps: list[float]) -> None:
    running.fail("GET", JOB_PATH, reset=True)
    assert client.get(JOB, "ml", "train")["kind"] == "Job"
    assert len(running.calls("GET", "/jobs/train")) == 2 and len(sleeps) == 1


def test_connection_refused_gives_up_with_a_clear_message(tmp_path: Path, sleeps: list[float]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = FakeApi()
    api._server = type("S", (), {"server_address": ("127.0.0.1", port)})()  # type: ignore[assignment]
    cfg = api.kubeconfig(tmp_path)
    policy = RetryPolicy(attempts=3, sleep=sleeps.append)
    with ClusterClient(load_connection(str(cfg)), policy=policy) as c, pytest.raises(errors.Unreachable) as info:
        c.get(JOB, "ml", "train")
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "connection refused" in msg and "gave up after 3 attempts" in msg
    assert "context fake" in msg and len(sleeps) == 2
    assert TOKEN not in msg


def test_read_timeout_is_bounded(running: FakeApi, kubeconfig: Path, sleeps: list[float]) -> None:
    running.fail("GET", JOB_PATH, delay=1.5, times=2)
    policy = RetryPolicy(attempts=2, sleep=sleeps.append)
    with ClusterClient(load_connection(str(kubeconfig)), timeout=0.3, policy=policy) as c:
        start = time.monotonic()
        with pytest.raises(errors.ApiTimeout) as info:
            c.get(JOB, "ml", "train")
    assert time.monotonic() - start < 1.5
    assert "within 0.3 s" in str(info.value) and "--request-timeout" in str(info.value)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, errors.Rejected),
        (401, errors.Unauthorized),
        (403, errors.Forbidden),
        (404, errors.NotFound),
        (409, errors.Conflict),
        (422, errors.Rejected),
        (501, errors.ServerError),
    ],
)
def test_other_4xx_and_501_are_not_retried(
    running: FakeApi, client: ClusterClient, sleeps: list[float], status: int, kind: type
) -> None:
    running.fail("GET", JOB_PATH, status)
    with pytest.raises(kind) as info:
        client.get(JOB, "ml", "train")
    assert len(running.calls("GET", "/jobs/train")) == 1 and sleeps == []
    assert info.value.exit_code == EXIT_CLUSTER


def test_403_names_verb_resource_and_namespace(api: FakeApi, client: ClusterClient) -> None:
    api.fail(
        "PATCH",
        JOB_PATH,
        403,
        message=(
            'jobs.batch "train" is forbidden: User "system:serviceaccount:ml:ci" cannot create resource "jobs" '
            'in API group "batch" in the namespace "ml"'
        ),
    )
    with pytest.raises(errors.Forbidden) as info:
        submit(client, make_objects(), "ml")
    msg = str(info.value)
    assert 'RBAC refused: cannot create jobs.batch "train" in namespace "ml"' in msg
    assert "kubectl auth can-i create jobs.batch -n ml" in msg


def test_403_on_a_list_names_the_list(api: FakeApi, client: ClusterClient) -> None:
    api.fail("GET", r"/namespaces/ml/pods$", 403, message="forbidden")
    submit(client, make_objects(), "ml")
    with pytest.raises(errors.Forbidden, match=r'cannot list pods in namespace "ml"'):
        collect_status(client, "ml", "train")


def test_401_says_to_log_in_again(api: FakeApi, tmp_path: Path) -> None:
    cfg = api.kubeconfig(tmp_path, token="wrong-token")
    conn = load_connection(str(cfg))
    with ClusterClient(conn) as c, pytest.raises(errors.Unauthorized, match="did not accept the credentials") as info:
        c.get(JOB, "ml", "train")
    assert "wrong-token" not in str(info.value)
    assert 'get jobs.batch "train" in namespace "ml"' in str(info.value)


def test_404_says_the_job_does_not_exist(client: ClusterClient) -> None:
    with pytest.raises(errors.NotFound, match=r'^job "nope" does not exist in namespace "ml"$'):
        collect_status(client, "ml", "nope")


def test_requests_carry_the_token_and_a_user_agent(running: FakeApi, client: ClusterClient) -> None:
    client.get(JOB, "ml", "train")
    req = running.requests[-1]
    assert req.headers["authorization"] == f"Bearer {TOKEN}"
    assert req.headers["user-agent"].startswith("jobspec/")


def test_list_follows_continue_tokens(api: FakeApi, client: ClusterClient) -> None:
    for i in range(3):
        submit(client, make_objects(name=f"j{i}"), "ml")
    api.requests.clear()
    items = client.list(JOB, "ml", None, page_size=2)
    assert [j["metadata"]["name"] for j in items] == ["j0", "j1", "j2"]
    assert [r.query.get("continue") for r in api.requests] == [None, "2"]
