"""The HTTP side of the fake API server: request records, scripted faults, the handler."""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: Any
    created: bool = False  # a server-side apply that created the object (RBAC: create)


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    times: int = 1
    status: int = 500
    headers: dict[str, str] = field(default_factory=dict)
    message: str = "injected failure"
    reset: bool = False
    delay: float = 0.0
    # A broken server's answer instead of the Status: `body` (bytes as they are, anything else as JSON),
    # repeated up to `size` bytes when given (never held whole), without a Content-Length when `chunked`
    # (the body ends when the connection closes), a byte every `drip` seconds, or after headers that never
    # end (one line every `drip_headers` seconds).
    body: Any = None
    size: int = 0
    chunked: bool = False
    drip: float = 0.0
    drip_headers: float = 0.0
    sent: int = 0  # body bytes written, over every answer, before the client hung up (or all of them)


def status_body(code: int, message: str, reason: str = "") -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # resets and clients that hang up are part of the script


class Served:
    """A fake served on 127.0.0.1 from a thread: `start()` binds a subclass of `handler` whose `fake` is this
    object, `url` is where it answers, `stop()` ends it. Subclasses set `handler` (and `server` when they need
    another server class)."""

    handler: type[BaseHTTPRequestHandler]
    server: type[ThreadingHTTPServer] = ThreadingHTTPServer
    _server: ThreadingHTTPServer | None = None

    def start(self) -> Self:
        bound = type("Bound", (self.handler,), {"fake": self})
        self._server = self.server(("127.0.0.1", 0), bound)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    fake: Any  # the FakeApi answering (set by a subclass per server)
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else headers and body go 40 ms apart (delayed ACK)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _serve(self) -> None:
        split = urlsplit(self.path)
        path = unquote(split.path)
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        req = Request(self.command, path, query, {k.lower(): v for k, v in self.headers.items()}, body)
        with self.fake.lock:
            self.fake.requests.append(req)
        fault = self.fake.take_fault(self.command, path)
        if fault and fault.delay:
            time.sleep(fault.delay)
        if fault and fault.reset:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if fault and (fault.body is not None or fault.drip or fault.drip_headers):
            return self._broken(fault)
        if fault and not fault.delay:
            return self._send(fault.status, fault.headers, status_body(fault.status, fault.message))
        status, headers, payload = self.fake.handle(req)
        if isinstance(payload, list):
            return self._stream(payload)
        self._send(status, headers, payload)

    do_GET = do_PATCH = do_DELETE = do_POST = do_PUT = _serve

    def _send(self, status: int, headers: dict[str, str], payload: Any) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", headers.pop("Content-Type", "application/json"))
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _broken(self, fault: Fault) -> None:
        """An answer no well-behaved server sends: huge, endless, or a byte at a time."""
        self.close_connection = True
        body = fault.body if isinstance(fault.body, bytes) else json.dumps(fault.body).encode()
        size = fault.size or len(body)
        try:
            self.send_response(fault.status)
            for key, value in fault.headers.items():
                self.send_header(key, value)
            if fault.drip_headers:
                while True:
                    self.wfile.write(b"X-Slow: 1\r\n")
                    self.wfile.flush()
                    time.sleep(fault.drip_headers)
            if not fault.chunked:
                self.send_header("Content-Length", str(size))
            self.send_header("Connection", "close")
            self.end_headers()
            step = 1 if fault.drip else 1 << 20
            pattern = body * (step // max(len(body), 1) + 1)  # whole copies of the body, at least a step long
            sent = 0
            while sent < size:
                start = sent % len(pattern)
                part = pattern[start : start + min(step, size - sent)]
                self.wfile.write(part)
                sent += len(part)
                fault.sent += len(part)
                if fault.drip:
                    self.wfile.flush()
                    time.sleep(fault.drip)
        except OSError:  # the client hung up: what it asked for
            pass

    def _stream(self, script: list[Any]) -> None:
        """A follow: no Content-Length, the body ends when the connection closes."""
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for step in script:
            if isinstance(step, bytes):
                self.wfile.write(step)
                self.wfile.flush()
            elif isinstance(step, (int, float)):
                time.sleep(step)
            elif callable(step):
                step()
