"""A Hugging Face hub on 127.0.0.1 serving repositories from local directories, for `HF_ENDPOINT`.

It answers the few endpoints huggingface_hub's `model_info` and `snapshot_download` use: repo info
(`GET /api/models/{repo}/revision/{rev}`), the file tree (`GET /api/models/{repo}/tree/{rev}`), and files
(`HEAD`/`GET /{repo}/resolve/{rev}/{file}`, with the X-Repo-Commit, ETag and Content-Length headers the
client reads), with the hub's error codes (X-Error-Code RepoNotFound, RevisionNotFound, GatedRepo) and
bearer-token checks for gated repositories. Every request is recorded, so a test counts the downloads.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from tests.cluster.fake_http import Served


class FakeHub(Served):  # start(), stop(), url
    def __init__(self, repos: dict[str, Path], gated: dict[str, str] | None = None) -> None:
        self.repos = repos  # id -> directory whose files are the repository (one commit)
        self.gated = gated or {}  # id -> the token that may read it
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.lock = threading.Lock()

    def commit(self, repo: str) -> str:
        h = hashlib.sha1()
        for path in sorted(self.files(repo)):
            h.update(path.encode() + (self.repos[repo] / path).read_bytes())
        return h.hexdigest()

    def files(self, repo: str) -> list[str]:
        root = self.repos[repo]
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def file_gets(self) -> Counter[str]:
        """How many times each file was downloaded (GET of a resolve URL)."""
        with self.lock:
            return Counter(p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests
                           if m == "GET" and "/resolve/" in p)  # fmt: skip


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        hub, path = self.fake, unquote(urlsplit(self.path).path)
        with hub.lock:
            hub.requests.append((self.command, path))
        if path.startswith("/api/models/"):
            repo, _, rest = _split_repo(path.removeprefix("/api/models/"))
            kind, _, rev = rest.partition("/")
            if (problem := self._refused(repo, rev.split("/", 1)[0])) is not None:
                return self._error(*problem)
            if kind == "revision":
                sha = hub.commit(repo)
                info = {"id": repo, "modelId": repo, "sha": sha, "private": False,
                        "siblings": [{"rfilename": f} for f in hub.files(repo)]}  # fmt: skip
                return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
            if kind == "tree":
                entries = [{"type": "file", "path": f, "size": (hub.repos[repo] / f).stat().st_size,
                            "oid": hashlib.sha1((hub.repos[repo] / f).read_bytes()).hexdigest()}
                           for f in hub.files(repo)]  # fmt: skip
                return self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body)
            return self._error(404, "EntryNotFound")
        repo, _, rest = _split_repo(path.lstrip("/"))
        if "/" not in rest or not rest.startswith("resolve/"):
            return self._error(404, "EntryNotFound")
        rev, _, name = rest.removeprefix("resolve/").partition("/")
        if (problem := self._refused(repo, rev)) is not None:
            return self._error(*problem)
        file = hub.repos[repo] / name
        if name not in hub.files(repo):
            return self._error(404, "EntryNotFound")
        data = file.read_bytes()
        headers = {"X-Repo-Commit": hub.commit(repo), "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Type": "application/octet-stream"}  # fmt: skip
        self._send(200, data, headers, body)

    def _refused(self, repo: str, rev: str) -> tuple[int, str] | None:
        hub = self.fake
        if repo not in hub.repos:
            return 404, "RepoNotFound"
        if repo in hub.gated and self.headers.get("Authorization") != f"Bearer {hub.gated[repo]}":
            return 403, "GatedRepo"
        if rev not in ("main", hub.commit(repo)):
            return 404, "RevisionNotFound"
        return None

    def _error(self, status: int, code: str) -> None:
        self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code}, True)

    def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(data)


def _split_repo(path: str) -> tuple[str, str, str]:
    """'org/name/rest...' -> ('org/name', '/', 'rest...')."""
    org, _, rest = path.partition("/")
    name, sep, rest = rest.partition("/")
    return f"{org}/{name}", sep, rest


FakeHub.handler = _Handler  # defined after the hub it answers for
