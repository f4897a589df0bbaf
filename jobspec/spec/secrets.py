"""Which strings of a spec are, or may be, credentials; and issues scrubbed of them.

Every credential-shaped key or value counts, and everything under a secret-like name
(env.HF_TOKEN, tracking.wandb.api_key) that is not a reference `{secret, key}`. The loader
asks `at()` whether an issue is near one (then it keeps only what cannot quote it) and runs
every issue through `scrub()`.
"""

from __future__ import annotations

from typing import Any

from jobspec.errors import SpecIssue
from jobspec.spec import safe_yaml
from jobspec.spec.credentials import REDACTED, credential_kind, is_secret_name, redact

Loc = tuple[str | int, ...]

REF_HINT = "never write a credential in the spec: reference a Secret, `{secret: <secret-name>, key: <key>}`"
_REF_FIELDS = {"secret", "key", "optional"}  # a SecretRef's own fields name a Secret, they hold none
_NAMING_FIELDS = _REF_FIELDS | {"pull_secrets", "env_from_secrets"}  # spec fields that list Secrets by name


def _secret_key(key: object) -> bool:
    """A key whose value is a credential: env.HF_TOKEN, tracking.wandb.api_key (not the fields that name Secrets)."""
    return isinstance(key, str) and key not in _NAMING_FIELDS and is_secret_name(key)


class SpecSecrets:
    """The credential strings of one spec (as plain data, overrides applied)."""

    def __init__(self, data: Any) -> None:
        self.strings: set[str] = set()
        self._forms: list[str] | None = None
        todo: list[tuple[Any, bool]] = [(data, False)]
        while todo:  # iterative; shared (aliased) values are bounded by safe_yaml.MAX_NODES
            value, secret = todo.pop()
            if isinstance(value, dict):
                ref = secret and set(map(str, value)) <= _REF_FIELDS
                for k, v in value.items():
                    self._add(str(k), secret and not ref)
                    todo.append((v, (secret and not ref) or _secret_key(k)))
            elif isinstance(value, list):
                todo += [(v, secret) for v in value]
            elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
                self._add(str(value), secret)

    def _add(self, text: str, secret: bool) -> None:
        if secret or credential_kind(text, hex40=True):
            self.strings.add(text)

    def _holds(self, value: Any) -> bool:
        todo, seen = [value], 0
        while todo and seen < safe_yaml.MAX_NODES:
            v, seen = todo.pop(), seen + 1
            if isinstance(v, dict):
                todo += [*v.keys(), *v.values()]
            elif isinstance(v, (list, tuple)):
                todo += v
            elif isinstance(v, str) and v in self.strings:
                return True
        return False

    def at(self, loc: Loc, value: Any) -> bool:
        """Is an issue at `loc` about input `value` near a credential?"""
        named = any(_secret_key(s) for s in loc)
        return named or self._holds(value) or any(str(s) in self.strings for s in loc)

    def shown(self, loc: Loc) -> Loc:
        """`loc` up to (not including) the first key that may be a credential."""
        cut = next((i for i, s in enumerate(loc) if str(s) in self.strings or credential_kind(str(s))), len(loc))
        return loc[:cut]

    def scrub(self, issues: list[SpecIssue]) -> list[SpecIssue]:
        """The issues with every sensitive string (as written, or quoted by repr) and credential shape replaced."""
        if self._forms is None:  # longest first: a secret that contains another is replaced whole
            longest = sorted((s for s in self.strings if len(s) >= 6), key=len, reverse=True)
            self._forms = list(dict.fromkeys(f for s in longest for f in (s, repr(s)[1:-1], _escaped(s)) if f))
        texts = [[i.path, i.message, i.hint or "", i.source or ""] for i in issues]
        joined = "\0".join(t for ts in texts for t in ts)
        present = [f for f in self._forms if f in joined]  # one scan per form, not one per form and issue
        out = []
        for issue, ts in zip(issues, texts, strict=True):
            for form in present:
                ts = [t.replace(form, REDACTED) for t in ts]
            path, message, hint, source = (redact(t) for t in ts)
            out.append(SpecIssue(path, message, issue.line, hint or None, source or None))
        return out


def _escaped(text: str) -> str:
    return text.encode("unicode_escape").decode("ascii")
