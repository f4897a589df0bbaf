"""A Job's pods as plain objects: their completion index, grouped by it, the runner's container, and the Job's
index sets. Shared by status.py (what state a job is in) and diagnose.py (why it is not running)."""

from __future__ import annotations

from typing import Any

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # annotation (and label, 1.28+) on pods
MAX_INDEXES = 100_000  # Kubernetes' own limit on an Indexed Job's completions: a larger figure is not a Job's


def pod_index(pod: dict[str, Any]) -> int:
    md = pod.get("metadata") or {}
    raw = (md.get("annotations") or {}).get(COMPLETION_INDEX) or (md.get("labels") or {}).get(COMPLETION_INDEX)
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


def pods_by_index(pods: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Pods grouped by completion index, newest first."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for pod in pods:
        groups.setdefault(pod_index(pod), []).append(pod)
    for group in groups.values():
        group.sort(key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]), reverse=True)
    return groups


def main_container(pod: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The first container's name and its status entry (the runner's container)."""
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    name = containers[0].get("name")
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    found = next((s for s in statuses if s.get("name") == name), statuses[0] if statuses else {})
    return name, found


def parse_index_set(text: str | None) -> set[int]:
    """'0,2-4' (Job status completedIndexes / failedIndexes) -> {0, 2, 3, 4}; indexes below MAX_INDEXES only
    (a range of a billion from a broken server is no memory bomb here)."""
    out: set[int] = set()
    for part in (text if isinstance(text, str) else "").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()) and len(lo) < 7 and len(hi) < 7:
            out.update(range(min(int(lo), MAX_INDEXES), min(int(hi or lo) + 1, MAX_INDEXES)))
    return out
