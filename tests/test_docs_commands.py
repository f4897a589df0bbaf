"""The `docs` tier: every shell block and YAML spec on the docs pages runs or validates, so a page cannot drift.

- a YAML block with `name:` and `model:` is a whole spec: `jobspec validate` must accept it; other YAML must parse;
- every `jobspec validate|plan|render|init|schema` line of a shell block runs (from a scratch directory that holds
  `examples/`), and exits 0 unless an `<!-- exit: N -->` comment before the block says N;
- a block after `<!-- docs: run -->` runs whole in bash (a short `jobspec run` where the page says so);
- a block after `<!-- needs: cluster -->`, `gpu` or `network` is checked for syntax only (`bash -n`), and a block that
  talks to a cluster (kubectl, submit, status, logs, cancel) without saying so fails the test; every other line of a
  block is syntax-checked.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.cli_helpers import cli

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OFFLINE = ("validate", "plan", "render", "init", "schema")
CLUSTER = re.compile(r"\bkubectl\b|\bkind\b|\bjobspec (submit|status|logs|cancel|list)\b")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str
    marks: tuple[str, ...]  # "needs: cluster", "exit: 2", "docs: run", ...

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def mark(self, key: str) -> str | None:
        return next((m.split(":", 1)[1].strip() for m in self.marks if m.startswith(key + ":")), None)


def blocks() -> list[Block]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"```(\w+)", lines[i])
            if not m:
                i += 1
                continue
            marks, j = [], i - 1
            while j >= 0 and (lines[j].startswith("<!--") or not lines[j].strip()):
                marks += re.findall(r"<!--\s*(.*?)\s*-->", lines[j])
                j -= 1
            end = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            text = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Block(str(page.relative_to(DOCS)), i + 1, m[1], text, tuple(marks)))
            i = end + 1
    return found


SHELL = [b for b in blocks() if b.lang in ("bash", "sh", "shell")]
YAML = [b for b in blocks() if b.lang == "yaml"]


def commands(text: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with the repository's examples (a command may write a spec next to them)."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "jobspec").symlink_to(ROOT / "jobspec")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.id)
def test_shell_block(block: Block, scratch: Path) -> None:
    syntax = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    assert syntax.returncode == 0, f"{block.id}: {syntax.stderr}"
    needs = block.mark("needs")
    if CLUSTER.search(block.text) and needs != "cluster":
        pytest.fail(f"{block.id} talks to a cluster: put <!-- needs: cluster --> before it")
    if block.mark("docs") == "run":
        done = subprocess.run(["bash", "-e", "-c", block.text], capture_output=True, text=True, cwd=scratch,
                              env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(scratch)},
                              timeout=120)  # fmt: skip
        assert done.returncode == int(block.mark("exit") or 0), f"{block.id}:\n{done.stdout}\n{done.stderr}"
        return
    expected = int(block.mark("exit") or 0)
    for line in commands(block.text):
        first = line.split("|")[0].split("&&")[0].strip()
        if not first.startswith("jobspec "):
            continue
        argv = shlex.split(first, comments=True)
        if len(argv) >= 2 and argv[0] == "jobspec" and argv[1] in OFFLINE:
            code, said = cli(*argv[1:])
            assert code == expected, f"{block.id}: `{first}` exited {code}:\n{said}"


@pytest.mark.parametrize("block", YAML, ids=lambda b: b.id)
def test_yaml_block(block: Block, scratch: Path) -> None:
    data = yaml.safe_load(block.text)
    if isinstance(data, dict) and "name" in data and "model" in data:
        spec = scratch / "spec.yaml"
        spec.write_text(block.text)
        code, said = cli("validate", str(spec))
        assert code == 0, f"{block.id}: the spec does not validate:\n{said}"


def test_the_tier_finds_the_blocks() -> None:
    """The extraction itself: the pages' blocks are seen, the quick start's commands among them."""
    assert len(SHELL) >= 8 and len(YAML) >= 3
    assert any("jobspec run examples/quickstart.yaml" in b.text for b in SHELL)
    assert any(b.mark("needs") == "cluster" for b in SHELL)
