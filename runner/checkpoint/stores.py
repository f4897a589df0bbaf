"""The object stores behind `s3://` and `gs://`: the few requests the checkpoints (remote.py) and the data download
(runner/process/remote_data.py) make, each with one meaning on both, through fsspec's s3fs and gcsfs.

An object's tag names the version that was read or written: S3's ETag, GCS's generation. A write may be conditional
on no object being there (`if_absent`: S3's `If-None-Match: *`, GCS's `ifGenerationMatch=0`) or on the tag read
(`if_tag`: `If-Match: <ETag>`, `ifGenerationMatch=<generation>`); a ranged read is pinned to the listed version
(`If-Match` and the VersionId; GCS: `generation=<generation>`, whose bytes are served or, once that generation is
gone, a 404). A condition that did not hold: put returns None, read_range raises Changed.

Errors, the same on both: FileNotFoundError (no such bucket or object), PermissionError (access denied); any other
exception, after the client's own retries, means the store did not answer or failed (callers: RemoteUnavailable).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

from jobspec.errors import ConfigError

_GET_TRIES = 3  # GCS: metadata then the bytes of that generation; replaced in between: read again


def brief(err: BaseException) -> str:
    """An object-store client's error in one line for a message: its type and first line, at most 300 characters."""
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]


class Changed(Exception):
    """The object is not the version a pinned read or a conditional request named any more."""


class Head(NamedTuple):
    size: int
    tag: str  # ETag (S3), generation (GCS)
    version: str | None = None  # S3's VersionId on a versioned bucket


class Store:
    """One object store's requests (module docstring). `fs` is the fsspec filesystem (its generic calls: put_file,
    open, exists, rm, find serve both)."""

    scheme = ""
    credentials = ""  # where the pod's credentials come from, for messages (never the credentials)
    endpoint = ""  # what names the endpoint
    read_rights = ""  # what reading a data set needs
    cli = ""  # the store's command line tool, for the fixes messages give
    create_condition = ""  # how a create says "only if there is none"
    tag_name = ""  # what the store calls the tag

    def __init__(self, fs: Any):
        self.fs = fs

    def check_bucket(self, bucket: str) -> None:
        raise NotImplementedError

    def put(self, bucket: str, key: str, data: bytes, *, if_absent: bool = False,
            if_tag: str | None = None) -> str | None:  # fmt: skip
        raise NotImplementedError

    def get(self, bucket: str, key: str, limit: int) -> tuple[bytes, str] | None:
        """(content, tag) read no further than `limit` bytes (ValueError beyond); None when there is no object."""
        raise NotImplementedError

    def head(self, bucket: str, key: str) -> Head:
        raise NotImplementedError

    def listing(self, bucket: str, prefix: str) -> Iterator[tuple[str, Head]]:
        """(key, head) of every object under `prefix`, page by page (the caller bounds how many it takes)."""
        raise NotImplementedError

    def read_range(self, bucket: str, key: str, start: int, end: int, pin: Head) -> bytes:
        """Bytes [start, end) of the version `pin` (Changed: that version is not there any more)."""
        raise NotImplementedError

    def delete(self, bucket: str, key: str, *, if_tag: str | None = None) -> None:
        """Remove the object (if it still has `if_tag`); one already gone, or changed, is left."""
        raise NotImplementedError

    def no_bucket(self, err: BaseException, bucket: str) -> bool:
        """Whether the client's error `err` says there is no bucket `bucket`."""
        raise NotImplementedError


