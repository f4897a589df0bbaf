"""A small fake Kubernetes API server on 127.0.0.1, for the paths jobspec uses.

Real HTTP (http.server in a thread), real kubernetes client on the other side (pointed at it
by a generated kubeconfig). It stores objects in memory, records every request, checks the
bearer token, and plays scripted faults: an error status (with headers such as Retry-After),
a connection reset, or a delay (to trip the client's read timeout).
"""

from __future__ import annotations

import copy
import re
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .fake_http import Fault, Handler, Request, Served, Server, status_body

__all__ = ["TOKEN", "FakeApi", "Request"]

TOKEN = "tok-S3CRET-do-not-print-0123456789"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
INDEX = "batch.kubernetes.io/job-completion-index"
MANAGED = "app.kubernetes.io/managed-by"

_CORE = re.compile(
    r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>configmaps|services|pods|persistentvolumeclaims|events|secrets|"
    r"serviceaccounts)(?:/(?P<name>[^/]+))?(?P<log>/log)?$"
)
# Cluster-scoped (stored under namespace ""): read by the pre-submit checks
_CLUSTER = re.compile(
    r"^/api(?:s/scheduling.k8s.io)?/v1/(?P<plural>namespaces|nodes|priorityclasses)(?:/(?P<name>[^/]+))?$"
)
_KUEUE_CLUSTER = re.compile(r"^/apis/kueue.x-k8s.io/v1beta2/(?P<plural>clusterqueues)(?:/(?P<name>[^/]+))?$")
_BATCH = re.compile(r"^/apis/batch/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>jobs)(?:/(?P<name>[^/]+))?$")
_KUEUE = re.compile(
    r"^/apis/kueue.x-k8s.io/v1beta2/namespaces/(?P<ns>[^/]+)/(?P<plural>workloads|localqueues)(?:/(?P<name>[^/]+))?$"
)
_ALL_JOBS = re.compile(r"^/apis/batch/v1/(?P<plural>jobs)$")
_NETWORKING = re.compile(
    r"^/apis/networking.k8s.io/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>networkpolicies)(?:/(?P<name>[^/]+))?$"
)


# What a client learns the API's resources from (legacy discovery, which kubectl falls back to from the aggregated
# kind): group -> version -> [(plural, kind, namespaced, verbs)]. Authorised for everyone, like the real
# system:discovery role.
_VERBS = ["create", "delete", "get", "list", "patch", "update"]
_RESOURCES: dict[str, tuple[str, list[tuple[str, str, bool]]]] = {
    "": ("v1", [("configmaps", "ConfigMap", True), ("services", "Service", True), ("pods", "Pod", True),
                ("persistentvolumeclaims", "PersistentVolumeClaim", True), ("events", "Event", True),
                ("secrets", "Secret", True), ("serviceaccounts", "ServiceAccount", True),
                ("namespaces", "Namespace", False), ("nodes", "Node", False)]),
    "batch": ("v1", [("jobs", "Job", True)]),
    "networking.k8s.io": ("v1", [("networkpolicies", "NetworkPolicy", True)]),
    "scheduling.k8s.io": ("v1", [("priorityclasses", "PriorityClass", False)]),
    "kueue.x-k8s.io": ("v1beta2", [("workloads", "Workload", True), ("localqueues", "LocalQueue", True),
                                   ("clusterqueues", "ClusterQueue", False)]),
}  # fmt: skip


def discovery(path: str, kueue: bool) -> dict[str, Any] | None:
    """The discovery document at `path` (/api, /apis, /api/v1, /apis/GROUP/VERSION), or None."""
    groups = {g: v for g, v in _RESOURCES.items() if g and (kueue or g != "kueue.x-k8s.io")}
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}  # fmt: skip
    if path == "/apis":
        versions = {g: {"groupVersion": f"{g}/{v}", "version": v} for g, (v, _) in groups.items()}
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [{"name": g, "versions": [gv], "preferredVersion": gv} for g, gv in versions.items()],
        }
    for group, (version, resources) in [("", _RESOURCES[""]), *groups.items()]:
        if path == (f"/apis/{group}/{version}" if group else "/api/v1"):
            return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}".strip("/"),
                    "resources": [{"name": r, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind,
                                   "verbs": _VERBS} for r, kind, namespaced in resources]}  # fmt: skip
    return None


