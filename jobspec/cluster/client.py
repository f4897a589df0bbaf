"""A thin Kubernetes API client working in plain dicts.

This is the boundary: the only module that sees urllib3's exceptions. From the kubernetes
library it takes the configuration (kubeconfig, in-cluster) and the connection pool built
from it; requests and JSON are handled here, in dicts.
Each request runs under the retry policy, with a bounded timeout, and every failure leaves
here as a `ClusterError` subclass (errors.py) naming the operation.

The server is not trusted to be well-behaved. Each attempt gets the request timeout for its whole
answer (connect, headers, body: a server that drips bytes defeats a socket's per-read timeout, not
this), a call with its retries gets the policy's budget, and a body is read only up to a bound:
MAX_ERROR_BODY of an error (the Status message is at its start), MAX_BODY of an answer, MAX_LOG_BYTES
of a log. Messages quote at most a short, scrubbed excerpt of what the server said, never a credential.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlencode

from jobspec.cluster import answers, retry
from jobspec.cluster.errors import ApiTimeout, NotFound, Op, Unreachable, error_for_status, gave_up
from jobspec.cluster.kubeconfig import Connection
from jobspec.cluster.resources import POD, Kind, kind_of
from jobspec.cluster.retry import HttpStatus, RetryPolicy
from jobspec.errors import ClusterError
from jobspec.spec.credentials import REDACTED, redact
from jobspec.untrusted import json_loads

log = logging.getLogger(__name__)
T = TypeVar("T")

FIELD_MANAGER = "jobspec"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply; the JSON body is valid YAML
DEFAULT_TIMEOUT = 30.0  # seconds per request (read); connecting gets at most 10 s
FOLLOW_IDLE = 60.0  # a followed log quiet this long is re-opened (see logs.py)
MiB = 1024**2
MAX_ERROR_BODY = 64 * 1024  # an error's Status is a few hundred bytes; the rest is not read
MAX_BODY = 32 * MiB  # a page of 500 objects is a few MB (etcd keeps an object under 1.5 MiB)
MAX_LOG_BYTES = 64 * MiB  # `jobspec logs` without -f; with -f the log streams and is never held
CHUNK = 64 * 1024
MAX_LIST_ITEMS = 100_000  # objects one list gathers: a server that pages without end is stopped here

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
        # A call's budget covers at least one full request timeout (a raised --request-timeout gets its attempt).
        self.budget = max(self.policy.budget, timeout)

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

    def _secrets(self) -> list[str]:
        """The credentials this client sends (a server or proxy may echo them back): never in a message."""
        values = self._auth_headers().values()
        return [part for v in values for part in (v, v.split(" ", 1)[-1]) if len(part) >= 6]

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
        limit: int = MAX_BODY,
        cut: bool = False,
    ) -> Any:
        """One request under the retry policy. Returns the body (bytes, at most `limit`: a longer one is an
        error, or with `cut` its first `limit` bytes), or the open urllib3 response when `stream` is set (its
        headers within the timeout; the caller reads the body). Raises only ClusterError subclasses."""
        import urllib3

        url = self._host + path + (f"?{urlencode(list(query))}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        clock, ends = self.policy.clock, self.policy.clock() + self.budget

        def attempt() -> Any:
            seconds = max(min(self.timeout, ends - clock()), 0.001)  # this attempt's share of the budget
            timeout = urllib3.Timeout(connect=min(10.0, seconds), read=read_timeout or seconds)
            headers = {"Accept": accept, "User-Agent": self._agent, **self._auth_headers()}
            if content_type:
                headers["Content-Type"] = content_type
            deadline = time.monotonic() + seconds

            def exchange() -> Any:
                resp = self._pool.request(method, url, body=data, headers=headers, timeout=timeout, retries=False,
                                          redirect=False, preload_content=False)  # fmt: skip
                if not 200 <= resp.status <= 299:
                    raw, _ = _read_body(resp, MAX_ERROR_BODY, deadline)
                    reason = redact(resp.reason or "", token_like=True)[:80]
                    raise HttpStatus(resp.status, reason, bytes(raw), dict(resp.headers))
                log.debug("%s %s -> %s", method, path, resp.status)
                if stream:
                    return resp
                if not cut and _declared_size(resp) > limit:  # announced too large: not read at all
                    resp.close()
                    resp.release_conn()
                    more = True
                else:
                    raw, more = _read_body(resp, limit, deadline)
                if more and not cut:
                    raise TooLarge(f"{op.describe()}: the API server's answer is larger than {limit // MiB} MiB; "
                                   "that is no Kubernetes object or page of them")  # fmt: skip
                return raw

            return _within(seconds, exchange, on_late=_close_response)

        try:
            return retry.call(attempt, self.policy, op, budget=self.budget)
        except retry.Exhausted as ex:
            raise self._translate(ex.last, op, ex.attempts, ex.spent) from ex.last
        except (HttpStatus, *retry.TRANSIENT_ERRORS) as ex:
            raise self._translate(ex, op, 1) from ex
        except TooLarge as ex:
            raise ClusterError(str(ex)) from None
        except urllib3.exceptions.HTTPError as ex:  # TLS failures and the like: retrying cannot help
            reason = redact(str(getattr(ex, "reason", None) or ex).splitlines()[0], token_like=True)[:300]
            raise Unreachable(f"cannot {op.describe()}: failure talking to {self.connection.server}: {reason}") from ex

    def _translate(self, exc: BaseException, op: Op, attempts: int, spent: float | None = None) -> ClusterError:
        """The ClusterError for a failed call, its message scrubbed of the credentials this client sends."""
        err = self._error_for(exc, op, attempts, spent)
        text = str(err)
        for secret in self._secrets():  # the shapes are redacted already; these are the values themselves
            text = text.replace(secret, REDACTED)
        err.args = (text,)
        return err

    def _error_for(self, exc: BaseException, op: Op, attempts: int, spent: float | None) -> ClusterError:
        if isinstance(exc, HttpStatus):
            return error_for_status(exc.status, exc.reason, exc.body, op, attempts, spent)
        tried = gave_up(attempts, spent)
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
            data = json_loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than any object
            raise ClusterError(f"{op.describe()}: the API server answered with something that is not JSON") from None
        return data if isinstance(data, dict) else {}

    # -- operations ---------------------------------------------------------------------------

    def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any]:
        op = Op("get", kind.plural, kind.group, namespace, name)
        answer = self._json(op, "GET", kind.object_path(namespace, name))
        return answers.object_answer(kind.plural, answer, namespace, name)

    def find(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.get(kind, namespace, name)
        except NotFound:
            return None

    def list(
        self,
        kind: Kind,
        namespace: str | None,
        selector: str | None = None,
        *,
        page_size: int = 500,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """Every object of `kind` matching the label (and field) selector (namespace None: all namespaces)."""
        op = Op("list", kind.plural, kind.group, namespace)
        items: list[dict[str, Any]] = []
        token, seen = "", set()
        while True:
            query = [("limit", str(page_size))]
            if selector:
                query.append(("labelSelector", selector))
            if field_selector:
                query.append(("fieldSelector", field_selector))
            if token:
                query.append(("continue", token))
            page = self._json(op, "GET", kind.collection_path(namespace), query=query)
            where = f"{kind.plural} in namespace {namespace}" if namespace else f"{kind.plural} (all namespaces)"
            items += answers.list_items(kind.plural, page.get("items"), where)
            md = page.get("metadata")
            token = (md.get("continue") if isinstance(md, dict) else None) or ""
            if not token and len(items) <= MAX_LIST_ITEMS:
                return items
            if not isinstance(token, str) or token in seen or len(items) > MAX_LIST_ITEMS:
                raise ClusterError(
                    f"{op.describe()}: the API server keeps paging (a continue token again, or more than "
                    f"{MAX_LIST_ITEMS:,} objects); narrow the namespace or check the server"
                )
            seen.add(token)

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
        """The container's log, at most MAX_LOG_BYTES + 1 bytes of it (more than MAX_LOG_BYTES: it was cut)."""
        query = _log_query(container, previous=previous)
        op = Op("get", "pods/log", "", namespace, pod)
        path = POD.object_path(namespace, pod) + "/log"
        return bytes(self._send(op, "GET", path, query=query, accept="*/*", limit=MAX_LOG_BYTES + 1, cut=True))

    def read_log_tail(
        self, namespace: str, pod: str, *, container: str | None = None, lines: int = 200, limit_bytes: int = 256 * 1024
    ) -> bytes:
        """The last `lines` lines of a container's log, at most `limit_bytes` of them (the server cuts there, and
        so does this client): a bounded read for the progress line (progress.py)."""
        query = [*_log_query(container), ("tailLines", str(lines)), ("limitBytes", str(limit_bytes))]
        op = Op("get", "pods/log", "", namespace, pod)
        path = POD.object_path(namespace, pod) + "/log"
        return bytes(self._send(op, "GET", path, query=query, accept="*/*", limit=limit_bytes, cut=True))

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


