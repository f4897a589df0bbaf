"""Live progress of a running job: the last progress line rank 0 logged, read through the pod logs API.

The runner (runner/output/progress.py) logs `jobspec-progress/v1 {json}` at every logged train step. `status`,
`list` and `status -w` ask for a bounded tail of index 0's newest pod's log (TAIL_LINES lines, at most TAIL_BYTES)
and parse only the last line that carries the prefix. The log is the job's own output: untrusted, so the line is
parsed strictly (a bounded JSON object with exactly contract.PROGRESS_KEYS, each of its type and range) and
anything else is ignored. Needs `get pods/log` (k8s/base/submitter-rbac.yaml grants it for `jobspec logs`); the
pods need no API token.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from jobspec.cluster.pods import main_container, pods_by_index
from jobspec.contract import PROGRESS_EVENTS, PROGRESS_KEYS, PROGRESS_PREFIX
from jobspec.spec.credentials import redact
from jobspec.untrusted import json_loads

if TYPE_CHECKING:  # the client module pulls in urllib3 and tenacity: only for commands that connect
    from jobspec.cluster.client import ClusterClient

log = logging.getLogger(__name__)

TAIL_LINES = 200  # a progress line comes every log_every steps, among a few other lines each
TAIL_BYTES = 256 * 1024
MAX_LINE = 2048  # characters of a progress line's JSON: a real one is under 400
TIER = re.compile(r"^[a-z0-9_]{1,32}$")
MAX_STEPS = 10**12


@dataclass(frozen=True)
class Progress:
    step: int
    total_steps: int
    loss: float | None
    tokens_per_s: float | None
    eta_s: float | None
    tier: str
    micro_batch: int
    event: str | None  # the last OOM or tier change: oom_shrink, oom_retry, oom_regrow, tier_change
    event_step: int | None
    event_detail: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _count(value: Any, low: int = 0) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_STEPS
    return value if ok else None


def _real(value: Any) -> float | None:
    """A finite non-negative number, else None (a JSON null is allowed and means unknown)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return float(value) if ok else None


def parse_line(payload: str) -> Progress | None:
    """The Progress of one line's JSON, or None when it is not exactly the runner's shape."""
    if len(payload) > MAX_LINE:
        return None
    try:
        data = json_loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or set(data) != set(PROGRESS_KEYS):
        return None
    step, total, mbs = _count(data["step"]), _count(data["total_steps"]), _count(data["micro_batch"], 1)
    tier = data["tier"]
    if step is None or total is None or mbs is None or step > total or not (isinstance(tier, str) and TIER.match(tier)):
        return None
    numbers = {k: _real(data[k]) for k in ("loss", "tokens_per_s", "eta_s")}
    if any(numbers[k] is None and data[k] is not None for k in numbers):
        return None
    event = data["event"]
    known = isinstance(event, dict) and event.get("event") in PROGRESS_EVENTS and isinstance(event.get("detail"), str)
    if event is not None and not known:
        return None
    return Progress(
        step=step,
        total_steps=total,
        eta_s=numbers["eta_s"],
        loss=numbers["loss"],
        tokens_per_s=numbers["tokens_per_s"],
        tier=tier,
        micro_batch=mbs,
        event=event["event"] if event else None,
        event_step=_count(event.get("step")) if event else None,
        event_detail=redact(" ".join(event["detail"].split()), token_like=True)[:120] if event else None,
    )


def parse_progress(text: bytes | str) -> Progress | None:
    """The last progress line of a log tail, parsed; None when there is none or it is not well-formed."""
    if isinstance(text, bytes):
        text = text[-TAIL_BYTES:].decode("utf-8", "replace")
    last = None
    for line in text[-TAIL_BYTES:].splitlines():
        at = line.find(PROGRESS_PREFIX)
        if at >= 0:
            last = line[at + len(PROGRESS_PREFIX) :]
    return parse_line(last.strip()) if last is not None else None


def _started(pod: dict[str, Any]) -> bool:
    _, cstatus = main_container(pod)
    state = cstatus.get("state") or {}
    return "running" in state or "terminated" in state


def read_progress(client: ClusterClient, namespace: str, pods: list[dict[str, Any]]) -> Progress | None:
    """The last progress line of index 0's (rank 0's) newest pod that has started; None when there is none, the
    log cannot be read (refused, gone, not started) or the line is not well-formed."""
    from jobspec.cluster.errors import ApiError

    newest = next((p for p in pods_by_index(pods).get(0, []) if _started(p)), None)
    if newest is None:
        return None
    container, _ = main_container(newest)
    try:
        tail = client.read_log_tail(namespace, newest["metadata"]["name"], container=container, lines=TAIL_LINES,
                                    limit_bytes=TAIL_BYTES)  # fmt: skip
    except ApiError as err:  # 403 (no pods/log), 404 (gone), 400 (not started): no progress, status goes on
        log.debug("no progress from pod %s: %s", newest["metadata"]["name"], err)
        return None
    return parse_progress(tail)


def duration(seconds: float | None) -> str:
    """`2h 05m`, `4m 10s`, `12s`."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d {s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_line(p: Progress | None) -> str:
    """`step 120/300 (40%), loss 1.234, 12,345 tok/s, ETA 3m 20s, tier fast, micro-batch 8; last: ...`."""
    if p is None:
        return "none yet (rank 0 logs it at every logged step)"
    pct = f" ({100 * p.step // p.total_steps}%)" if p.total_steps else ""
    parts = [f"step {p.step}/{p.total_steps}{pct}"]
    parts += [f"loss {p.loss:.4g}"] if p.loss is not None else []
    parts += [f"{p.tokens_per_s:,.0f} tok/s"] if p.tokens_per_s is not None else []
    parts += [f"ETA {duration(p.eta_s)}", f"tier {p.tier}", f"micro-batch {p.micro_batch}"]
    text = ", ".join(parts)
    if p.event_detail:
        text += f"; last: {p.event_detail}" + (f" at step {p.event_step}" if p.event_step is not None else "")
    return text
