"""`to_yaml` writes with libyaml only where the text is byte for byte what PyYAML's emitter writes."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobspec.render import output as out
from jobspec.render import render
from jobspec.spec.loader import load_spec

ROOT = Path(__file__).resolve().parents[1]
needs_libyaml = pytest.mark.skipif(out._CDumper is None, reason="PyYAML without its C extension")


def _python_emitter(objs: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.dump(obj, Dumper=out._Dumper, sort_keys=False) for obj in objs)


@needs_libyaml
@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_take_the_libyaml_path_and_keep_their_bytes(path: Path) -> None:
    objs = render(load_spec(path))
    assert out._same_in_both(objs)
    assert out.to_yaml(objs) == _python_emitter(objs)


@needs_libyaml
@pytest.mark.parametrize(
    "text",
    [
        "Café " * 30,  # double-quoted (escapes) and long: libyaml wraps it elsewhere
        "word " * 40 + "\t",  # a tab
        "",  # an empty key: libyaml writes `''`, PyYAML `? ''`
        "line\n\n",  # a `|+` block: libyaml ends the document with `...`
        " leading space",
        "trailing space ",
        "block\nwith a trailing space \n",
        "block without a final newline\nx",
    ],
)
def test_strings_the_emitters_write_differently_take_the_python_path(text: str) -> None:
    objs = [{"metadata": {"annotations": {"note": text}}}, {text: 1}]
    assert not out._same_in_both(objs)
    assert out.to_yaml(objs) == _python_emitter(objs)


def _random_strings(rng: random.Random) -> str:
    pieces = [*map(chr, range(0x20, 0x7F)), "word", ": ", " #", "- ", "'", '"', "? ", "&a", "*b", "!t", "x" * 30]
    pieces += ["true", "null", "0x1", "1e3", "---", "...", "  ", "~", "<<", "12:30", "-x", "x:", "[x]", "{x}"]

    def line() -> str:
        n = rng.choice([1, 2, 4, 8, 16, 40, 70, 90, 150, 300])
        return "".join(rng.choice(pieces) for _ in range(n))[:n]

    while True:
        if rng.random() < 0.25:
            lines = [" " * rng.choice([0, 0, 2, 4]) + line() if rng.random() < 0.85 else "" for _ in range(6)]
            text = "\n".join(lines) + "\n"
        else:
            text = line()
        if out._same_in_both(text):
            return text


@needs_libyaml
def test_the_emitters_agree_on_every_string_the_check_lets_through() -> None:
    rng = random.Random(0)

    def value(depth: int) -> Any:
        kind = rng.random()
        if depth < 6 and kind < 0.3:
            return {_random_strings(rng): value(depth + 1) for _ in range(rng.randint(0, 4))}
        if depth < 6 and kind < 0.4:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        if kind < 0.5:
            return rng.choice([1, -5, 3.5, True, False, None, 10**20, 1e-7, 29500])
        return _random_strings(rng)

    for _ in range(2000):
        objs = [{"kind": "ConfigMap", "data": {"spec.yaml": yaml.safe_dump(value(0))}, "x": value(0)}]
        if out._same_in_both(objs):
            assert out.to_yaml(objs) == _python_emitter(objs)
