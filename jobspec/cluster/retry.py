"""Retry policy at the API boundary: what is retried, how long to wait, and when to stop.

Retried: 429 (waiting at least the server's Retry-After), 5xx except 501, and transport
failures (refused, reset, timed out). Never retried: every other 4xx, TLS errors.
Every request jobspec sends is safe to repeat: reads, server-side apply, deletes.
Stops after `attempts` tries, or before a wait that would end past `budget` seconds from the
first try (a broken server that answers slowly, or not at all, costs one budget, not five timeouts).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import tenacity
import urllib3

from jobspec.cluster.errors import Op

log = logging.getLogger(__name__)
T = TypeVar("T")

# Transport failures worth another try. Requests go out with urllib3's own retries off
# (client.py), so these arrive unwrapped.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    urllib3.exceptions.ProtocolError,  # connection reset or closed mid-answer
    urllib3.exceptions.NewConnectionError,  # refused, DNS
    urllib3.exceptions.TimeoutError,  # connect or read timeout
    urllib3.exceptions.MaxRetryError,
    ConnectionError,
    TimeoutError,
)


class HttpStatus(Exception):
    """An error answer, raised inside the retry loop and mapped to an ApiError after it."""

    def __init__(self, status: int, reason: str, body: bytes, headers: dict[str, str]) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body
        self.headers = headers


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter; `sleep` is injectable so tests do not wait."""

    attempts: int = 5  # total tries, the first included
    initial: float = 0.5  # seconds before the 2nd try; doubles each time
    max_wait: float = 8.0  # backoff cap, seconds
    jitter: float = 0.5  # up to this many seconds added at random
    max_retry_after: float = 30.0  # a longer Retry-After is cut to this
    budget: float = 60.0  # seconds for one call, every attempt and wait included (at least one request timeout)
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)  # tests pass one that sleep advances

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based), jitter included."""
        return min(self.max_wait, self.initial * 2 ** (attempt - 1)) + random.uniform(0, self.jitter)

    def wait_for(self, exc: BaseException | None, attempt: int) -> float:
        backoff = self.backoff(attempt)
        after = retry_after(exc)
        if after is None:
            return backoff
        return min(max(after, backoff), self.max_retry_after)


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, HttpStatus):
        return exc.status == 429 or (500 <= exc.status <= 599 and exc.status != 501)
    return isinstance(exc, TRANSIENT_ERRORS)


def retry_after(exc: BaseException | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP-date), None when absent or unreadable."""
    if not isinstance(exc, HttpStatus):
        return None
    raw = next((v for k, v in exc.headers.items() if k.lower() == "retry-after"), None)
    if raw is None:
        return None
    raw = raw.strip()
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def _why(exc: BaseException | None) -> str:
    if isinstance(exc, HttpStatus):
        return f"{exc.status} {exc.reason}"  # the reason is cut and scrubbed where HttpStatus is made
    for err in (exc, getattr(exc, "reason", None), *getattr(exc, "args", ())):
        if isinstance(err, OSError) and err.strerror:
            return err.strerror.lower()
    return type(exc).__name__ if exc is not None else "?"


class Exhausted(Exception):
    """Raised by `call` when every attempt failed; carries the last failure, the count, and the seconds
    spent when the budget (not the count) ended the tries."""

    def __init__(self, last: BaseException, attempts: int, spent: float | None = None) -> None:
        super().__init__(str(last))
        self.last = last
        self.attempts = attempts
        self.spent = spent


def call(fn: Callable[[], T], policy: RetryPolicy, op: Op, *, budget: float | None = None) -> T:
    """Run `fn` under `policy` (`budget` overrides the policy's). A non-retryable failure propagates as it is;
    when retries run out, `Exhausted` wraps the last failure so the caller can say how often it tried."""
    budget = policy.budget if budget is None else budget
    start = policy.clock()
    planned: dict[int, float] = {}  # attempt -> the wait after it: drawn once (jitter), read by stop and wait

    def wait(state: tenacity.RetryCallState) -> float:
        if state.attempt_number not in planned:
            exc = state.outcome.exception() if state.outcome else None
            planned[state.attempt_number] = policy.wait_for(exc, state.attempt_number)
        return planned[state.attempt_number]

    def out_of_time(state: tenacity.RetryCallState) -> bool:
        return policy.clock() - start + wait(state) > budget

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        log.warning(
            "%s: %s; retrying in %.1f s (attempt %d of %d)",
            op.describe(),
            _why(exc),
            delay,
            state.attempt_number + 1,
            policy.attempts,
        )

    retrying = tenacity.Retrying(
        stop=tenacity.stop_any(tenacity.stop_after_attempt(policy.attempts), out_of_time),
        wait=wait,
        retry=tenacity.retry_if_exception(is_retryable),
        sleep=policy.sleep,
        before_sleep=before_sleep,
        reraise=False,
    )
    try:
        return retrying(fn)
    except tenacity.RetryError as err:
        last: Any = err.last_attempt.exception()
        tries = err.last_attempt.attempt_number
        spent = policy.clock() - start if tries < policy.attempts else None
        raise Exhausted(last, tries, spent) from last
