"""argparse that never echoes a value it was given.

argparse's errors quote the raw argument ("unrecognized arguments: hf_...", "invalid choice:
'...'"), and an argument given by mistake is often the token that was meant for a Secret. Only
words that cannot be one are shown: option names, plain lowercase words, short numbers.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from jobspec.contract import EXIT_CONFIG
from jobspec.spec.credentials import credential_kind, redact

_PLAIN = re.compile(r"-{0,2}[a-z][a-z-]{0,31}|-?\d{1,12}(\.\d{1,6})?")  # --outptu, valdate, eight, 12.5
_HIDDEN = "<not shown>"
# argparse's messages that quote a value, and the group holding it.
_QUOTING = [
    re.compile(r"^(?P<head>.*invalid choice: )(?P<value>.*)(?P<tail> \(choose from (?P<choices>.*)\))$", re.S),
    re.compile(r"^(?P<head>.*unknown parser )(?P<value>.*)(?P<tail> \(choices: (?P<choices>.*)\))$", re.S),
    re.compile(r"^(?P<head>.*invalid \w+ value: )(?P<value>.*)(?P<tail>)$", re.S),
    re.compile(r"^(?P<head>.*ignored explicit argument )(?P<value>.*)(?P<tail>)$", re.S),
    re.compile(r"^(?P<head>.*ambiguous option: )(?P<value>.*)(?P<tail> could match .*)$", re.S),
]


def shown(arg: str) -> str:
    """`arg` as an error message may show it: itself when plain, else a placeholder."""
    return arg if _PLAIN.fullmatch(arg) and not credential_kind(arg) else _HIDDEN


def quiet(message: str) -> str:
    """argparse's error message with every quoted argument replaced unless it is plainly harmless."""
    for pattern in _QUOTING:
        m = pattern.match(message)
        if m:
            raw = m["value"].strip("'\"")
            value = shown(raw)
            message = f"{m['head']}{value if value == _HIDDEN else repr(value)}{m['tail']}"
            choices = re.findall(r"'([^']*)'", m.groupdict().get("choices") or "")
            import difflib  # only for a bad argument: not on every start

            close = difflib.get_close_matches(raw, choices, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]!r}?"
            break
    return redact(message, token_like=True)


def unrecognized(args: Sequence[str]) -> str:
    """'unrecognized arguments: --foo and 1 more (not shown)'."""
    plain = [a for a in args if shown(a) != _HIDDEN]
    hidden = len(args) - len(plain)
    text = " ".join(plain)
    if hidden:
        more = f"{hidden} {'more' if plain else 'argument' + ('s' if hidden > 1 else '')}"
        text = f"{text} and {more}" if plain else more
        text += " (not shown: an argument may be a credential; a --set value must follow --set as KEY=VALUE)"
    return f"unrecognized arguments: {text}"


class Parser(argparse.ArgumentParser):
    """The CLI's parser: exit 2 with a short usage line, and no argument echoed."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(extras), quoted=False)
        return parsed

    def error(self, message: str, quoted: bool = True) -> NoReturn:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {quiet(message) if quoted else message}\n")
