"""The request lines a loopback test server logs (moto's S3 server, the GCS emulator), kept for tests to count.

`RequestLog.listen(name)` attaches the log to the server's logger (one INFO line a request) without printing them;
`count` and `matching` read what was sent.
"""

from __future__ import annotations

import logging
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class RequestLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(_ANSI.sub("", record.getMessage()))

    def listen(self, logger_name: str) -> None:
        """Keep every INFO line of `logger_name` here, never printed (idempotent)."""
        server_log = logging.getLogger(logger_name)
        server_log.setLevel(logging.INFO)
        server_log.propagate = False
        if self not in server_log.handlers:
            server_log.addHandler(self)

    def matching(self, pattern: str) -> list[str]:
        return [line for line in self.lines if re.search(pattern, line)]

    def count(self, method: str, path: str) -> int:
        """Requests `METHOD /path` (the path without its query) logged so far."""
        return len(self.matching(rf'"{method} {re.escape(path)}(\?[^ ]*)? HTTP'))