def rbac_of(req: Request, exists: bool | None = None) -> set[tuple[str, str, str, str]]:
    """The (scope, apiGroup, resource, verb) the API server would authorise for a request (none for discovery).
    GET of a Namespace object is authorised in that namespace (a Role there may grant it), like any namespaced
    read. A server-side apply (PATCH) that creates needs create too: `exists` says whether the object was there
    (None: after the request, from what it recorded)."""
    parts = req.path.strip("/").split("/")
    if discovery(req.path, kueue=True) is not None or parts[0] not in ("api", "apis"):
        return set()
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    scope = "namespace" if rest[0] == "namespaces" else "cluster"
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0] + ("/log" if rest[-1] == "log" else "")
    if req.method == "GET":
        return {(scope, group, resource, "get" if len(rest) > 1 else "list")}
    created = req.created if exists is None else not exists
    verbs = {"PATCH": {"patch"} | ({"create"} if created else set()), "DELETE": {"delete"}, "POST": {"create"}}
    return {(scope, group, resource, v) for v in verbs[req.method]}


class FakeApi(Served):  # start(), stop(), url
    handler, server = Handler, Server

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, namespace, name)
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.logs: dict[tuple[str, str], bytes] = {}  # (namespace, pod) -> whole log
        self.previous_logs: dict[tuple[str, str], bytes] = {}
        # (namespace, pod) -> scripts, one per follow request: bytes to send, a float to pause,
        # or a callable run at that point (e.g. to mark the pod finished).
        self.streams: dict[tuple[str, str], list[list[Any]]] = {}
        self.lock = threading.RLock()
        self._counter = 0
        # Every namespace exists (as objects are applied into any), without labels, unless put() with labels or
        # named here; Kueue's API is served unless `kueue` is False (then its paths 404 as an unknown resource).
        self.absent_namespaces: set[str] = set()
        self.kueue = True
        # RBAC: when set, what the caller is granted ((scope, apiGroup, resource, verb), as rbac_of gives); any other
        # request is refused with the real server's 403
        self.granted: set[tuple[str, str, str, str]] | None = None
        # kubectl sends no bearer token to a plain-HTTP server: let it in (as the submitter, for `granted`)
        self.anonymous = False
        # A broken server: `mangle(plural, obj)` is served in place of each stored object (a deep copy), and
        # `extra_items[plural]` are added to each list answer of that plural as they are
        self.mangle: Callable[[str, dict[str, Any]], Any] | None = None
        self.extra_items: dict[str, list[Any]] = {}

    def kubeconfig(self, directory: Path, namespace: str | None = "ml", token: str = TOKEN) -> Path:
        """A kubeconfig with context `fake` (namespace `namespace`) and `other` (namespace `other-ns`)."""
        ctx: dict[str, Any] = {"cluster": "fake", "user": "fake-user"}
        if namespace:
            ctx["namespace"] = namespace
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake-user", "user": {"token": token}}],
            "contexts": [
                {"name": "fake", "context": ctx},
                {"name": "other", "context": {"cluster": "fake", "user": "fake-user", "namespace": "other-ns"}},
            ],
        }
        path = directory / "kubeconfig.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    # -- scripting ---------------------------------------------------------------------------

    def fail(self, method: str, path: str, status: int = 500, **kwargs: Any) -> Fault:
        fault = Fault(method, re.compile(path), status=status, **kwargs)
        self.faults.append(fault)
        return fault

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        plural = {"ConfigMap": "configmaps", "Service": "services", "Job": "jobs", "Pod": "pods",
                  "NetworkPolicy": "networkpolicies",
                  "PersistentVolumeClaim": "persistentvolumeclaims", "Event": "events",
                  "Workload": "workloads", "Secret": "secrets", "ServiceAccount": "serviceaccounts",
                  "Namespace": "namespaces", "Node": "nodes", "PriorityClass": "priorityclasses",
                  "LocalQueue": "localqueues", "ClusterQueue": "clusterqueues"}[obj["kind"]]  # fmt: skip
        md = obj["metadata"]
        md.setdefault("namespace", "")  # cluster-scoped
        md.setdefault("uid", str(uuid.uuid4()))
        md.setdefault("creationTimestamp", "2025-01-01T00:00:00Z")
        with self.lock:
            self.objects[(plural, md["namespace"], md["name"])] = obj
        return obj

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            return self.objects.get((plural, namespace, name))

    def add_pod(
        self,
        namespace: str,
        job: str,
        index: int = 0,
        *,
        phase: str = "Running",
        name: str | None = None,
        created: str = "2025-01-01T00:01:00Z",
        restarts: int = 0,
        state: dict[str, Any] | None = None,
        last_state: dict[str, Any] | None = None,
        node: str = "node-1",
    ) -> dict[str, Any]:
        owner = self.get("jobs", namespace, job)
        uid = owner["metadata"]["uid"] if owner else "no-job"
        if state is None:
            state = (
                {"running": {"startedAt": created}}
                if phase == "Running"
                else {"waiting": {"reason": "ContainerCreating"}}
            )
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name or f"{job}-{index}-{uuid.uuid4().hex[:5]}",
                "namespace": namespace,
                "creationTimestamp": created,
                # the Job controller's labels, and the template's managed-by (render/objects.py)
                "labels": {CONTROLLER_UID: uid, "job-name": job, INDEX: str(index), MANAGED: "jobspec"},
                "annotations": {INDEX: str(index)},
            },
            "spec": {"containers": [{"name": "runner", "image": "x"}], "nodeName": node},
            "status": {
                "phase": phase,
                "containerStatuses": [
                    {"name": "runner", "restartCount": restarts, "state": state, "lastState": last_state or {}}
                ],
            },
        }
        return self.put(pod)

    def set_pod(self, namespace: str, name: str, phase: str, state: dict[str, Any]) -> None:
        with self.lock:
            pod = self.objects[("pods", namespace, name)]
            pod["status"]["phase"] = phase
            pod["status"]["containerStatuses"][0]["state"] = state

    def calls(self, method: str | None = None, path_contains: str = "") -> list[Request]:
        return [r for r in self.requests if (method is None or r.method == method) and path_contains in r.path]

    # -- request handling (called from server threads) ---------------------------------------

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and fault.path.search(path):
                    fault.times -= 1
                    return fault
        return None

    def handle(self, req: Request) -> tuple[int, dict[str, str], Any]:
        """-> (status, headers, body): a dict (JSON), bytes, or a list (a follow stream script)."""
        if req.headers.get("authorization") != f"Bearer {TOKEN}" and not self.anonymous:
            return 401, {}, status_body(401, "Unauthorized", "Unauthorized")
        if req.method == "GET" and (found := discovery(req.path, self.kueue)) is not None:
            return 200, {}, found
        routes = (_CORE, _BATCH, _ALL_JOBS, _NETWORKING, _CLUSTER, *((_KUEUE, _KUEUE_CLUSTER) if self.kueue else ()))
        m = next(filter(None, (p.match(req.path) for p in routes)), None)
        if m and (refused := self._forbidden(req, m.groupdict())) is not None:
            return refused
        if not m:
            return (
                404,
                {},
                status_body(404, f"the server could not find the requested resource ({req.path})", "NotFound"),
            )
        parts = m.groupdict()
        plural, ns, name = parts["plural"], parts.get("ns"), parts.get("name")
        if "ns" not in parts:  # cluster-scoped
            ns = None if name is None else ""
        with self.lock:
            if plural == "namespaces" and name and ("namespaces", "", name) not in self.objects:
                if name in self.absent_namespaces:
                    return self._not_found(plural, name)
                return 200, {}, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
            if parts.get("log"):
                return self._log(ns, name, req)
            if req.method == "GET" and name is None:
                return 200, {}, self._served_list(plural, self._list(plural, ns, req.query))
            if req.method == "GET":
                obj = self.objects.get((plural, ns, name))
                return (200, {}, self._served(plural, obj)) if obj else self._not_found(plural, name)
            if req.method == "PATCH":
                return self._apply(plural, ns, name, req)
            if req.method == "POST" and name is None and ns:
                return self._create(plural, ns, req)
            if req.method == "DELETE":
                return self._delete(plural, ns, name, req)
        return 405, {}, status_body(405, "method not allowed", "MethodNotAllowed")

    def _forbidden(self, req: Request, parts: dict[str, Any]) -> tuple[int, dict[str, str], Any] | None:
        """The real server's 403 for a request RBAC does not grant (None: granted, or RBAC off)."""
        if self.granted is None:
            return None
        ns = parts.get("ns")
        exists = (parts["plural"], ns or "", parts.get("name")) in self.objects
        missing = sorted(rbac_of(req, exists) - self.granted)
        if not missing:
            return None
        _, group, resource, verb = missing[0]
        where = f' in the namespace "{ns}"' if ns else " at the cluster scope"
        message = (f'{resource} "{parts.get("name") or ""}" is forbidden: User "system:serviceaccount:jobspec:'
                   f'jobspec-submitter" cannot {verb} resource "{resource}" in API group "{group}"{where}')  # fmt: skip
        return 403, {}, status_body(403, message, "Forbidden")

    def _create(self, plural: str, ns: str, req: Request) -> tuple[int, dict[str, str], Any]:
        """POST: what `kubectl apply` (client-side) and `kubectl create` send for a new object."""
        new = copy.deepcopy(req.body)
        md = new.setdefault("metadata", {})
        if md.setdefault("namespace", ns) != ns:
            return 400, {}, status_body(400, "the namespace of the object does not match the URL", "BadRequest")
        if (plural, ns, md.get("name")) in self.objects:
            return 409, {}, status_body(409, f'{plural} "{md.get("name")}" already exists', "AlreadyExists")
        req.created = True
        self._counter += 1
        md.update(uid=str(uuid.uuid4()), creationTimestamp="2025-01-01T00:00:00Z", resourceVersion=str(self._counter))
        if plural == "jobs":
            sel = {CONTROLLER_UID: md["uid"]}
            new["spec"]["selector"] = {"matchLabels": sel}
            new["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(sel)
            new["status"] = {}
        if req.query.get("dryRun") != "All":
            self.objects[(plural, ns, md["name"])] = new
        return 201, {}, new

    def _not_found(self, plural: str, name: str | None) -> tuple[int, dict[str, str], Any]:
        group = {"jobs": "jobs.batch", "networkpolicies": "networkpolicies.networking.k8s.io"}.get(plural, plural)
        body = status_body(404, f'{group} "{name}" not found', "NotFound")
        body["details"] = {"name": name, "kind": plural}  # as the real server says which object is missing
        return 404, {}, body

    def _served(self, plural: str, obj: dict[str, Any]) -> Any:
        return obj if self.mangle is None else self.mangle(plural, copy.deepcopy(obj))

    def _served_list(self, plural: str, answer: dict[str, Any]) -> dict[str, Any]:
        if self.mangle is None and plural not in self.extra_items:
            return answer
        items = [self._served(plural, o) for o in answer["items"]] + list(self.extra_items.get(plural, []))
        return {**answer, "items": items}

    def _list(self, plural: str, ns: str | None, query: dict[str, str]) -> dict[str, Any]:
        wanted = dict(kv.split("=", 1) for kv in query.get("labelSelector", "").split(",") if kv)
        fields = dict(kv.split("=", 1) for kv in query.get("fieldSelector", "").split(",") if kv)

        def field(obj: dict[str, Any], path: str) -> Any:  # "involvedObject.name" -> obj["involvedObject"]["name"]
            for part in path.split("."):
                obj = obj.get(part) if isinstance(obj, dict) else None
            return obj

        items = [
            o
            for (p, n, _), o in sorted(self.objects.items())
            if p == plural
            and (ns is None or n == ns)
            and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())
            and all(field(o, k) == v for k, v in fields.items())
        ]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or len(items) or 1)
        page = items[start : start + limit]
        token = str(start + limit) if start + limit < len(items) else ""
        return {"kind": "List", "apiVersion": "v1", "metadata": {"continue": token} if token else {}, "items": page}

    def _apply(self, plural: str, ns: str, name: str, req: Request) -> tuple[int, dict[str, str], Any]:
        if req.headers.get("content-type") != "application/apply-patch+yaml" or not req.query.get("fieldManager"):
            return (
                415,
                {},
                status_body(415, "expected a server-side apply patch with a fieldManager", "UnsupportedMediaType"),
            )
        body = req.body
        if body["metadata"]["name"] != name or body["metadata"]["namespace"] != ns:
            return 400, {}, status_body(400, "name or namespace in the body does not match the URL", "BadRequest")
        old = self.objects.get((plural, ns, name))
        new = copy.deepcopy(body)
        if old is None:
            req.created = True
            self._counter += 1
            new["metadata"].update(
                uid=str(uuid.uuid4()), creationTimestamp="2025-01-01T00:00:00Z", resourceVersion=str(self._counter)
            )
            if plural == "jobs":
                sel = {CONTROLLER_UID: new["metadata"]["uid"]}
                new["spec"]["selector"] = {"matchLabels": sel}
                new["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(sel)
                new["status"] = {}
        else:
            for key in ("uid", "creationTimestamp"):
                new["metadata"][key] = old["metadata"][key]
            if plural == "jobs":
                new["spec"]["selector"] = old["spec"]["selector"]
                new["status"] = old.get("status", {})
        if req.query.get("dryRun") != "All":
            self.objects[(plural, ns, name)] = new
        return (201 if old is None else 200), {}, new

    def _delete(self, plural: str, ns: str, name: str, req: Request) -> tuple[int, dict[str, str], Any]:
        obj = self.objects.get((plural, ns, name))
        if obj is None:
            return self._not_found(plural, name)
        if req.query.get("dryRun") != "All":
            del self.objects[(plural, ns, name)]
            if plural == "jobs":  # the garbage collector, instantly
                uid = obj["metadata"]["uid"]
                for key in [
                    k
                    for k, o in self.objects.items()
                    if k[0] == "pods" and o["metadata"]["labels"].get(CONTROLLER_UID) == uid
                ]:
                    del self.objects[key]
        return 200, {}, {"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name}}

    def _log(self, ns: str, pod: str, req: Request) -> tuple[int, dict[str, str], Any]:
        if ("pods", ns, pod) not in self.objects:
            return self._not_found("pods", pod)
        if req.query.get("follow") == "true":
            scripts = self.streams.get((ns, pod)) or [[]]
            return 200, {"Content-Type": "text/plain"}, scripts.pop(0) if len(scripts) > 1 else scripts[0]
        source = self.previous_logs if req.query.get("previous") == "true" else self.logs
        if (ns, pod) not in source:
            return (
                400,
                {},
                status_body(400, f'previous terminated container "runner" in pod "{pod}" not found', "BadRequest"),
            )
        text = source[(ns, pod)]
        if req.query.get("tailLines"):  # as the kubelet: the last N lines, then at most limitBytes of them
            lines = text.splitlines(keepends=True)
            text = b"".join(lines[len(lines) - min(int(req.query["tailLines"]), len(lines)) :])
        if req.query.get("limitBytes"):
            text = text[: int(req.query["limitBytes"])]
        return 200, {"Content-Type": "text/plain"}, text
