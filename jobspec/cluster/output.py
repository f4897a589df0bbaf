"""What the cluster commands print: kubectl-like tables for people, fixed-key JSON for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from jobspec.cluster.cancel import CancelResult
from jobspec.cluster.diagnose import STUCK_WAITING
from jobspec.cluster.listing import JobSummary
from jobspec.cluster.progress import Progress, duration, progress_line
from jobspec.cluster.status import JobStatus, Report
from jobspec.cluster.submit import SubmitResult
from jobspec.errors import TROUBLESHOOTING, anchor

# Every reason `status` gives that the troubleshooting page has a section for (tests/test_docs.py checks each): the
# pods' (diagnose.py), Kueue's and the Job controller's. Any other reason links to the page's "My job is Pending".
REASON_DOCS = frozenset({
    *STUCK_WAITING, "FailedCreate", "Evicted", "Unschedulable", "NotScheduled", "ContainerCreating", "NoPod",  # pods
    "Pending", "Inadmissible", "Queued", "NoWorkload", "Preempted", "Admitted",  # Kueue
    "PodFailurePolicy", "BackoffLimitExceeded", "DeadlineExceeded",  # a Failed Job's condition
})  # fmt: skip


def reason_link(reason: str) -> str:
    """The troubleshooting section that explains a status reason."""
    return f"{TROUBLESHOOTING}#{anchor(reason) if reason in REASON_DOCS else 'job-not-running'}"


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, allow_nan=False) + "\n"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if v is None or v == "" else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells) + "\n"


def age(timestamp: str | None, now: datetime | None = None) -> str:
    """kubectl-style age: 45s, 12m, 5h, 3d."""
    if not timestamp:
        return "-"
    try:
        then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "-"
    secs = max(0, int(((now or datetime.now(timezone.utc)) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= 2 * size or (unit == "m" and secs >= size):
            return f"{secs // size}{unit}"
    return f"{secs}s"


def _loss(value: float | None) -> str | None:
    return None if value is None else f"{value:.4g}"


def report_line(report: Report | None) -> str:
    if report is None:
        return "none yet (the runner reports when a pod ends)"
    parts = [
        f"tier {report.tier}" if report.tier else "",
        f"step {report.step}" if report.step is not None else "",
        f"loss {_loss(report.loss)}" if report.loss is not None else "",
        report.reason or "",
    ]
    parts += [f"{k}={v}" for k, v in report.extra.items()]
    return ", ".join(p for p in parts if p) or "-"


def format_status(st: JobStatus) -> str:
    phase = st.phase
    if st.reason:
        phase += f" ({st.reason}{': ' + st.message if st.message else ''})"
    elif st.phase == "Suspended" and st.queue:
        phase += f" (waiting for Kueue to admit it from queue {st.queue})"
    lines = [
        f"job        {st.name}",
        f"namespace  {st.namespace}",
        f"phase      {phase}",
        f"indexes    {st.succeeded}/{st.completions} succeeded, {st.active} active, {st.failed} failed pods",
    ]
    if st.reason:
        lines.append(f"help       {reason_link(st.reason)}")
    if st.queue:
        lines.append(f"queue      {st.queue}")
    if st.start_time:
        lines.append(f"started    {st.start_time}" + (f", finished {st.completion_time}" if st.completion_time else ""))
    lines.append(f"report     {report_line(st.report)}")
    if st.progress is not None or st.phase == "Running":
        lines.append(f"progress   {progress_line(st.progress)}")
    rows = [
        [
            ix.index,
            ix.pod,
            ix.phase,
            ix.detail,
            ix.restarts,
            ix.attempts,
            ix.node,
            ix.exit_code,
            ix.report.tier if ix.report else None,
            ix.report.step if ix.report else None,
            _loss(ix.report.loss) if ix.report else None,
        ]
        for ix in st.indexes
    ]
    headers = ["INDEX", "POD", "PHASE", "DETAIL", "RESTARTS", "ATTEMPTS", "NODE", "EXIT", "TIER", "STEP", "LOSS"]
    return "\n".join(lines) + "\n\n" + table(headers, rows)


def format_list(jobs: Sequence[JobSummary], *, all_namespaces: bool, now: datetime | None = None) -> str:
    if not jobs:
        return "no jobs made by jobspec found\n"
    headers = ["NAME", "PHASE", "REASON", "COMPLETIONS", "STEP", "LOSS", "TOK/S", "ETA", "TIER", "MBS", "LAST", "QUEUE",
               "AGE"]  # fmt: skip
    rows = [[j.name, j.phase, j.reason, f"{j.succeeded}/{j.completions}", *_progress_cells(j.progress), j.queue,
             age(j.created, now)] for j in jobs]  # fmt: skip
    if all_namespaces:
        headers, rows = ["NAMESPACE", *headers], [[j.namespace, *r] for j, r in zip(jobs, rows, strict=True)]
    return table(headers, rows)


def _progress_cells(p: Progress | None) -> list[Any]:
    """STEP, LOSS, TOK/S, ETA, TIER, MBS, LAST of `list`."""
    if p is None:
        return [None] * 7
    last = f"{p.event}@{p.event_step}" if p.event and p.event_step is not None else p.event
    rate = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s is not None else None
    return [f"{p.step}/{p.total_steps}", _loss(p.loss), rate, duration(p.eta_s), p.tier, p.micro_batch, last]


def follow_up(name: str, namespace: str, extra_flags: str = "") -> str:
    flags = f"-n {namespace}{extra_flags}"
    return (
        "follow it with:\n"
        f"  jobspec status {name} {flags}\n"
        f"  jobspec logs {name} {flags} -f\n"
        f"  jobspec cancel {name} {flags}\n"
    )


def format_submit(result: SubmitResult, extra_flags: str = "") -> str:
    where = f'job "{result.name}" in namespace "{result.namespace}"'
    if result.outcome == "unchanged":
        head = (
            f"{where} is already submitted with this spec ({result.phase}); nothing changed. "
            "Re-submit with --replace to run it again.\n"
        )
        return head + follow_up(result.name, result.namespace, extra_flags)
    verb = {"created": "created", "replaced": "replaced (old job deleted first)"}[result.outcome]
    if result.dry_run:
        body = "".join(f"{r} {result.outcome} (server dry run)\n" for r in result.applied)
        body += "".join(f"{r} kept (it exists)\n" for r in result.kept)
        return body + f"{where} would be {verb}; nothing was persisted\n"
    body = "".join(f"{r} applied\n" for r in result.applied)
    body += "".join(f"{r} kept (it exists: a cache jobs share)\n" for r in result.kept)
    return body + f"{where} {verb}\n" + follow_up(result.name, result.namespace, extra_flags)


def format_cancel(result: CancelResult) -> str:
    lines = [f"{r} deleted" for r in result.deleted] + [f"{r} was already gone" for r in result.gone_already]
    return "\n".join(lines) + f'\njob "{result.name}" cancelled in namespace "{result.namespace}"\n'
