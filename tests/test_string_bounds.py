"""Strings are measured before they are parsed: a million characters anywhere (any field, any key,
a --set item) is one located issue naming the field and the limit, in milliseconds, exit 2.

Before this bound, a 1,000,000-character `name` kept `jobspec validate`, `render` and `plan` busy for
over 90 s (the credential scan's URL pattern rescanned the text from every position: quadratic).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobspec.errors import SpecError
from jobspec.spec import safe_yaml
from jobspec.spec.credentials import credential_kind, is_secret_name, redact
from jobspec.spec.loader import MAX_KEY_PATH_CHARS, parse_spec
from jobspec.spec.models import MAX_IMAGE_CHARS, MAX_PATH_CHARS, JobSpec
from tests.cli_helpers import cli
from tests.cpu_clock import cpu_seconds
from tests.spec_fields import dotted, leaves, spec_with, to_yaml

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
FAST_S = 1.0  # CPU seconds per input, in-process (measured: 0.02 s for a million characters)
HUGE = 1_000_000
LEAVES = leaves()
# The fields that take the longest text the reader admits; every other text field has a lower limit.
FULL_LENGTH = {"env.X", "scheduling.annotations.X", "scheduling.labels.X", "scheduling.node_selector.X"}


def refused(text: str, overrides: tuple[str, ...] = ()) -> SpecError:
    with cpu_seconds() as spent, pytest.raises(SpecError) as info:
        parse_spec(text, "long.yaml", overrides)
    assert spent.seconds < FAST_S
    assert info.value.exit_code == 2
    return info.value


def test_every_field_is_walked() -> None:
    texts = {dotted(loc) for loc, kind in LEAVES if kind == "str"}
    assert {"name", "image.name", "data.path", "tracking.mlflow.tracking_uri", "env.X", "env.X.key"} <= texts
    assert {dotted(loc) for loc, kind in LEAVES if kind == "key"} == {
        "env", "scheduling.labels", "scheduling.annotations", "scheduling.node_selector",
    }  # fmt: skip


@pytest.mark.parametrize(("loc", "kind"), LEAVES, ids=[dotted(loc) for loc, _ in LEAVES])
def test_a_million_characters_in_any_field_is_refused_fast(loc: tuple, kind: str) -> None:
    """In the file (value or key), and through --set: one issue at the field, with the limit."""
    err = refused(to_yaml(spec_with(loc, "a" * HUGE, kind)))
    path = dotted(loc)
    issue = next(i for i in err.issues if i.path == path)  # the key itself is never quoted
    assert f"{HUGE:,} characters" in issue.message and "at most" in issue.message, issue
    assert issue.line is not None and "aaaaaa" not in str(err)
    if kind == "key":
        err = refused(to_yaml(spec_with(loc, "v", "str")), (f"{path}.{'a' * HUGE}=v",))
        assert "characters in the key path" in str(err) and "aaaaaa" not in str(err)
    else:
        err = refused(to_yaml(spec_with(loc, "v" if kind == "str" else 1)), (f"{dotted(loc)}={'a' * HUGE}",))
        assert any(i.path.startswith(dotted(loc[:1])) and "at most" in i.message for i in err.issues), str(err)
        assert "aaaaaa" not in str(err)


@pytest.mark.parametrize(
    ("loc", "kind"), [(loc, kind) for loc, kind in LEAVES if kind == "str"], ids=lambda x: dotted(x) if x else ""
)
def test_every_text_field_has_its_own_limit(loc: tuple, kind: str) -> None:
    """Below the reader's bound, the field's own limit speaks (a Kubernetes name 50 or 63, a path 4096, ...)."""
    value = "a" * safe_yaml.MAX_STRING_CHARS
    if dotted(loc) in FULL_LENGTH:
        data = spec_with(loc, value + "a")  # past the reader: the model's own bound, for callers that skip YAML
        with pytest.raises(ValueError, match="at most 16384 characters"):
            JobSpec.model_validate(data)
        return
    err = refused(to_yaml(spec_with(loc, value)))
    issue = next(i for i in err.issues if i.path == dotted(loc))
    assert "at most" in f"{issue.message} {issue.hint}", issue
    assert "aaaaaa" not in str(err)


@pytest.mark.parametrize(
    ("field", "limit"),
    [("name", 50), ("namespace", 63), ("image.name", MAX_IMAGE_CHARS), ("data.path", MAX_PATH_CHARS),
     ("hardware.gpus.type", 64), ("scheduling.priority_class", 253), ("tracking.run_name", 256)],
)  # fmt: skip
def test_limits_are_exact(field: str, limit: int) -> None:
    loc = tuple(field.split("."))
    over = refused(to_yaml(spec_with(loc, "a" * (limit + 1))))
    assert any(i.path == field and str(limit) in f"{i.message} {i.hint}" for i in over.issues), str(over)
    try:
        parse_spec(to_yaml(spec_with(loc, "a" * limit)))
    except SpecError as err:  # the value may break another rule; never its length
        assert not any(i.path == field and "at most" in i.message for i in err.issues), str(err)


def test_keys_and_unknown_keys_are_bounded() -> None:
    long = "K" * HUGE
    for text in (f"{long}: 1\n", f"env:\n  {long}: x\n", f"training:\n  {long}: 1\n", f"? {long}\n: 1\n",
                 f"env: {{{long}: x}}\n", f"'{long}': 1\n"):  # fmt: skip
        err = refused(to_yaml(spec_with(("name",), "demo")) + text)
        # A plain key over 1024 characters is no key to libyaml: a long line, or a long value, where it stands.
        assert f"{HUGE:,} characters" in str(err) or "where a key was expected" in str(err), str(err)
        assert "KKKKKK" not in str(err) and err.issues[0].line is not None
    err = refused("name: demo\n", (f"env.{'K' * (safe_yaml.MAX_KEY_CHARS + 1)}=1",))
    assert "characters in the key path" in str(err) and "KKKKKK" not in str(err)


def test_set_values_are_bounded_whatever_their_shape() -> None:
    base = to_yaml(spec_with(("name",), "demo"))
    for raw in ("a" * HUGE, "[" + "a" * HUGE, "{a: " + "b" * HUGE + "}", "'" + "a" * HUGE + "'", "9" * HUGE):
        err = refused(base, (f"env.X={raw}",))
        assert f"{HUGE:,}" in str(err) or "1 MiB" in str(err), str(err)[:300]
        assert "aaaaaa" not in str(err) and "bbbbbb" not in str(err) and "999999" not in str(err)
    err = refused(base, ("a" * HUGE,))  # no '=' at all: never echoed
    assert "aaaaaa" not in str(err)
    assert len(str(refused(base, ("." * (MAX_KEY_PATH_CHARS + 1) + "=1",)))) < 1000  # a longer path is not named


# --- the scanners themselves are linear --------------------------------------------------------

SHAPES = ["a", "a1", "-", "a:", "x://", "https://h/a", "sk-", "eyJ", "Bearer ", "a=", "?token=", '"a":', "a b ",
          "/a", "@", "hooks/", "A1b2C3d4", "hf_", "--a", "AKIA", "%", "xoxb-", "Basic "]  # fmt: skip


@pytest.mark.parametrize("unit", SHAPES)
def test_credential_scans_are_linear(unit: str) -> None:
    """A repeated shape that a backtracking pattern would rescan from every position: 200,000 characters
    in well under a second (a quadratic scan takes minutes)."""
    text = (unit * (200_000 // len(unit) + 1))[:200_000]
    with cpu_seconds() as spent:
        credential_kind(text, hex40=True)
        redact(text, token_like=True)
        is_secret_name(text)
    assert spent.seconds < 2 * FAST_S


# --- the commands ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_name(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("long") / "long_name.yaml"
    path.write_text(to_yaml(spec_with(("name",), "a" * HUGE)))
    return path


@pytest.mark.parametrize("command", ["validate", "render", "plan"])
def test_commands_refuse_a_million_character_name_in_milliseconds(command: str, long_name: Path) -> None:
    with cpu_seconds() as spent:
        code, out = cli(command, str(long_name))
    assert spent.seconds < FAST_S
    assert code == 2 and f"{long_name}:" in out and ": name: " in out and "16,384" in out, out
    assert "aaaaaa" not in out and "Traceback" not in out
    code, out = cli(command, str(QUICKSTART), "--set", f"name={'a' * HUGE}")
    assert code == 2 and "name" in out and "aaaaaa" not in out, out[:500]


def test_the_command_line_returns_within_seconds(long_name: Path) -> None:
    """The whole process, start-up included (was: still running after 90 s)."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "jobspec", "validate", str(long_name)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "name" in result.stderr, result.stderr[:500]
    assert time.monotonic() - start < 20  # start-up on a loaded 2-core machine; the refusal itself is ~20 ms
