"""Cluster error types, and the one place an HTTP failure becomes one of them.

Every message names what was being done (verb, resource, namespace, object) in the
words `kubectl auth can-i` uses, so a refused request can be checked and granted.
Messages carry the server's own explanation but never a header or a credential.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from jobspec.errors import ClusterError
from jobspec.spec.credentials import redact
from jobspec.untrusted import json_loads


@dataclass(frozen=True)
class Op:
    """One API operation, in RBAC terms: `patch jobs.batch "x" in namespace "ml"`."""

    verb: str  # get, list, create, patch, delete
    resource: str  # plural, e.g. "jobs", "pods/log"
    group: str = ""  # "" for the core group, "batch" for jobs
    namespace: str | None = None  # None: all namespaces
    name: str | None = None

    @property
    def qualified(self) -> str:
        """`jobs.batch`, `configmaps`: the form RBAC and `kubectl auth can-i` use."""
        base, _, sub = self.resource.partition("/")
        full = f"{base}.{self.group}" if self.group else base
        return f"{full}/{sub}" if sub else full

    @property
    def where(self) -> str:
        if self.namespace:
            return f'in namespace "{self.namespace}"'
        return "(cluster-scoped)" if self.name else "across all namespaces"

    def describe(self) -> str:
        target = f' "{self.name}"' if self.name else ""
        return f"{self.verb} {self.qualified}{target} {self.where}"

    def can_i(self) -> str:
        scope = f"-n {self.namespace}" if self.namespace else "--all-namespaces"
        return f"kubectl auth can-i {self.verb} {self.qualified} {scope}"


class ApiError(ClusterError):
    """The API server answered with an error status."""

    def __init__(self, message: str, *, status: int, op: Op) -> None:
        super().__init__(message)
        self.status = status
        self.op = op


class Unauthorized(ApiError):
    """401: the credentials were not accepted."""


class Forbidden(ApiError):
    """403: RBAC (or an admission policy) refused the request."""


class NotFound(ApiError):
    """404: the object (or its namespace) does not exist; `object_missing` False: the server has no such
    resource at all (a CRD not installed, e.g. Kueue's), told apart by the Status naming the object."""

    object_missing: bool = True


class Conflict(ApiError):
    """409: the object exists, changed under us, or its fields belong to another manager."""


class Rejected(ApiError):
    """400/422: the server refused the object itself."""


class ServerError(ApiError):
    """5xx or 429 that did not clear within the retry budget."""


class Unreachable(ClusterError):
    """No HTTP answer: connection refused or reset, DNS, TLS."""


class ApiTimeout(Unreachable):
    """The server did not answer within the request timeout."""


class SpecChanged(ClusterError):
    """A job of that name exists with a different spec, and --replace was not given."""


class NotManaged(ClusterError):
    """An object of that name exists but jobspec did not create it: never touched."""


class NotReady(ClusterError):
    """The pod asked for has not started (or does not exist yet)."""


MAX_MESSAGE_CHARS = 300  # of the server's words in one of ours: a message stays a line or two
MAX_BODY_CHARS = 64 * 1024  # of a body looked at (the client reads no more of an error's)


def gave_up(attempts: int, spent: float | None = None) -> str:
    """' (gave up after 3 attempts in 60 s)' for a message; '' after one attempt within the count."""
    if attempts <= 1 and spent is None:
        return ""
    tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
    return f" (gave up after {tries}{f' in {spent:.0f} s, the retry budget' if spent is not None else ''})"


def server_message(body: bytes | str | None) -> str:
    """The `message` of a Kubernetes Status body, or a short excerpt of whatever came back;
    scrubbed of bearer tokens and token-like strings (a proxy or webhook may echo a header).
    Only the body's first MAX_BODY_CHARS are looked at, and at most MAX_MESSAGE_CHARS are quoted."""
    if not body:
        return ""
    text = body[:MAX_BODY_CHARS]
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    try:
        status = json_loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than any Status
        return _excerpt(text)
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        return _excerpt(status["message"])
    return ""


def status_details(body: bytes | str | None) -> dict[str, Any]:
    """The `details` of a Kubernetes Status body ({} when there is none: a bare "404 page not found")."""
    try:
        status = json_loads((body or b"")[:MAX_BODY_CHARS])
    except (ValueError, RecursionError, TypeError):
        return {}
    details = status.get("details") if isinstance(status, dict) else None
    return details if isinstance(details, dict) else {}


def _excerpt(text: str) -> str:
    """Whitespace folded, credentials scrubbed (before the cut: a cut token is no longer recognised), cut."""
    folded = redact(" ".join(text.split()), token_like=True)
    return folded if len(folded) <= MAX_MESSAGE_CHARS else folded[: MAX_MESSAGE_CHARS - 3] + "..."


def error_for_status(
    status: int, reason: str, body: bytes | str | None, op: Op, attempts: int = 1, spent: float | None = None
) -> ApiError:
    """Map an HTTP error answer to the project's error type, with a message a user can act on."""
    said = server_message(body)
    detail = f": {said}" if said else ""
    reason = _excerpt(reason)[:80]
    tried = gave_up(attempts, spent)
    if status == 401:
        return Unauthorized(
            f"the API server did not accept the credentials (401 Unauthorized) for {op.describe()}; "
            "log in again or refresh the kubeconfig (e.g. your cloud's get-credentials command)",
            status=status,
            op=op,
        )
    if status == 403:
        # Server-side apply of a new object is authorised as "create": trust the server's verb.
        named = re.search(r'cannot (\w+) resource "', said)
        if named and named.group(1) != op.verb:
            op = replace(op, verb=named.group(1))
        return Forbidden(
            f"RBAC refused: cannot {op.describe()} (403 Forbidden{detail}). "
            f"Check with `{op.can_i()}`; the Role in k8s/ grants what jobspec needs",
            status=status,
            op=op,
        )
    if status == 404:
        if op.resource == "jobs" and op.name:
            msg = f'job "{op.name}" does not exist {op.where}'
        else:
            msg = f"not found: {op.describe()}{detail}"
        err = NotFound(msg, status=status, op=op)
        err.object_missing = op.name is not None and status_details(body).get("name") == op.name
        return err
    if status == 409:
        return Conflict(f"conflict: {op.describe()} (409{detail})", status=status, op=op)
    if status in (400, 422):
        return Rejected(f"the API server rejected: {op.describe()} ({status} {reason}{detail})", status=status, op=op)
    if status == 429 or status >= 500:
        return ServerError(
            f"the API server could not serve: {op.describe()} ({status} {reason}{detail}){tried}",
            status=status,
            op=op,
        )
    return ApiError(f"{op.describe()} failed: {status} {reason}{detail}", status=status, op=op)
