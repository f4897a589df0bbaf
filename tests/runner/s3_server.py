"""An S3 API server on loopback (moto's ThreadedMotoServer) for the object-store tests, and a count of its requests.

`serve(bucket)` starts it on 127.0.0.1 (a free port), points the AWS_* variables of this process (and so of the
runner processes a test starts) at it, creates `bucket` and yields a boto3 client; on exit the server stops and the
variables are put back. `requests` holds every request line the server logged ("GET /bucket/key HTTP/1.1" 206):
what a test counts to tell a download from a cache hit.
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
    import boto3
    from moto.server import ThreadedMotoServer

    requests.listen("werkzeug")  # one INFO line per request: kept, never printed
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket=bucket)
        yield client
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
