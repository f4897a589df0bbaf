"""What a credential looks like: secret-like variable names, token-shaped values, URLs that
carry a user and password. One place, used by the spec (refuse inline secrets), the loader
and the CLI (never echo one) and the cluster client (scrub the API server's messages).

Names are matched by whole words (HF_TOKEN, DB_PASSWORD, OPENAI_KEY; not TOKENIZERS_PARALLELISM,
KEYBOARD, MAX_TOKENS). Values are matched by the published formats of common providers.
"""

from __future__ import annotations

import re
from typing import Any

# A word anywhere in the name means a credential.
_STRONG = (
    r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?|BEARER|DSN|DATABASE_URL|"
    r"CONNECTION_STRING|COOKIES?|WEBHOOK|AUTHORIZATION"
)
# Words that are credentials only as the last word: DB_PASS, OPENAI_KEY, BASIC_AUTH (not PASS_THROUGH, AUTH_TYPE).
_LAST = r"KEY|PASS|PWD|AUTH|SESSION(_ID|_KEY)?"
_SECRET_NAME = re.compile(rf"(^|_)({_STRONG})\d*(_|$)|(^|_)({_LAST})\d*$", re.I)  # HF_TOKEN2 too
# Well-known names that match the words above and hold no credential.
_NOT_SECRET_NAME = re.compile(
    r"^PWD$"  # the shell's working directory
    r"|(^|_)(PAD|EOS|BOS|UNK|SEP|CLS|MASK|SPECIAL|START|END|STOP)_TOKENS?(_ID)?$"  # tokenizer settings
    r"|(^|_)(PUBLIC|SORT|CACHE|PARTITION|PRIMARY|FOREIGN|GROUP|ROUTING|SHARD|HASH|LOOKUP|INDEX)_KEY$",
    re.I,
)

_TOKEN_PATTERNS = [
    # Authorization headers; the credential has a digit or symbol (not "Bearer authentication").
    r"\bBearer\s+(?=[A-Za-z._~+/=-]*[0-9._~+/=-])[A-Za-z0-9._~+/=-]{8,}",
    r"\bBasic\s+(?=\S*[a-z])(?=\S*[A-Z0-9])(?:[A-Za-z0-9+/]{4}){2,}(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?"
    r"(?![A-Za-z0-9+/=])",  # base64 of user:password
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----",
    r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.?[A-Za-z0-9_-]*",  # JWT (service account tokens)
    r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b",  # AWS access key id
    r"\bAIza[0-9A-Za-z_-]{35}",  # Google API key
    r"\bya29\.[0-9A-Za-z_-]{20,}",  # Google OAuth access token
    r"\bAccountKey=[A-Za-z0-9+/]{20,}={0,2}",  # Azure storage connection string
    r"\bSharedAccessSignature=[^;\s]{20,}|\bsig=[A-Za-z0-9%+/]{20,}",  # Azure SAS
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}",  # Slack tokens
    r"hooks\.slack\.com/services/[A-Za-z0-9/]{20,}",  # Slack webhook
    r"\b(?:sk|rk|pk)_(?:live|test)_[0-9A-Za-z]{16,}|\bwhsec_[0-9A-Za-z]{16,}",  # Stripe
    r"\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}",  # GitHub
    r"\bhf_[A-Za-z0-9]{20,}|\bapi_org_[A-Za-z0-9]{20,}",  # Hugging Face
    r"\bsk-[A-Za-z0-9_-]{20,}",  # OpenAI, Anthropic (sk-ant-...)
    r"\bglpat-[A-Za-z0-9_-]{20,}",  # GitLab
    r"\bnpm_[A-Za-z0-9]{30,}",  # npm
]
_TOKEN = re.compile("|".join(_TOKEN_PATTERNS))
_HEX40 = re.compile(r"^[0-9a-f]{40}$")  # a W&B API key, and also a git commit: see looks_secret_value
# user:password@ after a scheme (postgres://u:p@h/db), or leading a scheme-less reference (u:p@registry/img).
_USERINFO = re.compile(r"(?P<pre>[A-Za-z][A-Za-z0-9+.-]*://|^)(?P<cred>[^\s/@:]+:[^\s/@]+)@(?=[^\s/@]+)")
# For text from elsewhere (API server messages): long mixed-case runs of token alphabet.
_TOKEN_LIKE = re.compile(r"(?<![A-Za-z0-9_-])(?=[A-Za-z0-9_+/=-]*[a-z])(?=[A-Za-z0-9_+/=-]*[A-Z])"
                         r"(?=[A-Za-z0-9_+/=-]*[0-9])[A-Za-z0-9_+/=-]{32,}")  # fmt: skip
_HEADER = re.compile(r"(?i)\b(authorization|x-api-key|cookie|set-cookie)\b(\s*[:=]\s*)[^\n,;]+")

REDACTED = "<redacted>"
SECRET_REF_HINT = "put it in a Secret and reference it: `{name}: {{secret: <secret-name>, key: <key>}}`"


def is_secret_name(name: str) -> bool:
    """HF_TOKEN, DB_PASSWORD, OPENAI_KEY, SENTRY_DSN: the variable holds a credential."""
    return bool(_SECRET_NAME.search(name)) and not _NOT_SECRET_NAME.search(name)


def credential_kind(value: str, *, hex40: bool = False) -> str | None:
    """What kind of credential `value` holds ("token", "URL password"), or None.

    `hex40`: a bare 40-hex value counts (W&B keys); off where a git commit is as likely.
    """
    if _USERINFO.search(value):
        return "URL with a user and password"
    if _TOKEN.search(value):
        return "token"
    if hex40 and _HEX40.match(value):
        return "40-hex key"
    return None


def url_credentials(value: str) -> bool:
    return bool(_USERINFO.search(value))


def redact(text: str, *, token_like: bool = False) -> str:
    """`text` with every credential-shaped part replaced; `token_like` also hides long mixed-case
    runs of token alphabet (for messages whose source we do not control)."""
    text = _USERINFO.sub(lambda m: f"{m['pre']}{REDACTED}@", text)
    text = _HEADER.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}", text)
    text = _TOKEN.sub(REDACTED, text)
    return _TOKEN_LIKE.sub(REDACTED, text) if token_like else text


def inline_credentials(data: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """(path, problem, hint) for every string in `data` (a spec as plain data, env excluded) that
    carries a credential: `model.path: https://user:pass@host/...`, an image `user:pass@registry/...`."""
    found: list[tuple[str, str, str]] = []
    todo: list[tuple[str, Any]] = [(prefix, data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            todo += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(f"{path}.{i}", v) for i, v in enumerate(value)]
        elif isinstance(value, str) and (kind := credential_kind(value)):
            pull = "; for a registry, image.pull_secrets" if path.startswith("image.") else ""
            found.append(
                (path, f"holds a credential ({kind}; not shown): never written to a manifest or a log",
                 f"remove it and give it through a Secret: env `NAME: {{secret: <secret-name>, key: <key>}}`{pull}")
            )  # fmt: skip
    return sorted(found)
