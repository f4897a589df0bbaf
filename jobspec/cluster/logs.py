"""`jobspec logs`: one index's log, printed or followed until its pod ends.

Following asks for timestamps so a dropped or idle stream can be re-opened at the last
second seen (sinceTime) with no line printed twice: lines at or before the last printed
timestamp are skipped, counting repeats of that exact timestamp.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from jobspec.cluster.errors import NotReady
from jobspec.cluster.resources import JOB, POD
from jobspec.cluster.status import FINISHED, job_phase, main_container, pod_detail, pod_selector, pods_by_index

if TYPE_CHECKING:  # the client module pulls in urllib3 and tenacity: only for commands that connect
    from jobspec.cluster.client import ClusterClient

log = logging.getLogger(__name__)

START_WAIT = 600.0  # seconds `-f` waits for a pod to be scheduled and started
POLL = 2.0
MAX_LINE_BYTES = 1024**2  # a followed line longer than this is printed in pieces (the stream is never held whole)


def _started(pod: dict[str, Any]) -> bool:
    _, cstatus = main_container(pod)
    state = cstatus.get("state") or {}
    return "running" in state or "terminated" in state or "terminated" in (cstatus.get("lastState") or {})


def _ended(pod: dict[str, Any] | None) -> bool:
    if pod is None or (pod.get("status") or {}).get("phase") in FINISHED:
        return True
    _, cstatus = main_container(pod)
    return "terminated" in (cstatus.get("state") or {})


def index_pods(client: ClusterClient, namespace: str, name: str, index: int) -> tuple[dict[str, Any], list[dict]]:
    """The Job and its pods for `index`, newest first (NotFound when the job does not exist)."""
    job = client.get(JOB, namespace, name)
    pods = pods_by_index(client.list(POD, namespace, pod_selector(job))).get(index, [])
    return job, pods


def print_log(
    client: ClusterClient,
    namespace: str,
    name: str,
    index: int,
    out: TextIO,
    *,
    previous: bool = False,
    note: Callable[[str], None] = lambda s: None,
) -> None:
    """Print the log of the newest pod of `index`. `previous`: the container's previous run if it
    restarted, else the index's previous pod (e.g. the attempt before a memory-tier retry)."""
    job, pods = index_pods(client, namespace, name, index)
    if not pods:
        raise NotReady(
            f'job "{name}" has no pod for index {index} yet ({job_phase(job)}); '
            f"follow it with `jobspec logs {name} -n {namespace} -f`"
        )
    pod, use_previous = pods[0], False
    if previous:
        _, cstatus = main_container(pod)
        if int(cstatus.get("restartCount") or 0) > 0:
            use_previous = True
        elif len(pods) > 1:
            pod = pods[1]
            note(f"showing the previous attempt of index {index}: pod {pod['metadata']['name']}")
        else:
            raise NotReady(f'index {index} of job "{name}" has had one attempt and no restart: no previous log')
    if not use_previous and not _started(pod):
        raise NotReady(
            f"pod {pod['metadata']['name']} (index {index}) has not started yet "
            f"({pod_detail(pod) or 'Pending'}); follow it with `jobspec logs {name} -n {namespace} -f`"
        )
    from jobspec.cluster.client import MAX_LOG_BYTES

    container, _ = main_container(pod)
    data = client.read_log(namespace, pod["metadata"]["name"], container=container, previous=use_previous)
    out.write(data[:MAX_LOG_BYTES].decode("utf-8", "replace"))
    out.flush()
    if len(data) > MAX_LOG_BYTES:
        note(f"the log is longer than {MAX_LOG_BYTES // 1024**2} MiB: its first {MAX_LOG_BYTES // 1024**2} MiB are "
             f"shown; `jobspec logs {name} -n {namespace} -f --index {index}` streams it whole")  # fmt: skip


