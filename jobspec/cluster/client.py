"""A thin Kubernetes API client working in plain dicts.

This is the boundary: the only module that sees urllib3's exceptions. From the kubernetes
library it takes the configuration (kubeconfig, in-cluster) and the connection pool built
from it; requests and JSON are handled here, in dicts.
Each request runs under the retry policy, with a bounded timeout, and every failure leaves
here as a `ClusterError` subclass (errors.py) naming the operation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlencode

from jobspec.cluster import retry
from jobspec.cluster.errors import ApiTimeout, NotFound, Op, Unreachable, error_for_status
from jobspec.cluster.kubeconfig import Connection
from jobspec.cluster.resources import POD, Kind, kind_of
from jobspec.cluster.retry import HttpStatus, RetryPolicy
from jobspec.errors import ClusterError
from jobspec.spec.credentials import redact

log = logging.getLogger(__name__)

FIELD_MANAGER = "jobspec"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply; the JSON body is valid YAML
DEFAULT_TIMEOUT = 30.0  # seconds per request (read); connecting gets at most 10 s
FOLLOW_IDLE = 60.0  # a followed log quiet this long is re-opened (see logs.py)

Query = Sequence[tuple[str, str]]


class ClusterClient:
    """Reads and writes the objects of one job. Use as a context manager, or call close()."""

    def __init__(
        self,
        connection: Connection,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        policy: RetryPolicy | None = None,
        follow_idle: float = FOLLOW_IDLE,
    ) -> None:
        # Only the library's configured connection pool is used (TLS, client certificates,
        # proxy from the kubeconfig): its request and model layers changed shape across
        # releases, this did not.
        from kubernetes.client.rest import RESTClientObject

        from jobspec import __version__

        self.connection = connection
        self.timeout = timeout
        self.follow_idle = follow_idle
        self.policy = policy or RetryPolicy()
        self._pool = RESTClientObject(connection.configuration).pool_manager
        self._host = connection.configuration.host.rstrip("/")
        self._agent = f"jobspec/{__version__}"

    def close(self) -> None:
        self._pool.clear()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the boundary -------------------------------------------------------------------------

    def _auth_headers(self) -> dict[str, str]:
        # auth_settings() refreshes expiring tokens (exec plugins, OIDC) before handing them out.
        settings = self.connection.configuration.auth_settings().values()
        return {s["key"]: s["value"] for s in settings if s.get("in") == "header" and s.get("value")}

    def _send(
        self,
        op: Op,
        method: str,
        path: str,
        *,
        query: Query = (),
        body: dict[str, Any] | None = None,
        content_type: str | None = None,
        accept: str = "application/json",
        stream: bool = False,
        read_timeout: float | None = None,
    ) -> Any:
        """One request under the retry policy. Returns the body (bytes), or the open urllib3
        response when `stream` is set. Raises only ClusterError subclasses."""
        import urllib3

        timeout = urllib3.Timeout(connect=min(10.0, self.timeout), read=read_timeout or self.timeout)
        url = self._host + path + (f"?{urlencode(list(query))}" if query else "")
        data = json.dumps(body).encode() if body is not None else None

        def attempt() -> Any:
            headers = {"Accept": accept, "User-Agent": self._agent, **self._auth_headers()}
            if content_type:
                headers["Content-Type"] = content_type
            resp = self._pool.request(
                method,
                url,
                body=data,
                headers=headers,
                timeout=timeout,
                retries=False,
                redirect=False,
                preload_content=False,
            )
            if not 200 <= resp.status <= 299:
                raw = resp.read()
                resp.release_conn()
                raise HttpStatus(resp.status, resp.reason or "", raw, dict(resp.headers))
            log.debug("%s %s -> %s", method, path, resp.status)
            if stream:
                return resp
            raw = resp.read()
            resp.release_conn()
            return raw

        try:
            return retry.call(attempt, self.policy, op)
        except retry.Exhausted as ex:
            raise self._translate(ex.last, op, ex.attempts) from ex.last
        except (HttpStatus, *retry.TRANSIENT_ERRORS) as ex:
            raise self._translate(ex, op, 1) from ex
        except urllib3.exceptions.HTTPError as ex:  # TLS failures and the like: retrying cannot help
            reason = redact(str(getattr(ex, "reason", None) or ex).splitlines()[0], token_like=True)
            raise Unreachable(f"cannot {op.describe()}: failure talking to {self.connection.server}: {reason}") from ex

    def _translate(self, exc: BaseException, op: Op, attempts: int) -> ClusterError:
        if isinstance(exc, HttpStatus):
            return error_for_status(exc.status, exc.reason, exc.body, op, attempts)
        tried = f" (gave up after {attempts} attempts)" if attempts > 1 else ""
        import urllib3

        timed_out = isinstance(exc, (urllib3.exceptions.TimeoutError, TimeoutError))
        if timed_out and not isinstance(exc, urllib3.exceptions.NewConnectionError):  # a subclass, oddly
            return ApiTimeout(
                f"no answer from the Kubernetes API at {self.connection.server} within "
                f"{self.timeout:g} s to {op.describe()}{tried}; raise --request-timeout if the server is slow"
            )
        ctx = f", context {self.connection.context}" if self.connection.context else ""
        return Unreachable(
            f"cannot reach the Kubernetes API at {self.connection.server} ({self.connection.source}{ctx}) "
            f"to {op.describe()}: {_transport_reason(exc)}{tried}"
        )

    def _json(self, op: Op, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        raw = self._send(op, method, path, **kwargs)
        try:
            data = json.loads(raw)
        except ValueError:
            raise ClusterError(f"{op.describe()}: the API server answered with something that is not JSON") from None
        return data if isinstance(data, dict) else {}

    # -- operations ---------------------------------------------------------------------------

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        op = Op("get", kind.plural, kind.group, namespace, name)
        return self._json(op, "GET", kind.object_path(namespace, name))

    def find(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.get(kind, namespace, name)
        except NotFound:
            return None

    def list(
        self, kind: Kind, namespace: str | None, selector: str | None = None, *, page_size: int = 500
    ) -> list[dict[str, Any]]:
        """Every object of `kind` matching the label selector (namespace None: all namespaces)."""
        op = Op("list", kind.plural, kind.group, namespace)
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            query = [("limit", str(page_size))]
            if selector:
                query.append(("labelSelector", selector))
            if token:
                query.append(("continue", token))
            page = self._json(op, "GET", kind.collection_path(namespace), query=query)
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return items

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False, force: bool = False) -> dict[str, Any]:
        """Server-side apply (creates or updates); `dry_run` sends dryRun=All."""
        kind = kind_of(obj)
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        query = [("fieldManager", FIELD_MANAGER)]
        if force:
            query.append(("force", "true"))
        if dry_run:
            query.append(("dryRun", "All"))
        op = Op("patch", kind.plural, kind.group, ns, name)
        path = kind.object_path(ns, name)
        return self._json(op, "PATCH", path, query=query, body=obj, content_type=APPLY_PATCH)

    def delete(
        self, kind: Kind, namespace: str, name: str, *, propagation: str = "Background", dry_run: bool = False
    ) -> bool:
        """Delete one object (its dependents go by `propagation`); False when it was already gone."""
        query = [("propagationPolicy", propagation)]
        if dry_run:
            query.append(("dryRun", "All"))
        op = Op("delete", kind.plural, kind.group, namespace, name)
        try:
            self._json(op, "DELETE", kind.object_path(namespace, name), query=query)
        except NotFound:
            return False
        return True

    def read_log(self, namespace: str, pod: str, *, container: str | None = None, previous: bool = False) -> bytes:
        query = _log_query(container, previous=previous)
        op = Op("get", "pods/log", "", namespace, pod)
        return self._send(op, "GET", POD.object_path(namespace, pod) + "/log", query=query, accept="*/*")

    def log_chunks(
        self, namespace: str, pod: str, *, container: str | None = None, since_time: str | None = None
    ) -> Iterator[bytes]:
        """Follow a container's log with timestamps. Ends when the server closes the stream (the
        container ended) or the connection breaks or stays quiet for `follow_idle` seconds; the
        caller tells these apart by looking at the pod."""
        import urllib3

        query = [*_log_query(container), ("follow", "true"), ("timestamps", "true")]
        if since_time:
            query.append(("sinceTime", since_time))
        op = Op("get", "pods/log", "", namespace, pod)
        path = POD.object_path(namespace, pod) + "/log"
        resp = self._send(op, "GET", path, query=query, accept="*/*", stream=True, read_timeout=self.follow_idle)
        try:
            yield from resp.stream(8192, decode_content=True)
        except (urllib3.exceptions.HTTPError, OSError) as err:
            log.debug("log stream of pod %s ended: %s", pod, _transport_reason(err))
        finally:
            resp.release_conn()


def _log_query(container: str | None, *, previous: bool = False) -> list[tuple[str, str]]:
    query = []
    if container:
        query.append(("container", container))
    if previous:
        query.append(("previous", "true"))
    return query


def _transport_reason(exc: BaseException) -> str:
    """'connection refused', 'connection reset by peer': the innermost OS error, lower-cased."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        err = todo.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.strerror:
            return err.strerror[0].lower() + err.strerror[1:]
        todo += [getattr(err, "reason", None), err.__cause__, err.__context__]
        todo += [a for a in getattr(err, "args", ()) if isinstance(a, BaseException)]
    return type(exc).__name__
