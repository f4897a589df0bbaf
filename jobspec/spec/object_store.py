"""Object-store URLs in a spec: `checkpoints.dir: s3://bucket/prefix` and `data.path: s3://bucket/key` (or `gs://`).

`s3://` is any S3 API (AWS, MinIO, Ceph RGW, R2), reached through fsspec's s3fs (the `s3` extra) with the credentials
and endpoint of the standard AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION),
which a spec gives from a Secret (`env_from_secrets`, or `env: {NAME: {secret, key}}`), never inline. `gs://` is
Google Cloud Storage, reached through gcsfs (the `gcs` extra) with Google's application default credentials: a
service-account key mounted from a Secret (`gcs_credentials`, GOOGLE_APPLICATION_CREDENTIALS) or the pod's workload
identity. A URL holds no credentials: one with a user part (`s3://KEY:SECRET@bucket`) or a query is refused; other
schemes are refused with the way to use them.

With an object-store `checkpoints.dir` the run directory in the pod is local (`checkpoints.local_dir`, default
LOCAL_RUN_DIR on an emptyDir): checkpoints are staged there and published to the bucket
(runner/checkpoint/remote.py); metrics, tier state and the data cache stay there.

A data source (`data.path`, `data.sources[].path`, `data.eval_path`) may be one object, `s3://bucket/key` (or gs://)
with a data file suffix (DATA_SUFFIXES), or a prefix ending in '/' (`s3://bucket/dataset/`: a datasets save_to_disk
directory); the runner downloads it once per node into the data cache and reads the local copy
(runner/process/remote_data.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from jobspec.spec.hub import DATA_SUFFIXES

LOCAL_RUN_DIR = "/checkpoints"
SCHEMES = ("s3", "gs")
# The whole text, newlines included: `.` and `$` alone let "s3://b/x\ny" (or a trailing newline) pass for a path
_URL = re.compile(r"\A([a-z][a-z0-9+.-]*)://(.*)\Z", re.DOTALL)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# S3's bucket names: 3-63 lowercase letters, digits, '.', '-', starting and ending with a letter or digit; GCS's also
# take '_', and up to 222 characters when dotted (each dot-separated part at most 63)
_BUCKET = {"s3": re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
           "gs": re.compile(r"^[a-z0-9](?=[a-z0-9._-]{2,221}$)[a-z0-9._-]*[a-z0-9]$")}  # fmt: skip
_BUCKET_RULE = {"s3": "an S3 bucket name (3-63 lowercase letters, digits, '.', '-')",
                "gs": "a GCS bucket name (3-63 lowercase letters, digits, '.', '-', '_'; dotted: up to 222)"}
_CREDENTIALS = {"s3": "give them as AWS_* variables from a Secret (env_from_secrets), the endpoint as AWS_ENDPOINT_URL",
                "gs": "give a service-account key by Secret reference (gcs_credentials), or use workload identity"}
_KEY_PART = re.compile(r"^[A-Za-z0-9!_.*'()=+,:@ -]+$")  # S3's "safe" characters (no '%', '?', '#', '\\')


class ObjectUrl(NamedTuple):
    scheme: str
    bucket: str
    key: str  # no leading or trailing '/'; "" for the bucket's root

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    def join(self, *parts: str) -> str:
        """`bucket/key/part/...` as fsspec names it (no scheme)."""
        return "/".join(p for p in (self.bucket, self.key, *parts) if p)


def is_url(text: str | None) -> bool:
    """Whether `text` names a URL (`scheme://...`), not a path."""
    return bool(text) and _URL.match(text) is not None  # type: ignore[arg-type]


def control_problem(text: str) -> str | None:
    """Why `text` (a path or URL) is refused for a control character (a newline, a tab, NUL), or None."""
    m = _CONTROL.search(text)
    if m is None:
        return None
    return (f"holds a control character ({m.group()!r} at character {m.start() + 1}): no path or URL has one (a YAML "
            "block scalar, or an escape inside double quotes?); write it on one line without it")  # fmt: skip


def redacted(text: str) -> str:
    """`text` as an error message may show it: a URL's user part (`s3://KEY:SECRET@bucket`) replaced by `***`."""
    m = _URL.match(text)
    if m is None or "@" not in m.group(2).partition("/")[0]:
        return text[:300]
    bucket = m.group(2).partition("/")[0]
    return f"{m.group(1)}://***@{bucket.rpartition('@')[2]}{m.group(2)[len(bucket):]}"[:300]


