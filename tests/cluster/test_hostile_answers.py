"""What a broken API server or a job's own container puts in the objects `jobspec status` reads: a termination
message nested 5,000 deep, counts of a billion, index ranges without end. Read tolerantly, in bounded time
and memory, never a traceback."""

from __future__ import annotations

import time
from typing import Any

import pytest

from jobspec.cluster.status import MAX_INDEXES, build_status, parse_index_set, parse_report


def job(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "train", "namespace": "ml"}, "spec": {"completions": 2}, "status": status}


def pod(message: str | None = None, restarts: Any = 0, exit_code: Any = 1) -> dict[str, Any]:
    term = {"exitCode": exit_code, "message": message}
    return {
        "metadata": {"name": "train-0-a", "annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
        "spec": {"containers": [{"name": "runner"}]},
        "status": {"phase": "Failed", "containerStatuses": [
            {"name": "runner", "restartCount": restarts, "state": {"terminated": term}}]},
    }  # fmt: skip


@pytest.mark.parametrize(
    "message",
    [
        '{"a":' * 5000 + "1" + "}" * 5000,
        "{" + '"x":' + "[" * 5000 + "]" * 5000 + "}",
        '{"step": ' + "9" * 5000 + "}",
        '{"loss": 1e999, "step": NaN, "tier": ' + '"t"' + "}",
        "{" * 100_000,
        "\x00\xff garbage \ud800",
    ],
    ids=["deep-object", "deep-list", "huge-int", "non-finite", "open-braces", "garbage"],
)
def test_a_hostile_termination_message_is_read_tolerantly(message: str):
    report = parse_report(message)
    assert report is not None  # the last line as the reason, or what parsed
    assert report.step is None or isinstance(report.step, int)
    assert report.reason is None or len(report.reason) <= 300


def test_a_termination_message_becomes_no_huge_report():
    report = parse_report('{"tier": "' + "t" * 100_000 + '", "note": "' + "n" * 100_000 + '"}')
    assert (
        report is not None and len(report.tier or "") <= 64 and all(len(str(v)) <= 300 for v in report.extra.values())
    )


def test_index_ranges_and_counts_from_a_broken_server_are_bounded():
    start = time.monotonic()
    assert len(parse_index_set("0-999999999999,5-" + "9" * 5000 + ",x-y")) <= MAX_INDEXES
    broken = job(completedIndexes="0-99999999999", failedIndexes="1-" + "9" * 4000, succeeded="many", failed=1e300,
                 active=[1])  # fmt: skip
    broken["spec"]["completions"] = 10**12
    st = build_status(broken, [pod(restarts="x", exit_code="-1e999")])
    assert time.monotonic() - start < 5
    assert len(st.indexes) <= MAX_INDEXES and (st.succeeded, st.failed, st.active) == (0, 0, 0)
    assert st.indexes[0].restarts == 0 and st.indexes[0].exit_code is None


def test_a_real_exit_code_and_counts_still_read():
    st = build_status(job(succeeded=1, failed="2"), [pod(restarts=3, exit_code=-9)])
    assert (st.succeeded, st.failed) == (1, 2) and st.indexes[0].restarts == 3 and st.indexes[0].exit_code == -9
