"""The CLI's start-up settings: pydantic's plugin search is off for the commands that run in-process only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from jobspec import cli
from tests.cli_helpers import cli as run_main

SFT = str(Path(__file__).resolve().parents[1] / "examples" / "sft_fast.yaml")
VAR = "PYDANTIC_DISABLE_PLUGINS"


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The variable's value while each command loads its spec."""
    values: list[str | None] = []
    load = cli._load

    def recording(args: Any) -> Any:
        values.append(os.environ.get(VAR))
        return load(args)

    monkeypatch.setattr(cli, "_load", recording)
    return values


@pytest.mark.parametrize("command", ["validate", "render", "plan"])
def test_spec_commands_skip_the_plugin_search_and_restore_the_environment(
    command: str, seen: list[str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VAR, raising=False)
    code, _ = run_main(command, SFT)
    assert code == 0 and seen == ["__all__"]
    assert VAR not in os.environ  # a caller of main() (these tests) gets its environment back


def test_a_value_the_user_set_stands(seen: list[str | None], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "logfire")
    assert run_main("validate", SFT)[0] == 0
    assert seen == ["logfire"] and os.environ[VAR] == "logfire"


def test_run_hands_the_runner_the_environment_as_given(seen: list[str | None], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VAR, raising=False)
    at_exec: list[str | None] = []

    def execv(path: str, argv: list[str]) -> None:
        at_exec.append(os.environ.get(VAR))
        raise SystemExit(0)

    monkeypatch.setattr(cli.os, "execv", execv)
    assert run_main("run", SFT)[0] == 0
    assert seen == [None] and at_exec == [None]