def problem(text: str) -> str | None:
    """Why the URL `text` cannot be an object-store location, or None (a path is not this module's)."""
    m = _URL.match(text)
    if m is None:
        return None
    if why := control_problem(text):
        return why
    scheme, rest = m.groups()
    if scheme not in SCHEMES:
        return (f"{scheme}:// is not an object store jobspec reads: use s3://BUCKET/PREFIX (any S3 API) or "
                "gs://BUCKET/PREFIX (Google Cloud Storage)")  # fmt: skip
    if "?" in rest or "#" in rest:
        return f"an object-store URL takes no query or fragment: {scheme}://BUCKET/PREFIX"
    bucket, _, key = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        return f"an object-store URL holds no credentials or port: {_CREDENTIALS[scheme]}"
    if not _BUCKET[scheme].match(bucket) or ".." in bucket or any(len(p) > 63 for p in bucket.split(".")):
        return f"{bucket[:80]!r} is not {_BUCKET_RULE[scheme]}"
    parts = key.strip("/").split("/") if key.strip("/") else []
    if any(not p or p in (".", "..") or not _KEY_PART.match(p) for p in parts):
        return "the prefix after the bucket must be names of letters, digits and - _ . ! * ' ( ) = + , : @ (no '..')"
    return None


def data_problem(text: str) -> str | None:
    """Why the URL `text` cannot be a data source, or None (a path is not this module's): an object-store location
    (`problem`) naming one object with a data file suffix, or a prefix ending in '/' (a directory of files)."""
    scheme = text.split("://", 1)[0] if is_url(text) else ""
    if scheme == "hf":
        return "hf:// is not read as a URL: give the hub dataset id (org/name), or the file after downloading it"
    if scheme in ("http", "https"):
        return (f"{scheme}:// is not downloaded by the runner: copy the file into a bucket (s3:// or "
                "gs://BUCKET/KEY.jsonl) or onto a volume (data.pvc), or give a hub dataset id (org/name)")  # fmt: skip
    why = problem(text)
    if why or not is_url(text):
        return why
    key = text.split("://", 1)[1].partition("/")[2]
    if not key.strip("/"):
        return (f"names a bucket, not data: {scheme}://BUCKET/KEY.jsonl (one file), or {scheme}://BUCKET/PREFIX/ (a "
                "directory)")  # fmt: skip
    if not key.endswith("/") and not key.lower().endswith(DATA_SUFFIXES):
        return (f"an object's name must end in {', '.join(DATA_SUFFIXES)} (its format), or the URL in '/' for a "
                "directory of files (a datasets save_to_disk directory)")  # fmt: skip
    return None


def parse(text: str | None) -> ObjectUrl | None:
    """The object-store location `text` names, or None for a path. ValueError for a URL `problem` refuses (its
    message never repeats the URL, which may hold credentials: the caller names it with `redacted`)."""
    if not is_url(text):
        return None
    why = problem(text)  # type: ignore[arg-type]
    if why:
        raise ValueError(why)
    scheme, rest = _URL.match(text).groups()  # type: ignore[union-attr]
    bucket, _, key = rest.partition("/")
    return ObjectUrl(scheme, bucket, key.strip("/"))


def run_dir(checkpoints_dir: str, local_dir: str | None) -> str:
    """The run directory the runner writes to: `checkpoints.dir` itself, or for an object store `local_dir`
    (default LOCAL_RUN_DIR)."""
    if is_url(checkpoints_dir):
        return local_dir or LOCAL_RUN_DIR
    return checkpoints_dir
