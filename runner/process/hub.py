"""A hub model fetched once per node, by the supervisor, before any worker starts.

`fetch_model(spec)` downloads what training reads of `model.path` (weights, config, tokenizer, generation
config, chat template) with huggingface_hub's `snapshot_download` into HF_HOME (the pod's cache volume, the
host's own cache under `jobspec run`) and returns the snapshot directory; the supervisor hands it to the
workers as `model.path`, so no rank downloads and every rank reads the same commit. On a restart the files
are in the cache and nothing is downloaded (snapshot_download asks the hub which commit the revision is and
finds every file of it on disk); with the hub unreachable the cached snapshot is used as it is.

Exit codes: a repository or revision that does not exist, or one the token cannot read (gated, private),
is a ConfigError (2: retrying cannot help); a hub that cannot be reached with nothing cached is HubUnreachable
(1: the Job retries). The token comes from HF_TOKEN only (a Secret in the pod) and is never logged.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from jobspec.errors import ConfigError, JobspecError
from jobspec.spec.hub import is_hub_id
from jobspec.spec.models import JobSpec

log = logging.getLogger("jobspec.runner")

# What from_pretrained, the tokenizer and the chat template read: safetensors weights (or, where a repository has
# none, PyTorch .bin), never the TF/Flax/ONNX/GGUF copies many repositories also hold.
COMMON_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
    "*.tiktoken", "chat_template.jinja", "chat_template.json", "additional_chat_templates/*",
]  # fmt: skip
SAFETENSORS = ["*.safetensors", "*.safetensors.index.json"]
PYTORCH_BIN = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
TOKEN_FIX = (
    "set model.hub_token to a Secret holding a token with access (accept the model's terms on its hub page "
    "first for a gated model)"
)


class HubUnreachable(JobspecError):
    """The hub cannot be reached and the files are not cached: worth a retry (the Job's next pod)."""


def hub_model(spec: JobSpec) -> str | None:
    """The repository id when `model.path` names a hub model: no such local path, and the shape of an id."""
    path = spec.model.path
    if path is None or Path(path).exists() or not is_hub_id(path):
        return None
    return path


def fetch_model(spec: JobSpec) -> str | None:
    """The local snapshot directory of the hub model of `spec` (downloaded when missing); None for a preset or
    a local path. Raises ConfigError or HubUnreachable with a message that names model.path and the fix."""
    repo = hub_model(spec)
    if repo is None:
        return None
    if not sys.stderr.isatty():  # bars are noise in pod logs; read when huggingface_hub is imported
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import huggingface_hub as hub
        from huggingface_hub import errors
    except ImportError:
        raise ConfigError(
            f"model.path {repo!r} is a hub id and huggingface_hub is not installed: pip install huggingface_hub"
        ) from None
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request otherwise
    revision = spec.model.revision or "main"
    token = os.environ.get("HF_TOKEN") or False  # False: never a token file lying in the cache volume
    where = f"model.path {repo!r} (revision {revision})"
    try:
        try:
            patterns = _patterns(hub.HfApi(token=token).model_info(repo, revision=revision).siblings or [])
        except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError):
            raise
        except Exception as err:  # the hub is down or out of reach: what the cache holds will do
            log.warning("%s: the hub cannot be reached (%s); looking in the cache", where, _reason(err))
            return _cached(hub, repo, revision, where, err)
        log.info("%s: fetching %s into %s", where, ", ".join(patterns[-2:]), hub.constants.HF_HUB_CACHE)
        path = hub.snapshot_download(repo, revision=revision, allow_patterns=patterns, token=token)
    except errors.GatedRepoError:
        raise ConfigError(f"{where}: a gated repository this token cannot read: {TOKEN_FIX}") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(
            f"{where}: no such revision in the repository; set model.revision to a branch, tag or commit it has"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(
            f"{where}: no such model on the hub (or a private one this token cannot read): check the id; "
            "for a private one, " + TOKEN_FIX
        ) from None
    except JobspecError:
        raise
    except Exception as err:  # a connection lost mid-file, a full volume, the hub's 5xx: the next pod retries
        raise HubUnreachable(f"{where}: the download failed ({_reason(err)}); the next attempt retries it") from None
    log.info("%s: snapshot %s", where, path)
    return str(path)


def _patterns(siblings: list[Any]) -> list[str]:
    names = [s.rfilename for s in siblings]
    weights = SAFETENSORS if any(n.endswith(".safetensors") for n in names) or not names else PYTORCH_BIN
    return [*COMMON_FILES, *weights]


def _cached(hub: Any, repo: str, revision: str, where: str, cause: Exception) -> str:
    """The cached snapshot of `revision`, with no request to the hub; HubUnreachable when there is none."""
    for weights in (SAFETENSORS, PYTORCH_BIN):  # the files an earlier, online attempt chose
        try:
            path = hub.snapshot_download(repo, revision=revision, allow_patterns=[*COMMON_FILES, *weights],
                                         local_files_only=True)  # fmt: skip
        except Exception:  # nothing, or an incomplete snapshot: try the other weights, then give up
            continue
        if any(Path(path).glob(weights[0])):
            log.info("%s: the hub is out of reach; using the cached snapshot %s", where, path)
            return str(path)
    raise HubUnreachable(
        f"{where}: the hub cannot be reached ({_reason(cause)}) and the model is not in the cache "
        f"({os.environ.get('HF_HOME') or 'the default HF_HOME'}); the next attempt retries"
    ) from None


def _reason(err: BaseException) -> str:
    """The first line of an error, short: huggingface_hub's messages run to paragraphs."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__
