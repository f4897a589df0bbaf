"""What a credential looks like: secret-like names, token-shaped values, URLs that carry one. One
place, used by the spec (refuse inline secrets), the loader and the CLI (never echo one), the
runner (never log one) and the cluster client (scrub the API server's messages).

Names are read word by word, whatever the spelling: HF_TOKEN, hf-token, hfToken, HFTOKEN, SSH_PRIVATE,
DB_DSN, APIKEY; not TOKENIZERS_PARALLELISM, KEYBOARD, MAX_TOKENS, PAD_TOKEN or HF_TOKEN_PATH (a file).
Values: the published formats of common providers (gitleaks' and detect-secrets' rules), URLs with a
user or password (`redis://:pw@h`), `name=value` pairs and query parameters with a secret name
(`?token=`, `&sig=`, `X-Amz-Signature=`), webhook URLs (the URL is the credential) and opaque
random-looking segments in a URL's path.

Why not detect-secrets itself: it is written for lines of source code (quoted strings, assignments),
misses Hugging Face tokens, user-only and password-only URLs, query parameters and webhook paths, pulls
in `requests`, and its scanner imports in 1.3 s (measured on the 2-core dev machine); `jobspec render`
must stay light. Its plugin list is a reference for the shapes here.

Every pattern is linear in its input (no lookahead that can scan to the end from every position), so
a long text costs milliseconds; the spec bounds its strings before they get here (jobspec.spec.safe_yaml).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "<redacted>"
SECRET_REF_HINT = (
    "put it in a Secret and reference it: `{name}: {{secret: <secret-name>, key: <key>}}` "
    "(rendered as a secretKeyRef, never as a value)"
)

# --- names ---------------------------------------------------------------------------------

# Words of a name: HF_TOKEN, hf-token, hfToken, HFToken -> HF TOKEN; GH_TOKEN2 -> GH TOKEN 2.
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# A credential wherever the word stands.
_STRONG = frozenset({
    "TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASSPHRASE", "APIKEY", "CREDENTIAL",
    "CREDENTIALS", "CREDS", "BEARER", "DSN", "COOKIE", "COOKIES", "WEBHOOK", "WEBHOOKS", "AUTHORIZATION",
})  # fmt: skip
_PAIRS = frozenset({
    ("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY"), ("SECRET", "KEY"), ("SIGNING", "KEY"),
    ("ENCRYPTION", "KEY"), ("MASTER", "KEY"), ("DATABASE", "URL"), ("CONNECTION", "STRING"), ("SESSION", "ID"),
    ("SESSION", "KEY"),
})  # fmt: skip
# A credential only as the last word: DB_PASS, OPENAI_KEY, BASIC_AUTH, SSH_PRIVATE, GITHUB_PAT (not PASS_THROUGH,
# AUTH_TYPE, KEY_PATH, PRIVATE_REGISTRY).
_LAST = frozenset({"KEY", "PASS", "PWD", "AUTH", "SESSION", "PRIVATE", "PAT", "JWT"})
# Run together into one word: HFTOKEN, SENTRYDSN, DBPASSWORD, CLIENTSECRET, APIKEY, SSHKEY, DBPASS.
_FUSED = re.compile(
    r"(TOKEN|DSN)$|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|APIKEY|WEBHOOK"
    r"|^(API|ACCESS|SECRET|PRIVATE|SSH|AUTH|SIGNING|ENCRYPTION|MASTER|LICENSE|SESSION|CLIENT|ACCOUNT|SERVICE|DB|"
    r"DATABASE|ADMIN|ROOT|USER|SMTP|LDAP|REDIS|PG|MYSQL)(KEY|PASS|PWD)$"
)
# Tokenizer settings, not credentials: PAD_TOKEN, EOS_TOKEN_ID, MAX_TOKEN.
_TOKENIZER_WORDS = frozenset({
    "PAD", "EOS", "BOS", "UNK", "SEP", "CLS", "MASK", "SPECIAL", "START", "END", "STOP", "MAX", "MIN", "NUM",
})  # fmt: skip
# Keys that name a column, a shard or a cache entry: SORT_KEY, PUBLIC_KEY, PROMPT_KEY.
_PLAIN_KEYS = frozenset({
    "PUBLIC", "SORT", "CACHE", "PARTITION", "PRIMARY", "FOREIGN", "GROUP", "ROUTING", "SHARD", "HASH", "LOOKUP",
    "INDEX", "DATA", "DATASET", "TEXT", "INPUT", "OUTPUT", "LABEL", "PROMPT", "RESPONSE", "COLUMN", "FIELD",
    "METRIC", "MESSAGES", "ROLE", "CONTENT", "CHOSEN", "REJECTED", "IMAGE", "BATCH", "CONFIG", "DICT", "MAP",
})  # fmt: skip
# A last word that makes the name about a credential, not one: HF_TOKEN_PATH, DB_PASSWORD_FILE, TOKEN_TYPE.
_ABOUT = frozenset({
    "PATH", "FILE", "FILENAME", "DIR", "TYPE", "NAME", "LENGTH", "LEN", "LIMIT", "COUNT", "TTL", "EXPIRY",
    "ENDPOINT", "ENABLED", "DISABLED", "FORMAT",
})  # fmt: skip
MAX_NAME_CHARS = 256  # longer is no variable name; such a name is judged by its value alone


def _words(name: str) -> list[str]:
    return [w.upper() for w in _WORDS.findall(name) if not w.isdigit()]


def _last_word(name: str) -> str:
    words = _words(name[:MAX_NAME_CHARS])
    return words[-1] if words else ""


def is_secret_name(name: str) -> bool:
    """HF_TOKEN, hfToken, HFTOKEN, DB_PASSWORD, OPENAI_KEY, SENTRY_DSN, SSH_PRIVATE: the name holds a credential."""
    words = _words(name[:MAX_NAME_CHARS])
    if not words or name.upper() == "PWD" or words[-1] in _ABOUT:  # PWD: the shell's working directory
        return False
    for i, word in enumerate(words):
        before = words[i - 1] if i else ""
        if word == "TOKEN" and before in _TOKENIZER_WORDS and set(words[i + 1 :]) <= {"ID", "IDS"}:
            continue
        last = i == len(words) - 1
        if word in _STRONG or (before, word) in _PAIRS or (last and word in _LAST and before not in _PLAIN_KEYS):
            return True
        if len(word) > 3 and _FUSED.search(word) and word[:-5] not in _TOKENIZER_WORDS:
            return True
    return False


def _query_secret_name(name: str) -> bool:
    """A query parameter that carries a credential: the names above, signatures (`sig`, `X-Amz-Signature`), `pwd`."""
    return is_secret_name(name) or _last_word(name) in {"SIG", "SIGNATURE", "PWD"}


# --- values --------------------------------------------------------------------------------

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
    r"\bxox[abposre]-[A-Za-z0-9-]{10,}|\bxapp-\d-[A-Za-z0-9-]{10,}",  # Slack tokens
    r"hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]{8,}",  # Slack webhook, without a scheme too
    r"discord(?:app)?\.com/api/(?:v\d+/)?webhooks/\d+/[A-Za-z0-9_-]{20,}",  # Discord webhook
    r"\b[MNO][A-Za-z0-9_-]{23,25}\.[A-Za-z0-9_-]{6}\.[A-Za-z0-9_-]{27}\b",  # Discord bot token (detect-secrets)
    r"\b\d{8,10}:[0-9A-Za-z_-]{35}\b",  # Telegram bot token (detect-secrets)
    r"\bSG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}\b",  # SendGrid (detect-secrets)
    r"\bpypi-AgE[A-Za-z0-9_-]{50,}",  # PyPI upload token
    r"\b(?:sk|rk|pk)_(?:live|test)_[0-9A-Za-z]{16,}|\bwhsec_[0-9A-Za-z]{16,}",  # Stripe
    r"\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}",  # GitHub
    r"\bhf_[A-Za-z0-9]{20,}|\bapi_org_[A-Za-z0-9]{20,}",  # Hugging Face
    r"\bsk-[A-Za-z0-9_-]{20,}",  # OpenAI, Anthropic (sk-ant-...)
    r"\bgl(?:pat|dt|rt|ptt|ft|soat|cbt|imt)-[A-Za-z0-9_-]{20,}",  # GitLab
    r"\bnpm_[A-Za-z0-9]{30,}",  # npm
    r"\bdapi[0-9a-f]{32}\b",  # Databricks
    r"\bhv[sbr]\.[A-Za-z0-9_-]{24,}",  # HashiCorp Vault
    r"\br8_[A-Za-z0-9]{30,}|\bgsk_[A-Za-z0-9]{40,}|\bpplx-[A-Za-z0-9]{40,}",  # Replicate, Groq, Perplexity
    r"\b[0-9a-f]{32}-us\d{1,2}\b",  # Mailchimp (detect-secrets)
]
_TOKEN = re.compile("|".join(_TOKEN_PATTERNS))
_HEX40 = re.compile(r"^[0-9a-f]{40}$")  # a W&B API key, and also a git commit: see credential_kind
# A URL up to its query: the scheme starts where a word starts (no rescan from every letter of a long word). The
# query is left to the scan that follows, which finds its `name=value` pairs and any URL inside it.
_URL = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s\"'<>`?#]*")
# user:password@ leading a scheme-less reference (u:p@registry/img), not a tag before a digest (img:1@sha256:...).
_BARE_USERINFO = re.compile(r"^(?P<cred>[^\s/@:]+:[^\s/@]+)@(?!sha(?:256|384|512):)(?=[^\s/@])")
# Schemes whose user part is a login name (the credential is a key file): ssh://git@github.com.
_LOGIN_SCHEMES = frozenset({"ssh", "git+ssh", "ssh+git", "sftp"})
# name=value (a query parameter, a connection string's field, a flag) and "name": "value" (JSON).
_PAIR = re.compile(
    r"(?<![A-Za-z0-9_.-])-{0,2}(?P<q>[\"']?)(?P<name>[A-Za-z][A-Za-z0-9_.-]{0,127})(?P=q)[ \t]{0,8}"
    r"(?:=|(?<=[\"']):)[ \t]{0,8}[\"']?(?P<value>[^\s&;#,\"'<>]+)"
)
_NOT_A_VALUE = re.compile(r"^(?:\$.*|[.*]+|true|false|none|null|yes|no|on|off|0|1)$", re.I)  # $(REF), ..., flags
_HOOK_SEGMENT = re.compile(r"^(?:web)?hooks?(?:b2)?$", re.I)
_KEY_SEGMENTS = frozenset({"KEY", "TOKEN", "APIKEY", "SECRET", "PASSWORD"})  # .../with/key/<the key>
_OPAQUE_RUN = re.compile(r"[A-Za-z0-9]{20,}")
# For text from elsewhere (API server messages): long mixed-case runs of token alphabet. The lookbehind is the
# run's own alphabet: a match starts only where a run starts.
_TOKEN_LIKE = re.compile(r"(?<![A-Za-z0-9_+/=-])(?=[A-Za-z0-9_+/=-]*[a-z])(?=[A-Za-z0-9_+/=-]*[A-Z])"
                         r"(?=[A-Za-z0-9_+/=-]*[0-9])[A-Za-z0-9_+/=-]{32,}")  # fmt: skip
_HEADER = re.compile(r"(?i)\b(authorization|x-api-key|cookie|set-cookie)\b(\s*[:=]\s*)[^\n,;]+")


def credential_kind(value: str, *, hex40: bool = False) -> str | None:
    """What kind of credential `value` holds ("token", "URL with a password"), or None. The kind never
    quotes the value.

    `hex40`: a bare 40-hex value counts (W&B keys); off where a git commit is as likely.
    """
    return _credential_kind(value, hex40)


# One spec asks about the same strings several times (the env validator, the one-pass rules, the scrubber of its
# messages): the answers are kept for a while, as a scan costs about a microsecond a character.
@functools.lru_cache(maxsize=1024)
def _credential_kind(value: str, hex40: bool) -> str | None:
    for url in _URL.finditer(value):
        kind = _url_kind(url.group())
        if kind:
            return kind
    if _BARE_USERINFO.search(value):
        return "reference with a user and password"
    if _TOKEN.search(value):
        return "token"
    if any(_secret_pair(m) for m in _PAIR.finditer(value)):
        return "a secret-named parameter, name=value"
    if hex40 and _HEX40.match(value):
        return "40-hex key"
    return None


def redact(text: str, *, token_like: bool = False) -> str:
    """`text` with every credential-shaped part replaced; `token_like` also hides long mixed-case
    runs of token alphabet (for messages whose source we do not control)."""
    text = _URL.sub(lambda m: _redact_url(m.group()), text)
    text = _BARE_USERINFO.sub(f"{REDACTED}@", text)
    text = _HEADER.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}", text)
    text = _TOKEN.sub(REDACTED, text)
    text = _PAIR.sub(_redact_pair, text)
    return _TOKEN_LIKE.sub(REDACTED, text) if token_like else text


# A value shorter than this is not replaced by `scrub`: blanking every "1234" in a log would hide more than a secret.
MIN_SECRET_CHARS = 6


def secret_values(environ: Mapping[str, str]) -> list[str]:
    """The values in `environ` that are credentials (under a secret-like name, or credential-shaped), longest
    first: what `scrub` hides in a text that may quote them (a traceback, a library's message)."""
    found = {v for k, v in environ.items() if len(v) >= MIN_SECRET_CHARS and (is_secret_name(k) or credential_kind(v))}
    return sorted(found, key=len, reverse=True)


def scrub(text: str, values: Iterable[str] = (), *, token_like: bool = False) -> str:
    """`text` with each of `values` (as written, or escaped as repr() writes it) and every credential shape
    replaced (`redact`)."""
    for value in values:
        for form in dict.fromkeys((value, repr(value)[1:-1])):
            text = text.replace(form, REDACTED)
    return redact(text, token_like=token_like)


def _secret_pair(m: re.Match[str]) -> bool:
    if _NOT_A_VALUE.match(m["value"]):
        return False
    query = m.start() > 0 and m.string[m.start() - 1] in "?&#;"
    return _query_secret_name(m["name"]) if query else is_secret_name(m["name"])


def _redact_pair(m: re.Match[str]) -> str:
    if not _secret_pair(m):
        return m.group()
    start = m.start("value") - m.start()
    return m.group()[:start] + REDACTED


# --- URLs ----------------------------------------------------------------------------------


class _Url:
    """A URL (without its query) cut into the parts a credential hides in: user info, host, path segments."""

    def __init__(self, url: str) -> None:
        self.scheme, _, rest = url.partition("://")
        self.authority, slash, path = rest.partition("/")
        self.userinfo, at, self.host = self.authority.rpartition("@")
        self.at = bool(at)
        self.segments = (slash + path).split("/")

    def userinfo_kind(self) -> str | None:
        if not self.at or not self.userinfo:
            return None
        if ":" in self.userinfo:
            return "URL with a password" if self.userinfo.startswith(":") else "URL with a user and password"
        if self.scheme.lower() in _LOGIN_SCHEMES:
            return None
        return "URL with a user name: tokens are passed that way"

    def secret_segments(self) -> tuple[set[int], str | None]:
        """Indexes of the path segments that hold a credential, and what kind."""
        hook = "hook" in self.host.lower()
        found: set[int] = set()
        kind = None
        for i, segment in enumerate(self.segments):
            if not segment:
                continue
            if hook or (i and _HOOK_SEGMENT.match(self.segments[i - 1])):
                hook, kind = True, "webhook URL: the URL is the credential"
                found.add(i)
            elif i and _last_word(self.segments[i - 1]) in _KEY_SEGMENTS:
                kind = kind or "secret in a URL path"
                found.add(i)
            elif _opaque(segment):
                kind = kind or "random-looking token in a URL path"
                found.add(i)
        return found, kind


def _url_kind(url: str) -> str | None:
    parts = _Url(url)
    return parts.userinfo_kind() or parts.secret_segments()[1]


def _redact_url(url: str) -> str:
    parts = _Url(url)
    if not parts.userinfo_kind() and not parts.secret_segments()[0]:
        return url
    host = f"{REDACTED}@{parts.host}" if parts.userinfo_kind() else parts.authority
    secret, _ = parts.secret_segments()
    path = "/".join(REDACTED if i in secret else s for i, s in enumerate(parts.segments))
    return f"{parts.scheme}://{host}{path}"


def _opaque(segment: str) -> bool:
    """A random-looking run in a path segment: 20+ letters and digits of both cases, the letters and digits
    interleaved (a model name such as Meta-Llama-3-8B-Instruct or MyDataset2024 is not)."""
    for m in _OPAQUE_RUN.finditer(segment):
        run = m.group()
        if not (any(c.isupper() for c in run) and any(c.islower() for c in run) and any(c.isdigit() for c in run)):
            continue
        digit_flips = sum(a.isdigit() != b.isdigit() for a, b in itertools.pairwise(run))
        humps = sum(a.islower() and b.isupper() for a, b in itertools.pairwise(run))
        if digit_flips >= 3 and digit_flips + humps >= 6:
            return True
    return False


# --- a spec's values -----------------------------------------------------------------------------

# Where each rendered field's credential belongs instead.
_FIX = {
    "image.": "name a registry's Secret in image.pull_secrets (any other credential: env `NAME: {secret, key}`)",
    "tracking.mlflow.": "reference Secrets: tracking.mlflow.token / username / password: {secret, key}",
    "tracking.wandb.": "reference a Secret: tracking.wandb.api_key: {secret, key}",
}
_ENV_FIX = "give it through a Secret: env `NAME: {secret: <secret-name>, key: <key>}` (rendered as a secretKeyRef)"


def inline_credentials(data: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """(path, problem, hint) for every string in `data` (a spec as plain data, env excluded), key or value,
    that carries a credential: `model.path: https://user:pass@host/...`, an image `user:pass@registry/...`,
    `tracking.mlflow.tracking_uri: https://h/?token=...`, a webhook URL in an annotation."""
    found: list[tuple[str, str, str]] = []
    todo: list[tuple[str, Any]] = [(prefix, data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and (kind := credential_kind(k)):
                    found.append((path, _problem(f"a key that is a credential ({kind})"), _ENV_FIX))
                else:
                    todo.append((f"{path}.{k}" if path else str(k), v))
        elif isinstance(value, list):
            todo += [(f"{path}.{i}", v) for i, v in enumerate(value)]
        elif isinstance(value, str) and (kind := credential_kind(value)):
            fix = next((fix for field, fix in _FIX.items() if path.startswith(field)), _ENV_FIX)
            found.append((path, _problem(f"holds a credential ({kind})"), f"remove it and {fix}"))
    return sorted(found)


def _problem(what: str) -> str:
    return f"{what}; not shown: never written to a manifest or a log"
