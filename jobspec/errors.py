"""The project's exception hierarchy. The CLI catches `JobspecError` in one place,
prints its message (no traceback unless --debug), the troubleshooting section that explains it
(`docs_link`) and exits with its `exit_code`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jobspec.contract import (
    EXIT_CLUSTER,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OOM_LAST_TIER,
    EXIT_OOM_RETRY_TIER,
    EXIT_STORAGE,
)

# The docs page of symptoms (mkdocs builds it as troubleshooting/); each error class has a section whose anchor is
# `anchor(class name)`, and tests/test_docs.py fails when one is missing.
TROUBLESHOOTING = "docs/troubleshooting.md"


def anchor(name: str) -> str:
    """A class name or a Kubernetes reason as a stable anchor: SpecError -> spec-error, TierOOM -> tier-oom."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", name).lower()


def docs_link(err: BaseException) -> str:
    """Where the docs explain `err` and its fix: the troubleshooting section named after its class."""
    return f"{TROUBLESHOOTING}#{anchor(type(err).__name__)}"


# A runner's exit code -> its troubleshooting section, for an ending whose error class is not known (a worker that
# failed before it could report one, a crash): the supervisor's last line then still points somewhere.
EXIT_DOCS = {
    EXIT_FAILED: "runner-crash",
    EXIT_CONFIG: "config-error",
    EXIT_STORAGE: "storage-error",
    EXIT_OOM_RETRY_TIER: "tier-oom",
    EXIT_OOM_LAST_TIER: "oom-last-tier",
}


def see(where: BaseException | str) -> str:
    """The line every error message ends with, the CLI's and the runner's: `see: docs/troubleshooting.md#<anchor>`
    for an error (its class's section) or a docs link already made."""
    return f"see: {where if isinstance(where, str) else docs_link(where)}"


class JobspecError(Exception):
    """Base error: `str(err)` is the message a user reads."""

    exit_code = EXIT_FAILED


class HintedValueError(ValueError):
    """A validator's error that carries its fix: the loader prints `hint` on the hint line."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


class ConfigError(JobspecError):
    """Bad input: a flag, a file that cannot be read, a value that makes no sense."""

    exit_code = EXIT_CONFIG


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec file: where it is and how to fix it."""

    path: str  # dotted field path, e.g. "training.global_batch"
    message: str
    line: int | None = None  # 1-based line in the YAML file, None when unknown
    hint: str | None = None
    source: str | None = None  # "--set" for overrides

    def format(self, file: str) -> str:
        where = self.source or (f"{file}:{self.line}" if self.line else file)
        text = f"{where}: {self.path or '<root>'}: {self.message}"
        if self.hint:
            text += f"\n    hint: {self.hint}"
        return text


@dataclass
class SpecError(ConfigError):
    """Every problem found in one spec file, reported together."""

    file: str
    issues: list[SpecIssue] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(str(self))

    def __str__(self) -> str:
        n = len(self.issues)
        head = f"{self.file}: {n} problem{'s' if n != 1 else ''} in the job spec"
        return "\n".join([head, *("  " + i.format(self.file) for i in self.issues)])


class ClusterError(JobspecError):
    """The Kubernetes API refused a request or could not be reached."""

    exit_code = EXIT_CLUSTER
