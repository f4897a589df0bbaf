"""A GCS JSON API emulator on loopback (gcp-storage-emulator, in memory) for the gs:// tests, and its requests.

`serve(bucket)` starts it on 127.0.0.1 (a free port), points STORAGE_EMULATOR_HOST of this process (and so of the
runner processes a test starts: gcsfs then goes anonymous, as Google's own client does) at it, creates `bucket` and
yields a gcsfs filesystem on it; on exit the server stops and the variable is put back. `requests` holds every request
line the server logged ('"GET /storage/v1/b/bkt/o/key?alt=media&generation=1 HTTP/1.1" 206'): what a test reads to
see which conditions and pins were sent.

What the emulator does not do that GCS does (seen in its handlers/objects.py, 2026.7.19): it ignores every
precondition (`ifGenerationMatch`, on uploads and deletes: a create with ifGenerationMatch=0 over an object replaces
it, a write with a stale generation succeeds), and it serves the current object whatever `generation=` a read pins
(GCS serves that generation, or 404 once it is gone). The tests therefore check that the requests carry the
conditions and pins, and that the runner's detection of a store that ignores them works (the lease's second exclusive
create; the data download's listing after the download).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from tests.runner.request_log import RequestLog

requests = RequestLog()


@contextlib.contextmanager
def serve(bucket: str) -> Iterator[Any]:
    from gcp_storage_emulator.server import create_server
    from gcsfs.core import GCSFileSystem

    requests.listen("gcp_storage_emulator.server")  # one INFO line per request: kept, never printed
    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
    server.start()
    host, port = server._api._httpd.server_address  # port 0: the one the OS chose
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://{host}:{port}"
    try:
        yield GCSFileSystem(token="anon", skip_instance_cache=True, use_listings_cache=False)
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved
