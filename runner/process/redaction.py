"""Nothing from the runner's environment that looks like a secret reaches a log line, a traceback or the
termination message: the values of the variables a Secret fills (HF_TOKEN, WANDB_API_KEY, anything under a
secret-like name or shaped like a credential, debug variables included) and every credential shape
(jobspec.spec.credentials) are replaced by `<redacted>`.

`install` puts a scrubbing formatter on the root logger's handlers and the excepthook; the supervisor and
each worker call it once they have configured logging. A library that writes to stderr itself (not through
`logging`) is out of its reach.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Mapping
from types import TracebackType

from jobspec.spec.credentials import scrub, secret_values


class ScrubbingFormatter(logging.Formatter):
    """Formats with `inner`, then scrubs the whole text: message, arguments and traceback."""

    def __init__(self, inner: logging.Formatter | None, secrets: list[str]) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return scrub(self.inner.format(record), self.secrets)


def install(environ: Mapping[str, str] | None = None) -> None:
    """Scrub every log record and uncaught traceback of this process of the environment's secrets."""
    secrets = secret_values(os.environ if environ is None else environ)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, ScrubbingFormatter):
            handler.setFormatter(ScrubbingFormatter(handler.formatter, secrets))

    def excepthook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        sys.stderr.write(scrub("".join(traceback.format_exception(kind, err, tb)), secrets))

    sys.excepthook = excepthook


def scrubbed(text: str, *, token_like: bool = False) -> str:
    """`text` without the environment's secrets or any credential shape: for the termination message and the
    status the workers hand the supervisor."""
    return scrub(text, secret_values(os.environ), token_like=token_like)