def error_code(err: BaseException) -> str:
    """The S3 error code behind an s3fs error ("PreconditionFailed", "NoSuchKey", "412", ...), or ""."""
    for e in (err, err.__cause__, err.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            return str(error.get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode") or "")
    return ""


def _s3_conflict(err: BaseException) -> bool:
    """A conditional request S3 refused: the object changed (412), or a concurrent one won (409)."""
    return isinstance(err, FileExistsError) or error_code(err) in ("PreconditionFailed", "412",
                                                                   "ConditionalRequestConflict", "409")  # fmt: skip


def _s3_missing(err: BaseException) -> bool:
    return isinstance(err, FileNotFoundError) or error_code(err) in ("NoSuchKey", "404")


class S3(Store):
    scheme = "s3"
    credentials = "the AWS_* credentials the pod gets from its Secret (env_from_secrets)"
    endpoint = "AWS_ENDPOINT_URL, else AWS's"
    read_rights = "s3:GetObject, s3:ListBucket"
    cli = "aws s3"
    create_condition = "If-None-Match: *"
    tag_name = "ETag"

    def _read(self, body: Any, limit: int) -> bytes:
        from fsspec.asyn import sync

        try:
            return bytes(sync(self.fs.loop, body.read, limit))  # aiobotocore's stream: read on s3fs's event loop
        finally:
            body.close()

    def check_bucket(self, bucket: str) -> None:
        self.fs.call_s3("head_bucket", Bucket=bucket)

    def put(self, bucket: str, key: str, data: bytes, *, if_absent: bool = False,
            if_tag: str | None = None) -> str | None:  # fmt: skip
        cond: dict[str, str] = {"IfNoneMatch": "*"} if if_absent else {}
        if if_tag is not None:
            cond["IfMatch"] = if_tag
        try:
            out = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)
        except OSError as err:
            if cond and (_s3_conflict(err) or (if_tag is not None and _s3_missing(err))):
                return None
            raise
        return str(out.get("ETag", ""))

    def get(self, bucket: str, key: str, limit: int) -> tuple[bytes, str] | None:
        try:
            resp = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        if int(resp.get("ContentLength", 0)) > limit:
            resp["Body"].close()
            raise ValueError(f"has {int(resp['ContentLength']):,} bytes, more than it may have ({limit:,})")
        data = self._read(resp["Body"], limit + 1)
        if len(data) > limit:
            raise ValueError(f"has more than {limit:,} bytes")
        return data, str(resp.get("ETag", ""))

    def head(self, bucket: str, key: str) -> Head:
        out = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        return Head(int(out.get("ContentLength", 0)), str(out.get("ETag", "")), out.get("VersionId") or None)

    def listing(self, bucket: str, prefix: str) -> Iterator[tuple[str, Head]]:
        token = None
        while True:
            page = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix,
                                   **({"ContinuationToken": token} if token else {}))  # fmt: skip
            for item in page.get("Contents", []):
                yield str(item["Key"]), Head(int(item.get("Size", 0)), str(item.get("ETag", "")))
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def read_range(self, bucket: str, key: str, start: int, end: int, pin: Head) -> bytes:
        pinned = {"IfMatch": pin.tag, **({"VersionId": pin.version} if pin.version else {})}
        try:
            resp = self.fs.call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **pinned)
        except OSError as err:
            if error_code(err) in ("PreconditionFailed", "412"):
                raise Changed() from None
            raise
        return self._read(resp["Body"], end - start + 1)

    def delete(self, bucket: str, key: str, *, if_tag: str | None = None) -> None:
        kwargs = {"IfMatch": if_tag} if if_tag else {}
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, **kwargs)
        except OSError as err:
            if _s3_missing(err) or _s3_conflict(err):
                return
            if kwargs and error_code(err) in ("NotImplemented", "501", "InvalidArgument", "400"):
                self.delete(bucket, key)  # a store without conditional deletes
                return
            raise

    def no_bucket(self, err: BaseException, bucket: str) -> bool:
        return isinstance(err, FileNotFoundError) and error_code(err) == "NoSuchBucket"


