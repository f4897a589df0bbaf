"""`jobspec status -w`: the status once, then one line each time the phase, reason or progress changes, until the
job ends.

Polls `collect_status` (the Job, its pods, events, and a bounded tail of rank 0's log) every `interval` seconds,
at most `limit` seconds in all: no watch connection is held and nothing grows with the job's length. Ends when
the job has Succeeded or Failed, when it is deleted (cancelled), or at the limit; Ctrl-C is the caller's
(cli.py returns 130 without a traceback). With `json`, each change is one JSON object on its own line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from jobspec.cluster.errors import NotFound
from jobspec.cluster.progress import progress_line
from jobspec.cluster.status import FINISHED, JobStatus, collect_status

if TYPE_CHECKING:  # the client module pulls in urllib3 and tenacity: only for commands that connect
    from jobspec.cluster.client import ClusterClient

INTERVAL = 10.0  # seconds between polls
LIMIT = 24 * 3600.0  # seconds a watch lasts at most


def watch_line(st: JobStatus, now: Callable[[], str] = lambda: time.strftime("%H:%M:%S")) -> str:
    """`12:04:10  Running  step 120/300 (40%), loss 1.23, ...`: one change."""
    phase = st.phase + (f" ({st.reason})" if st.reason else "")
    said = progress_line(st.progress) if st.progress is not None else (st.message or "")
    return f"{now()}  {phase}  {said}".rstrip() + "\n"


def _key(st: JobStatus) -> tuple[Any, ...]:
    return st.phase, st.reason, st.message, st.progress


def watch(
    client: ClusterClient,
    namespace: str,
    name: str,
    out: TextIO,
    *,
    interval: float = INTERVAL,
    limit: float = LIMIT,
    json_lines: bool = False,
    first: Callable[[JobStatus], str] | None = None,
    note: Callable[[str], None] = lambda _: None,
) -> JobStatus | None:
    """Follow the job's status; returns the last one read, None when the job was deleted meanwhile. `first` formats
    the first status (the full table); later ones print as watch_line (or JSON lines)."""

    def show(st: JobStatus, initial: bool = False) -> None:
        if json_lines:
            out.write(json.dumps(st.to_dict(), separators=(",", ":"), allow_nan=False) + "\n")
        else:
            out.write(first(st) + "\n" if initial and first else watch_line(st))
        out.flush()

    st = collect_status(client, namespace, name)
    show(st, initial=True)
    seen = _key(st)
    for _ in range(max(1, int(limit / interval))):
        if st.phase in FINISHED:
            return st
        client.policy.sleep(interval)
        try:
            st = collect_status(client, namespace, name)
        except NotFound:
            note(f'job "{name}" in namespace "{namespace}" no longer exists (cancelled?)')
            return None
        if _key(st) != seen:
            show(st)
            seen = _key(st)
    if st.phase not in FINISHED:
        note(f"stopped watching after {limit:g} s; the job is still {st.phase}")
    return st
