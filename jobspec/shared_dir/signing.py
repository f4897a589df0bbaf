"""An optional key that authenticates what jobs leave in shared directories: HMAC-SHA256, from a Kubernetes Secret.

Signed with it: checkpoint manifests (below), and the data cache's entries, digest stamps and stream position
indexes (runner/data/cache.py, runner/data/stream.py): a record signed here carries `hmac_sha256` over its
canonical JSON.

Without a key, manifest.json (runner/checkpoint/manifest.py) finds accidents: truncation, zeroed blocks,
bit rot. Anyone who can write the volume can also rewrite it, so it cannot tell a swapped shard from
the real one. With JOBSPEC_CHECKPOINT_KEY set (at least MIN_KEY_BYTES, e.g. `openssl rand -hex 32`, given to
the pods from a Secret through `env_from_secrets`), every file's SHA-256 joins its entry, the manifest
carries `hmac_sha256` over the rest of it, and a resume or an export checks the MAC and reads every
file whole against its SHA-256: a checkpoint without a valid MAC is damaged. The key is never logged;
messages name the variable only.

What it does not do: it authenticates "written by a holder of the key", not "written by this run"; a
step directory copied from another run signed with the same key verifies (the lineage check in
meta.json, which the MAC covers, still refuses a different training).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from jobspec.errors import ConfigError

KEY_ENV = "JOBSPEC_CHECKPOINT_KEY"
MIN_KEY_BYTES = 32  # RFC 2104: a key shorter than the hash's output (32 bytes for SHA-256) weakens the MAC
FIELD = "hmac_sha256"


def key() -> bytes | None:
    """The signing key from the environment, None when unset; ConfigError (exit 2) when it is too short."""
    text = os.environ.get(KEY_ENV)
    if text is None:
        return None
    raw = text.strip().encode()
    if len(raw) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{KEY_ENV} is set but shorter than {MIN_KEY_BYTES} bytes (its value is not shown): give it a random key, "
            f"e.g. `kubectl create secret generic ckpt-key --from-literal={KEY_ENV}=$(openssl rand -hex 32)` and "
            "`env_from_secrets: [ckpt-key]`, or unset it to resume without authentication"
        )
    return raw


def _canonical(record: dict[str, Any]) -> bytes:
    body = {k: v for k, v in record.items() if k != FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(record: dict[str, Any], secret: bytes) -> dict[str, Any]:
    """`record` with its MAC added."""
    return {**record, FIELD: hmac.new(secret, _canonical(record), hashlib.sha256).hexdigest()}


def problem(record: dict[str, Any], secret: bytes, name: str) -> str | None:
    """Why the record `record` (file `name`) is not authenticated by `secret`, or None."""
    mac = record.get(FIELD)
    if mac is None:
        return f"{name} is not signed, but {KEY_ENV} is set (written without the key, or forged)"
    want = hmac.new(secret, _canonical(record), hashlib.sha256).hexdigest()
    if not isinstance(mac, str) or not hmac.compare_digest(mac.encode(), want.encode()):
        return f"{name} does not match its signature (forged or changed, or signed with another {KEY_ENV})"
    return None