@dataclass
class _Dedupe:
    """Drops lines a re-opened stream sends again (same or older timestamp)."""

    last: str = ""  # normalised timestamp of the last printed line
    repeats: int = 0  # lines printed with exactly that timestamp
    skip_equal: int = 0  # on a re-open: how many lines at `last` to drop

    def reopen(self) -> str | None:
        self.skip_equal = self.repeats
        return self.last[:19] + "Z" if self.last else None  # sinceTime takes whole seconds

    def admit(self, stamp: str) -> bool:
        key = _stamp_key(stamp)
        if key < self.last:
            return False
        if key == self.last:
            if self.skip_equal:
                self.skip_equal -= 1
                return False
            self.repeats += 1
            return True
        self.last, self.repeats, self.skip_equal = key, 1, 0
        return True


def _stamp_key(stamp: str) -> str:
    """RFC 3339 (nano) UTC -> fixed-width sortable text: 2024-01-02T03:04:05.000000001."""
    base, _, frac = stamp.rstrip("Z").partition(".")
    return f"{base}.{frac.ljust(9, '0')[:9]}"


def follow_log(
    client: ClusterClient,
    namespace: str,
    name: str,
    index: int,
    out: TextIO,
    *,
    note: Callable[[str], None] = lambda s: None,
    start_wait: float = START_WAIT,
    poll: float = POLL,
) -> None:
    """Stream the newest pod of `index` until that pod ends; waits (bounded) for it to start."""
    pod = _wait_for_start(client, namespace, name, index, note, start_wait, poll)
    pod_name = pod["metadata"]["name"]
    container, _ = main_container(pod)
    seen, since = _Dedupe(), None
    while True:
        got_data, buf = False, b""
        for chunk in client.log_chunks(namespace, pod_name, container=container, since_time=since):
            got_data = got_data or bool(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                _emit(line, seen, out)
            if len(buf) > MAX_LINE_BYTES:  # a line without end: printed as it comes (timestamp and all), not held
                out.write(buf.decode("utf-8", "replace"))
                out.flush()
                buf = b""
        if buf:
            _emit(buf, seen, out)
        if _ended(client.find(POD, namespace, pod_name)):
            break
        log.debug("log stream of %s closed while the pod runs: re-opening", pod_name)
        since = seen.reopen()
        if not got_data:
            client.policy.sleep(poll)
    job = client.find(JOB, namespace, name)
    if job is not None and job_phase(job) not in FINISHED:
        _, newer = index_pods(client, namespace, name, index)
        if newer and newer[0]["metadata"]["name"] != pod_name:
            note(
                f"pod {pod_name} ended; index {index} continues in pod {newer[0]['metadata']['name']}: "
                f"run `jobspec logs {name} -n {namespace} -f --index {index}` again"
            )


def _emit(line: bytes, seen: _Dedupe, out: TextIO) -> None:
    stamp, sep, text = line.partition(b" ")
    if sep and stamp[:1].isdigit():
        if not seen.admit(stamp.decode("ascii", "replace")):
            return
        line = text
    out.write(line.decode("utf-8", "replace") + "\n")
    out.flush()


def _wait_for_start(
    client: ClusterClient,
    namespace: str,
    name: str,
    index: int,
    note: Callable[[str], None],
    start_wait: float,
    poll: float,
) -> dict[str, Any]:
    said = ""
    for _ in range(max(1, int(start_wait / poll))):
        job, pods = index_pods(client, namespace, name, index)
        if pods and _started(pods[0]):
            return pods[0]
        if not pods and job_phase(job) in FINISHED:
            raise NotReady(f'job "{name}" is {job_phase(job)} and has no pod for index {index}')
        why = f"pod {pods[0]['metadata']['name']} is {pod_detail(pods[0]) or 'Pending'}" if pods else "no pod yet"
        if why != said:
            note(f"waiting for index {index} of job {name} to start: {why}")
            said = why
        client.policy.sleep(poll)
    raise NotReady(
        f'index {index} of job "{name}" did not start within {start_wait:g} s ({said or "no pod"}); '
        f"see `jobspec status {name} -n {namespace}`"
    )
