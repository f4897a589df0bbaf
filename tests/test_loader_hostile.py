"""Hostile specs: a few hundred bytes must never cost minutes, a traceback or exit 1.

Alias bombs ("billion laughs"), nesting past the recursion limit (and past libyaml's C stack),
numbers past int64 or float range, oversized files: each is one located issue and exit 2, fast.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobspec.errors import SpecError
from jobspec.spec import safe_yaml
from jobspec.spec.loader import MAX_ISSUES, load_spec, parse_spec
from tests.cli_helpers import cli
from tests.cpu_clock import cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
GOOD = "name: demo\nmodel:\n  preset: tiny\ntraining:\n  global_batch: 8\n  steps: 10\nhardware:\n  vendor: cpu\n"
FAST_S = 1.0  # CPU seconds per hostile input, in-process (measured: < 0.05 s); CPU time: load cannot fail it
HOSTILE = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


def refused(text: str, overrides: tuple[str, ...] = ()) -> SpecError:
    """parse_spec must refuse `text` with located issues, within FAST_S."""
    with cpu_seconds() as spent, pytest.raises(SpecError) as info:
        parse_spec(text, "hostile.yaml", overrides)
    assert spent.seconds < FAST_S, f"{spent.seconds:.2f} s"
    err = info.value
    assert err.exit_code == 2 and err.issues
    assert all(i.line is not None or i.source or i.path == "" for i in err.issues), str(err)
    return err


# --- aliases ---------------------------------------------------------------------------------


def laughs(width: int, levels: int, flow: bool, indent: str = "") -> str:
    """`levels` anchors, each a list of `width` aliases of the one before: width**levels values."""
    lines = [f"{indent}l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        if flow:
            lines.append(f"{indent}l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
        else:
            lines.append(f"{indent}l{i}: &l{i}\n" + "".join(f"{indent}  - *l{i - 1}\n" for _ in range(width)).rstrip())
    return "\n".join(lines) + "\n"


@st.composite
def alias_bombs(draw: st.DrawFn) -> str:
    width = draw(st.integers(2, 12))
    levels = draw(st.integers(2, 12))
    bomb = laughs(width, levels, flow=draw(st.booleans()), indent="    ")
    top = f"*l{levels - 1}"
    place = draw(st.sampled_from(["labels", "unknown", "env", "list", "merge"]))
    if place == "labels":  # a dict[str, str] field: pydantic would walk every repeated value
        return GOOD + "scheduling:\n  labels:\n" + bomb
    if place == "unknown":
        return GOOD + "bomb:\n" + bomb
    if place == "env":
        return GOOD + "x:\n" + bomb + f"env:\n  FOO: {top}\n"
    if place == "list":
        return GOOD + "x:\n" + bomb + f"scheduling:\n  tolerations: {top}\n"
    return GOOD + "x:\n" + bomb.replace("&l0 [", "&l0 [{a: 1}, ") + "y:\n  <<: *l0\n"


@HOSTILE
@given(text=alias_bombs())
def test_alias_expansion_is_bounded(text: str) -> None:
    with cpu_seconds() as spent:
        try:
            parse_spec(text, "hostile.yaml")
        except SpecError as err:
            assert err.exit_code == 2 and err.issues
    assert spent.seconds < FAST_S


@pytest.mark.parametrize("flow", [True, False])
def test_billion_laughs_is_one_located_issue(flow: bool) -> None:
    err = refused(GOOD + "scheduling:\n  labels:\n" + laughs(9, 9, flow, "    "))
    issue = err.issues[0]
    assert f"{safe_yaml.MAX_NODES:,} values" in issue.message and issue.path.startswith("scheduling.labels.")
    assert issue.line is not None and issue.line > 9 and issue.hint


def test_recursive_and_undefined_aliases() -> None:
    assert "inside its own anchor" in refused(GOOD + "x: &a [1, *a]\n").issues[0].message
    assert "undefined alias" in refused(GOOD + "x: *nope\n").issues[0].message
    assert "duplicate anchor" in refused(GOOD + "x: &a 1\ny: &a 2\n").issues[0].message
    assert "a single document" in refused(GOOD + "---\nname: b\n").issues[0].message


def test_ordinary_anchors_and_merges_still_work() -> None:
    text = (
        GOOD + "scheduling:\n  annotations: &common {team: ml, tier: gpu}\n  labels:\n    <<: *common\n    tier: c!\n"
    )
    err = refused(text)  # the merge works, and the line is the one written here, not the anchor's
    assert [(i.path, i.line) for i in err.issues] == [("scheduling.labels.tier", 13)], str(err)
    spec = parse_spec(text.replace("c!", "cpu"))
    assert spec.scheduling.labels == {"team": "ml", "tier": "cpu"}


def test_node_limit_is_exact_and_aliases_count_what_they_repeat() -> None:
    n = safe_yaml.MAX_NODES - 3  # root mapping, key, sequence
    assert len(safe_yaml.load("a: [" + ", ".join(["1"] * n) + "]")[0]["a"]) == n
    with pytest.raises(safe_yaml.YamlLimit):
        safe_yaml.load("a: [" + ", ".join(["1"] * (n + 1)) + "]")
    anchored = "x: &a [" + ", ".join("1" * 10) + "]\n"  # 11 nodes, repeated by each *a
    k = (safe_yaml.MAX_NODES - 15) // 11 + 1
    with pytest.raises(safe_yaml.YamlLimit):
        safe_yaml.load(anchored + "y: [" + ", ".join(["*a"] * k) + "]")
    safe_yaml.load(anchored + "y: [" + ", ".join(["*a"] * (k - 1)) + "]")


@pytest.mark.parametrize(
    "entry",
    [
        "    key{i}abcdef: value{i}\n",  # under a secret name: every key may be the credential
        "    k{i}: [1]\n",  # wrong type, once per key
    ],
)
def test_thousands_of_errors_are_listed_briefly_and_fast(entry: str) -> None:
    head = "env:\n  HF_TOKEN:\n" if "abcdef" in entry else "scheduling:\n  labels:\n"
    text = GOOD + head + "".join(entry.format(i=i) for i in range(16_000))
    with cpu_seconds() as compose:
        safe_yaml.load(text)  # the yardstick: composing 600 KB of YAML, on this machine under its load now
    with cpu_seconds() as spent, pytest.raises(SpecError) as info:
        parse_spec(text, "many.yaml")
    # measured 2.0x compose (secret names), 1.4-1.8x (wrong types)
    assert spent.seconds < 4 * compose.seconds + FAST_S, (
        f"{spent.seconds:.2f} s, compose {compose.seconds:.2f} s"
    )
    err = info.value
    assert len(err.issues) <= MAX_ISSUES + 1 and "more problems not shown" in err.issues[-1].message


# --- nesting ---------------------------------------------------------------------------------


@st.composite
def deep_nesting(draw: st.DrawFn) -> tuple[str, tuple[str, ...]]:
    depth = draw(st.integers(safe_yaml.MAX_DEPTH + 1, 20_000))
    kind = draw(st.sampled_from(["seq", "map", "mixed"]))
    opens = "".join("[" if kind == "seq" or (kind == "mixed" and i % 2) else "{a: " for i in range(depth))
    value = opens + "1" + "".join("]" if c == "[" else "}" for c in reversed(opens.replace("{a: ", "{")))
    where = draw(st.sampled_from(["env", "labels", "unknown", "set"]))
    if where == "set":
        return GOOD, (f"env.X={value}",)
    key = {"env": "env:\n  X: ", "labels": "scheduling:\n  labels: ", "unknown": "deep: "}[where]
    return GOOD + key + value + "\n", ()


# Found by a fresh seed: `[` on one line, 999 deep. libyaml's scanner reads ahead past its own 1000-level
# limit before the composer saw 65 levels ("not valid YAML: exceeded maximum nesting depth"), and a --set
# value it could not parse became the text of an env var.
_LIBYAML_DEPTH = "[" * 999 + "1" + "]" * 999


@HOSTILE
@given(case=deep_nesting())
@example(case=(GOOD + "env:\n  X: " + _LIBYAML_DEPTH + "\n", ()))
@example(case=(GOOD, ("env.X=" + _LIBYAML_DEPTH,)))
def test_deep_nesting_is_refused_not_a_recursion_error(case: tuple[str, tuple[str, ...]]) -> None:
    text, overrides = case
    err = refused(text, overrides)
    assert any(f"more than {safe_yaml.MAX_DEPTH} levels" in i.message for i in err.issues), str(err)


def test_nesting_that_crashes_libyaml_composer_is_refused() -> None:
    # yaml.compose(..., Loader=CSafeLoader) overflows the C stack (SIGSEGV) on this; we never call it.
    refused(GOOD + "x: " + "[" * 200_000 + "]" * 200_000 + "\n")


def test_deep_key_path_in_set_is_refused() -> None:
    err = refused(GOOD, ("scheduling.labels." + ".".join(["a"] * 5000) + "=1",))
    assert "nests at most" in err.issues[0].message and err.issues[0].source


def test_alias_of_deep_value_counts_its_depth() -> None:
    deep = "[" * 40 + "1" + "]" * 40  # 40 levels, used 40 levels down: 80 in all
    refused(GOOD + f"a: &d {deep}\nb: " + "[" * 40 + "*d" + "]" * 40 + "\n")


# --- numbers ---------------------------------------------------------------------------------

NUMERIC_FIELDS = [
    "training.steps",
    "training.global_batch",
    "training.seed",
    "training.learning_rate",
    "training.epochs",
    "hardware.memory",
    "hardware.shm_size",
    "hardware.cpu",
    "hardware.gpus",
    "hardware.gpus.memory",
    "hardware.nodes",
    "data.max_seq_len",
    "scheduling.active_deadline_seconds",
    "memory.target_utilization",
]


@st.composite
def huge_numbers(draw: st.DrawFn) -> str:
    sign = draw(st.sampled_from(["", "-", "+"]))
    digits = draw(st.integers(20, 6000))
    return draw(
        st.sampled_from(
            [
                sign + "9" * digits,  # an int past int64 (and past Python's 4300-digit str->int limit)
                f"{sign}1.0e+{draw(st.integers(309, 99999))}",  # a float that overflows to inf
                f"{sign}1.5e+{draw(st.integers(309, 99999))}",
                sign + ".inf",
                ".nan",
                # a size string; M, not m: 20 nines of milli-bytes are 100 PB, a size a quantity may hold
                "'" + "9" * digits + draw(st.sampled_from(["", "Gi", "GB", "Ei", "k", "M"])) + "'",
                "'" + "9" * digits + "." + "9" * digits + "Gi'",
                f"'1e{draw(st.integers(309, 9999))}Gi'",
                f"'H100:{'9' * digits}'",
                str(2**63 + draw(st.integers(0, 2**70))),
            ]
        )
    )


def with_value(field: str, value: str) -> str:
    """GOOD with `field: value` written in (a flow mapping for the deeper keys)."""
    section, _, rest = field.partition(".")
    keys = rest.split(".")
    line = "  " + ": {".join(keys) + f": {value}" + "}" * (len(keys) - 1) + "\n"
    if f"  {keys[0]}: " in GOOD and len(keys) == 1:
        return "".join(line if ln.startswith(f"  {keys[0]}: ") else ln for ln in GOOD.splitlines(keepends=True))
    if f"{section}:\n" in GOOD:
        return GOOD.replace(f"{section}:\n", f"{section}:\n{line}", 1)
    return GOOD + f"{section}:\n{line}"


@HOSTILE
@given(field=st.sampled_from(NUMERIC_FIELDS), value=huge_numbers(), via_set=st.booleans())
def test_huge_numbers_are_located_issues(field: str, value: str, via_set: bool) -> None:
    err = refused(GOOD, (f"{field}={value}",)) if via_set else refused(with_value(field, value))
    section = field.split(".")[0]
    assert any(i.path.startswith(section) for i in err.issues), str(err)
    if via_set:
        assert any(i.source == f"--set {field}=..." for i in err.issues), str(err)
    else:
        assert all(i.line for i in err.issues), str(err)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("  memory: 1e400Gi", "not a size"),
        ("  memory: " + "9" * 400 + "Gi", "too large"),
        ("  memory: 1.0e+400", "not a finite number"),
        ("  memory: " + "9" * 5000, "5,000 characters"),
        ("  memory: 99999999999999999999", "out of range"),
        ("  shm_size: 9Ei", "too large"),
        ("  cpu: 1.0e+400", "not a finite number"),
        ("  gpus: H100:" + "9" * 5000, "at most 64"),
    ],
)
def test_size_parser_never_overflows(line: str, words: str) -> None:
    err = refused(GOOD + line + "\n")
    assert words in str(err) and "hostile.yaml:9: hardware." in str(err)


def test_huge_global_batch_does_not_hang_the_divisor_search() -> None:
    err = refused(GOOD.replace("global_batch: 8", "global_batch: 1000000000000\n  micro_batch: 7"))
    assert err.issues[0].path == "training.global_batch"


# --- size ------------------------------------------------------------------------------------


def test_oversized_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text(GOOD + "# " + "x" * (safe_yaml.MAX_BYTES + 10) + "\n")
    with cpu_seconds() as spent, pytest.raises(SpecError, match="more than 1 MiB"):
        load_spec(big)
    assert spent.seconds < FAST_S
    assert "more than 1 MiB" in refused(GOOD + "# " + "x" * (safe_yaml.MAX_BYTES + 10)).issues[0].message
    assert "1 MiB" in refused(GOOD, ("env.X=" + "x" * (safe_yaml.MAX_BYTES + 1),)).issues[0].message


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_endless_input_is_refused() -> None:
    with pytest.raises(SpecError, match="more than 1 MiB"):
        load_spec("/dev/zero")


def test_large_legitimate_spec_loads_fast() -> None:
    env = "".join(f"  VAR_{i}: value-{i}\n" for i in range(5000))
    with cpu_seconds() as spent:
        spec = parse_spec(GOOD + "env:\n" + env)
    assert len(spec.env) == 5000 and spent.seconds < 3 * FAST_S


# --- the parser itself -----------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63) + 1, 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(data=documents, flow=st.booleans())
def test_bounded_composer_reads_what_pyyaml_reads(data: Any, flow: bool) -> None:
    shared = [data, data]  # yaml.dump writes shared objects as an anchor and aliases
    text = yaml.safe_dump({"a": data, "b": shared}, default_flow_style=flow, allow_unicode=True)
    assert safe_yaml.load(text)[0] == yaml.safe_load(text)


# --- every entry point -----------------------------------------------------------------------


@pytest.fixture()
def hostile_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "laughs": GOOD + "scheduling:\n  labels:\n" + laughs(9, 9, True, "    "),
        "deep": GOOD + "env:\n  X: " + "[" * 5000 + "]" * 5000 + "\n",
        "digits": GOOD.replace("steps: 10", "steps: " + "9" * 5000),
        "size": GOOD + "  memory: " + "9" * 400 + "Gi\n",
        "long_name": GOOD.replace("name: demo", "name: " + "a" * 1_000_000),  # hung validate/render/plan > 60 s
        "long_key": GOOD + "env:\n  ? " + "K" * 1_000_000 + "\n  : x\n",
        "long_url": GOOD + "tracking:\n  mlflow:\n    tracking_uri: https://" + "a" * 1_000_000 + "\n",
    }
    out = {}
    for name, text in files.items():
        out[name] = tmp_path / f"{name}.yaml"
        out[name].write_text(text)
    return out


@pytest.mark.parametrize("command", ["validate", "render", "plan"])
def test_cli_exit_2_fast_for_every_hostile_file(command: str, hostile_files: dict[str, Path]) -> None:
    for name, path in hostile_files.items():
        with cpu_seconds() as spent:  # late in the suite a full collection alone took 1.9 s of a refusal
            code, text = cli(command, str(path))
        assert code == 2, (name, text)
        assert f"{path}:" in text and "Traceback" not in text, (name, text)
        assert spent.seconds < FAST_S, name


def test_cli_subprocess_billion_laughs(hostile_files: dict[str, Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "jobspec", "validate", str(hostile_files["laughs"])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "50,000 values" in result.stderr


def test_runner_supervisor_exits_2(hostile_files: dict[str, Path], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from runner.process.supervisor import main as supervisor_main

    term = tmp_path / "termination-log"
    monkeypatch.setenv("JOBSPEC_TERMINATION_LOG", str(term))
    for name, path in hostile_files.items():
        assert supervisor_main([str(path)]) == 2, name
        assert '"exit_code": 2' in term.read_text()


def test_runner_worker_exits_2(hostile_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from runner.process.worker import main as worker_main

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "JOBSPEC_STATUS_FILE"):
        monkeypatch.delenv(key, raising=False)
    for name, path in hostile_files.items():
        assert worker_main([str(path)]) == 2, name


def test_the_spec_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = safe_yaml.Loader

    def counting(text: str) -> Any:
        calls.append(text)
        return real(text)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a second pure-Python parse")

    monkeypatch.setattr(safe_yaml, "Loader", counting)
    for name in ("safe_load", "load", "compose", "compose_all", "safe_load_all"):
        monkeypatch.setattr(yaml, name, forbidden)
    with pytest.raises(SpecError) as info:
        parse_spec(GOOD + "  nodes: 0\n")
    assert info.value.issues[0].line == 9
    assert [c for c in calls if c] == [GOOD + "  nodes: 0\n"]  # one parser over the text (and one constructor)
    assert real is getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when it is installed