class GCS(Store):
    """GCS's JSON API through gcsfs's request call (its retries and credentials)."""

    scheme = "gs"
    credentials = ("the service account the pod runs as: the key of gcs_credentials (a Secret), or the pod's "
                   "workload identity")  # fmt: skip
    endpoint = "STORAGE_EMULATOR_HOST, else storage.googleapis.com"
    read_rights = "storage.objects.get, storage.objects.list: roles/storage.objectViewer"
    cli = "gcloud storage"
    create_condition = "ifGenerationMatch=0"
    tag_name = "generation"

    def _call(self, method: str, path: str, *args: str, **kwargs: Any) -> Any:
        """One request; gcsfs's 403 (an OSError "Forbidden") as PermissionError, its other HTTP errors (HttpError,
        not an OSError) as OSError."""
        from gcsfs.retry import HttpError

        try:
            return self.fs.call(method, path, *args, **kwargs)
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as err:
            if str(err).startswith("Forbidden"):
                raise PermissionError(str(err).splitlines()[0]) from None
            raise
        except HttpError as err:
            raise OSError(f"HTTP {err.code}: {err.message}") from None

    def _meta(self, bucket: str, key: str) -> dict[str, Any]:
        return dict(self._call("GET", "b/{}/o/{}", bucket, key, json_out=True))

    def check_bucket(self, bucket: str) -> None:
        self._call("GET", "b/{}", bucket, json_out=True)

    def put(self, bucket: str, key: str, data: bytes, *, if_absent: bool = False,
            if_tag: str | None = None) -> str | None:  # fmt: skip
        cond = {"ifGenerationMatch": "0"} if if_absent else {}
        if if_tag is not None:
            cond["ifGenerationMatch"] = if_tag
        # multipart, as gcsfs's own small uploads: the emulator fails an empty `media` upload (DONE is empty)
        meta = json.dumps({"name": key}).encode()
        body = b"".join((b"--==0==\nContent-Type: application/json; charset=UTF-8\n\n", meta,
                         b"\n--==0==\nContent-Type: application/octet-stream\n\n", data, b"\n--==0==--"))  # fmt: skip
        try:
            upload = self.fs.base.replace("/storage/v1/", "/upload/storage/v1/") + "b/{}/o"  # fs.base: .../storage/v1/
            out = self._call("POST", upload, bucket, uploadType="multipart",
                             data=body, headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                             json_out=True, **cond)  # fmt: skip
        except FileExistsError:  # 412: gcsfs's name for a precondition that failed
            if cond:
                return None
            raise
        return str(out.get("generation", ""))

    def get(self, bucket: str, key: str, limit: int) -> tuple[bytes, str] | None:
        for _ in range(_GET_TRIES):
            try:
                meta = self._meta(bucket, key)
            except FileNotFoundError:
                return None
            if int(meta.get("size", 0)) > limit:
                raise ValueError(f"has {int(meta['size']):,} bytes, more than it may have ({limit:,})")
            try:
                _, data = self._call("GET", "b/{}/o/{}", bucket, key, alt="media", generation=meta["generation"])
            except FileNotFoundError:  # that generation was replaced after its metadata was read
                continue
            if len(data) > limit:
                raise ValueError(f"has more than {limit:,} bytes")
            return bytes(data), str(meta["generation"])
        raise OSError(f"gs://{bucket}/{key} was replaced {_GET_TRIES} times while it was read")

    def head(self, bucket: str, key: str) -> Head:
        meta = self._meta(bucket, key)
        return Head(int(meta.get("size", 0)), str(meta.get("generation", "")))

    def listing(self, bucket: str, prefix: str) -> Iterator[tuple[str, Head]]:
        token = None
        while True:
            page = self._call("GET", "b/{}/o", bucket, prefix=prefix, pageToken=token, json_out=True)
            for item in page.get("items", []):
                yield str(item["name"]), Head(int(item.get("size", 0)), str(item.get("generation", "")))
            token = page.get("nextPageToken")
            if not token:
                return

    def read_range(self, bucket: str, key: str, start: int, end: int, pin: Head) -> bytes:
        try:
            _, data = self._call("GET", "b/{}/o/{}", bucket, key, alt="media", generation=pin.tag,
                                 headers={"Range": f"bytes={start}-{end - 1}"})  # fmt: skip
        except FileNotFoundError:  # that generation is gone (replaced, or removed): the listing says which
            raise Changed() from None
        return bytes(data)

    def delete(self, bucket: str, key: str, *, if_tag: str | None = None) -> None:
        try:
            self._call("DELETE", "b/{}/o/{}", bucket, key, **({"ifGenerationMatch": if_tag} if if_tag else {}))
        except (FileNotFoundError, FileExistsError):
            return

    def no_bucket(self, err: BaseException, bucket: str) -> bool:
        # gcsfs's 404 names the path asked: the bucket's, or its objects' collection (an upload, a listing)
        return isinstance(err, FileNotFoundError) and str(err).rstrip("/").endswith((f"b/{bucket}", f"b/{bucket}/o"))


def open_store(scheme: str, needed_by: str) -> Store:
    """A fresh client of the store `scheme` names (no instance or listing cache: the bucket is read as it is now).
    S3: credentials, region and endpoint from the AWS_* variables, as boto reads them. GCS: Google's application
    default credentials (GOOGLE_APPLICATION_CREDENTIALS, else the metadata server: workload identity), anonymous
    against an emulator (STORAGE_EMULATOR_HOST), as Google's own client does. Without the client library:
    ConfigError naming `needed_by` (the field and URL that asked for it)."""
    if scheme == "gs":
        try:
            # gcsfs.core's, not the package's default: that one (ExtendedGcsFileSystem) first asks the gRPC storage
            # control API what kind of bucket it is; the JSON API serves every bucket these locations name.
            from gcsfs.core import GCSFileSystem
        except ImportError:
            raise ConfigError(f"{needed_by} needs gcsfs (the gcs extra): pip install 'jobspec-k8s[gcs]' (the runner "
                              "image carries it)") from None  # fmt: skip
        token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None
        return GCS(GCSFileSystem(token=token, skip_instance_cache=True, use_listings_cache=False))
    try:
        import s3fs
    except ImportError:
        raise ConfigError(
            f"{needed_by} needs s3fs (the s3 extra): pip install 'jobspec-k8s[s3]' (the runner image carries it)"
        ) from None
    return S3(s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False))