class TooLarge(Exception):
    """An answer past its size bound: not retried (the next one would be as large)."""


class _Late(TimeoutError):
    """The answer did not complete within the attempt's time: retried like a read timeout."""


def _read_body(resp: Any, limit: int, deadline: float) -> tuple[bytearray, bool]:
    """(at most `limit` bytes of the body, whether there was more). Reading stops at `limit` or past `deadline`
    (then _Late); a body left unread closes the connection rather than go back to the pool half-read."""
    read = getattr(resp, "read1", None) or resp.read  # read1: what has arrived, so a dripped body ends on time
    raw, complete = bytearray(), False
    try:
        while len(raw) <= limit:
            chunk = read(CHUNK)
            if not chunk:
                complete = True
                return raw, False
            raw += chunk
            if time.monotonic() > deadline:
                raise _Late("the answer did not complete in time")
        del raw[limit:]
        return raw, True
    finally:
        if not complete:
            resp.close()
        resp.release_conn()


def _declared_size(resp: Any) -> int:
    """The Content-Length the server announced, 0 when it did not (a chunked answer)."""
    value = resp.headers.get("Content-Length", "")
    return int(value) if value.isdigit() and len(value) < 20 else 0


def _within(seconds: float, fn: Callable[[], T], *, on_late: Callable[[Any], None]) -> T:
    """fn() given at most `seconds`: run in a daemon thread, so that a server dripping its headers or body a
    byte at a time (each read within the socket timeout) cannot hold the call past its time. A late fn is left
    to end on its own (its reads are bounded too); `on_late` gets its result when it does."""
    box: list[tuple[bool, Any]] = []
    lock = threading.Lock()
    late = False

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn())
        except BaseException as err:  # handed to the caller's thread as it is
            outcome = (False, err)
        with lock:
            box.append(outcome)
            if late and outcome[0]:
                on_late(outcome[1])

    worker = threading.Thread(target=run, name="jobspec-api-request", daemon=True)
    worker.start()
    worker.join(seconds)
    with lock:
        if not box:
            late = True
            raise _Late(f"no complete answer within {seconds:g} s")
    ok, value = box[0]
    if ok:
        return value
    raise value


def _close_response(result: Any) -> None:
    """A streamed response nobody waits for any more: give its connection up."""
    if hasattr(result, "release_conn"):
        result.close()
        result.release_conn()


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
