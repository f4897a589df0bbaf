"""The API server's answers, read defensively, once, where they arrive (client.get / client.list).

Every field jobspec reads from a Job, Pod, Event, Workload, Node, claim, namespace, queue or Secret has a type
here. What the server sends in a field's place that is not of that type (a string where a list belongs, a number
for a timestamp, null metadata, labels that are not a map of strings, a containerStatuses entry that is not an
object) is dropped, as if the server had not sent the field: the readers' `.get(...) or {}` then read an absent
field, which they already handle, and no reader needs a check of its own. Fields not named here pass unchanged.

A list item that is not an object, or whose metadata.name is not a name Kubernetes gives (a DNS subdomain), is
skipped and named in one warning line: its position and kind, never its content (a Secret's or a pod's content
can hold a credential, and a name that is no Kubernetes name could be anything).
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)

# A shape: a Python type (str, int, bool, dict: any map, list: any list), STRS (a map of str to str), a dict of
# field -> shape (an object with those fields typed), or a one-element list [shape] (a list of that shape, whose
# other items are dropped).
STRS = "map of strings"
NUMBER = (int, float)

METADATA = {
    "name": str, "namespace": str, "uid": str, "creationTimestamp": str, "deletionTimestamp": str,
    "labels": STRS, "annotations": STRS, "continue": str, "resourceVersion": str,
    "ownerReferences": [{"uid": str, "kind": str, "name": str, "apiVersion": str}],
}  # fmt: skip
CONDITION = {"type": str, "status": str, "reason": str, "message": str, "lastTransitionTime": str}
STATE = {
    "waiting": {"reason": str, "message": str},
    "running": {"startedAt": str},
    "terminated": {"exitCode": NUMBER, "reason": str, "message": str, "startedAt": str, "finishedAt": str},
}
CONTAINER_STATUS = {"name": str, "restartCount": NUMBER, "ready": bool, "state": STATE, "lastState": STATE}
RESOURCES = {"requests": dict, "limits": dict}
CONTAINER = {
    "name": str, "image": str, "resources": RESOURCES,
    "env": [{"name": str, "valueFrom": {"secretKeyRef": {"name": str, "key": str, "optional": bool}}}],
    "envFrom": [{"secretRef": {"name": str, "optional": bool}}],
}  # fmt: skip
POD_SPEC = {
    "containers": [CONTAINER], "initContainers": [CONTAINER], "nodeName": str, "schedulerName": str,
    "priorityClassName": str, "serviceAccountName": str, "nodeSelector": STRS, "imagePullSecrets": [{"name": str}],
    "volumes": [{"name": str, "persistentVolumeClaim": {"claimName": str},
                 "secret": {"secretName": str, "optional": bool, "items": [{"key": str}]}}],
}  # fmt: skip
POD = {
    "metadata": METADATA,
    "spec": POD_SPEC,
    "status": {"phase": str, "reason": str, "message": str, "startTime": str, "conditions": [CONDITION],
               "containerStatuses": [CONTAINER_STATUS], "initContainerStatuses": [CONTAINER_STATUS]},
}  # fmt: skip
JOB = {
    "metadata": METADATA,
    "spec": {"completions": NUMBER, "parallelism": NUMBER, "suspend": bool, "selector": {"matchLabels": STRS},
             "template": {"metadata": METADATA, "spec": POD_SPEC}},
    "status": {"active": NUMBER, "succeeded": NUMBER, "failed": NUMBER, "ready": NUMBER, "completedIndexes": str,
               "failedIndexes": str, "conditions": [CONDITION], "startTime": str, "completionTime": str},
}  # fmt: skip
EVENT = {
    "metadata": METADATA, "involvedObject": {"uid": str, "name": str, "kind": str}, "reason": str, "message": str,
    "type": str, "count": NUMBER, "lastTimestamp": str, "eventTime": str, "firstTimestamp": str,
}  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "jobs": JOB,
    "pods": POD,
    "events": EVENT,
    "workloads": {"metadata": METADATA, "status": {"conditions": [CONDITION]}},
    "nodes": {"metadata": METADATA, "spec": {"unschedulable": bool}, "status": {"allocatable": dict}},
    "persistentvolumeclaims": {"metadata": METADATA, "status": {"phase": str}},
    "namespaces": {"metadata": METADATA},
    "localqueues": {"metadata": METADATA, "spec": {"clusterQueue": str}},
    "secrets": {"metadata": METADATA, "data": dict, "stringData": dict},
}
ANY_OBJECT = {"metadata": METADATA}  # any other kind: its metadata


def conform(value: Any, shape: Any) -> Any:
    """`value` with every field that is not of its shape's type dropped; `_DROP` when `value` itself is not."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return _DROP
        out = {}
        for key, item in value.items():
            if key in shape:
                item = conform(item, shape[key])
                if item is _DROP:
                    continue
            out[key] = item
        return out
    if isinstance(shape, list):
        if not isinstance(value, list):
            return _DROP
        kept = (conform(item, shape[0]) for item in value)
        return [item for item in kept if item is not _DROP]
    if shape == STRS:
        if not isinstance(value, dict):
            return _DROP
        return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
    types = shape if isinstance(shape, tuple) else (shape,)
    if isinstance(value, bool) and bool not in types:  # a boolean is an int to Python, never a count here
        return _DROP
    return value if isinstance(value, types) else _DROP


_DROP = object()
NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # metadata.name: a DNS-1123 subdomain


def object_answer(plural: str, value: Any, namespace: str | None, name: str) -> dict[str, Any]:
    """A GET's answer for `name`: its fields conformed; a name and namespace the server did not give are the ones
    asked for (null metadata, a number for a name)."""
    got = conform(value, SHAPES.get(plural, ANY_OBJECT))
    obj: dict[str, Any] = got if isinstance(got, dict) else {}
    md = obj.setdefault("metadata", {})
    if not NAME.fullmatch(md.get("name") or ""):
        md["name"] = name
    if namespace and "namespace" not in md:
        md["namespace"] = namespace
    return obj


def list_items(plural: str, items: Any, where: str) -> list[dict[str, Any]]:
    """A list answer's items, conformed; an item that is not an object or has no name is skipped and named
    (its position only). `where`: what was listed, for the warning ("pods in namespace ml")."""
    if not isinstance(items, list):
        if items is not None:
            log.warning("the API server's list of %s has items that are not a list: ignored", where)
        return []
    shape = SHAPES.get(plural, ANY_OBJECT)
    out = []
    skipped: dict[str, list[int]] = {}
    for position, item in enumerate(items):
        got = conform(item, shape)
        if not isinstance(got, dict):
            skipped.setdefault("not an object", []).append(position)
        elif not NAME.fullmatch((got.get("metadata") or {}).get("name") or ""):
            skipped.setdefault("no Kubernetes name in metadata.name", []).append(position)
        else:
            out.append(got)
    for why, positions in skipped.items():
        more = f" and {len(positions) - 5} more" if len(positions) > 5 else ""
        shown = ", ".join(str(p) for p in positions[:5]) + more
        log.warning(
            "skipped %d item(s) of the API server's list of %s (%s): item %s", len(positions), where, why, shown
        )
    return out
