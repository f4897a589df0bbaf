"""A broken API server's answers (issue 44, class 6): items that are not objects, fields of the wrong type where
`status`, `list`, `logs`, the diagnosis, live progress and the pre-submit checks read them. A bad item is skipped
and named (never its content), a bad field reads as absent, never a traceback; the exit code is the one a real
answer gives."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobspec.cluster.answers import conform, list_items
from jobspec.contract import EXIT_CLUSTER, EXIT_FAILED, EXIT_OK
from tests.cpu_clock import cpu_seconds

from .conftest import BARE_SPEC, CliRun
from .fake_api import FakeApi

SECRET = "hf_GarbageItemSecret0123456789abcdef"

# JSON values a server could put anywhere
HOSTILE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
# Where the commands read (plural, path): each replaced by a hostile value in the test below
READ_PLACES = [
    ("jobs", ()), ("jobs", ("metadata",)), ("jobs", ("metadata", "name")), ("jobs", ("metadata", "uid")),
    ("jobs", ("metadata", "labels")), ("jobs", ("metadata", "annotations")),
    ("jobs", ("metadata", "creationTimestamp")), ("jobs", ("metadata", "namespace")), ("jobs", ("spec",)),
    ("jobs", ("spec", "completions")), ("jobs", ("spec", "parallelism")), ("jobs", ("spec", "suspend")),
    ("jobs", ("spec", "template")), ("jobs", ("status",)), ("jobs", ("status", "conditions")),
    ("jobs", ("status", "active")), ("jobs", ("status", "failed")), ("jobs", ("status", "completedIndexes")),
    ("jobs", ("status", "failedIndexes")), ("jobs", ("status", "startTime")),
    ("pods", ()), ("pods", ("metadata",)), ("pods", ("metadata", "name")), ("pods", ("metadata", "labels")),
    ("pods", ("metadata", "annotations")), ("pods", ("metadata", "creationTimestamp")),
    ("pods", ("metadata", "deletionTimestamp")), ("pods", ("spec",)), ("pods", ("spec", "containers")),
    ("pods", ("spec", "containers", 0)), ("pods", ("spec", "containers", 0, "name")), ("pods", ("spec", "nodeName")),
    ("pods", ("status",)), ("pods", ("status", "phase")), ("pods", ("status", "conditions")),
    ("pods", ("status", "containerStatuses")), ("pods", ("status", "containerStatuses", 0)),
    ("pods", ("status", "containerStatuses", 0, "name")), ("pods", ("status", "containerStatuses", 0, "state")),
    ("pods", ("status", "containerStatuses", 0, "state", "running")),
    ("pods", ("status", "containerStatuses", 0, "lastState")),
    ("pods", ("status", "containerStatuses", 0, "restartCount")),
    ("events", ()), ("events", ("metadata",)), ("events", ("involvedObject",)), ("events", ("reason",)),
    ("events", ("message",)), ("events", ("lastTimestamp",)),
]  # fmt: skip


def plant(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    """`obj` with the value at `path` replaced (created when absent; the whole object when path is empty)."""
    if not path:
        return value
    here: Any = obj
    for key in path[:-1]:
        if isinstance(key, int):
            here = here[key] if isinstance(here, list) and len(here) > key else None
        else:
            here = here.setdefault(key, {}) if isinstance(here, dict) else None
        if not isinstance(here, (dict, list)):
            return obj
    last = path[-1]
    fits_list = isinstance(here, list) and isinstance(last, int) and len(here) > last
    if fits_list or (isinstance(here, dict) and not isinstance(last, int)):
        here[last] = value
    return obj


@pytest.fixture
def running(api: FakeApi, kubeconfig: Path, cli: CliRun) -> list[str]:
    """A submitted job with a running pod (with a progress line in its log) and an event; the kubeconfig flags."""
    kc = ["--kubeconfig", str(kubeconfig)]
    assert cli("submit", BARE_SPEC, *kc)[0] == EXIT_OK
    job = api.get("jobs", "ml", "quickstart")
    job["status"] = {"active": 1}
    pod = api.add_pod("ml", "quickstart", 0)["metadata"]["name"]
    api.logs[("ml", pod)] = b'{"step": 3, "total_steps": 10, "loss": 2.5}\n'
    api.put({"kind": "Event", "metadata": {"name": "e1", "namespace": "ml"}, "reason": "SuccessfulCreate",
             "involvedObject": {"kind": "Job", "name": "quickstart", "uid": job["metadata"]["uid"]}})  # fmt: skip
    return kc


def commands(kc: list[str]) -> list[list[str]]:
    status, listing = ["status", "quickstart", *kc], ["list", *kc]
    return [status, [*status, "-o", "json"], listing, [*listing, "-A"], ["logs", "quickstart", *kc],
            ["submit", BARE_SPEC, "--dry-run=server", *kc]]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(place=st.sampled_from(READ_PLACES), value=HOSTILE, which=st.integers(0, 5))
def test_a_hostile_value_anywhere_the_commands_read_is_no_traceback(
    api: FakeApi, running: list[str], cli: CliRun, place: tuple[str, tuple[Any, ...]], value: Any, which: int
) -> None:
    plural, path = place
    api.mangle = lambda p, obj: plant(obj, path, value) if p == plural else obj
    try:
        code, _, err = cli(*commands(running)[which])  # an AttributeError or TypeError would escape here
    finally:
        api.mangle = None
    assert code in (EXIT_OK, EXIT_FAILED, EXIT_CLUSTER), (code, err)
    assert "Traceback" not in err


@pytest.mark.parametrize("command", range(6))
def test_garbage_items_are_skipped_and_named_never_shown(
    api: FakeApi, running: list[str], cli: CliRun, caplog: pytest.LogCaptureFixture, command: int
) -> None:
    garbage = [1, "x", None, [], True, {"metadata": None, "data": SECRET}, {"metadata": {"name": 5}},
               {"metadata": {"name": SECRET, "labels": "not a map"}, "status": "no", "spec": []}]  # fmt: skip
    api.extra_items = {"jobs": garbage, "pods": garbage, "events": garbage, "nodes": garbage, "secrets": garbage}
    with caplog.at_level(logging.WARNING):
        code, out, err = cli(*commands(running)[command])
    assert code == EXIT_OK, err
    assert SECRET not in out + err + caplog.text
    if command < 4:  # status and list read the pods (and list the jobs)
        assert "skipped" in caplog.text and "not an object" in caplog.text


def test_a_status_with_every_field_garbage_still_answers(api: FakeApi, running: list[str], cli: CliRun) -> None:
    api.mangle = lambda p, obj: {"metadata": None, "spec": "x", "status": 7} if p in ("jobs", "pods") else obj
    code, out, err = cli("status", "quickstart", *running)
    assert code == EXIT_OK and "quickstart" in out, err
    code, out, err = cli("list", *running)
    assert code == EXIT_OK, err  # the job without a name is skipped: nothing to list


def test_conform_drops_what_is_not_of_its_type() -> None:
    pod = {"metadata": {"name": "p", "labels": {"a": "b", "c": 1}, "creationTimestamp": 12},
           "status": {"containerStatuses": [3, {"name": "runner", "state": "x", "restartCount": True}]},
           "spec": {"containers": "runner"}, "other": {"kept": [1]}}  # fmt: skip
    assert conform(pod, {"metadata": {"name": str, "labels": "map of strings", "creationTimestamp": str},
                         "status": {"containerStatuses": [{"name": str, "state": {}, "restartCount": int}]},
                         "spec": {"containers": [{}]}}) == {
        "metadata": {"name": "p", "labels": {"a": "b"}},
        "status": {"containerStatuses": [{"name": "runner"}]},
        "spec": {},
        "other": {"kept": [1]},
    }  # fmt: skip


def test_a_huge_list_is_read_in_bounded_time(caplog: pytest.LogCaptureFixture) -> None:
    items: list[Any] = [{"metadata": {"name": f"p{i}"}, "status": {"containerStatuses": "x"}} for i in range(50_000)]
    items += [7] * 50_000
    with cpu_seconds() as spent, caplog.at_level(logging.WARNING):
        kept = list_items("pods", items, "pods in namespace ml")
    assert len(kept) == 50_000 and spent.seconds < 5
    assert caplog.text.count("skipped") == 1 and "and 49995 more" in caplog.text
