"""How the package imports: no import circles, and a CLI start that loads only what the command uses."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SFT = str(ROOT / "examples" / "sft_fast.yaml")


def _import_graph() -> dict[str, set[str]]:
    """Module -> the jobspec modules it imports anywhere: top level, TYPE_CHECKING blocks, functions."""
    modules = {}
    for path in (ROOT / "jobspec").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name and t != "jobspec"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n, [n]))), None)


def test_rules_never_imports_the_spec() -> None:
    graph = _import_graph()
    assert "jobspec.spec.rules" in graph["jobspec.spec.models"]
    assert "jobspec.spec.models" not in graph["jobspec.spec.rules"]  # not even under TYPE_CHECKING: it reads a protocol


def test_the_package_has_no_import_circle() -> None:
    assert _cycle(_import_graph()) is None, f"import circle: {' -> '.join(_cycle(_import_graph()) or [])}"


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("command", ["validate", "render", "plan"])
def test_spec_commands_load_only_what_they_use(command: str) -> None:
    code = (
        "import sys, io, contextlib\n"
        "from jobspec.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rc = main([{command!r}, {SFT!r}])\n"
        "unused = ('jobspec.cluster.kubeconfig', 'jobspec.cluster.client', 'jobspec.spec.reference',\n"
        "          'jobspec.report',\n"
        "          'jobspec.plan.compare', 'difflib', 'kubernetes', 'urllib3', 'torch')\n"
        "print(rc, sorted(m for m in unused if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "0 []"


def _bench():  # bench/cli_startup.py, imported from its path
    spec = importlib.util.spec_from_file_location("cli_startup", ROOT / "bench" / "cli_startup.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_startup_bench_interleaves_and_reports_cpu_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bench = _bench()
    order: list[str] = []
    real = bench.time_once

    def recording(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
        order.append(argv[-1])
        return real(argv, env)

    monkeypatch.setattr(bench, "time_once", recording)
    cmds = {name: [sys.executable, "-c", f"x = {i}"] for i, name in enumerate("abc")}
    samples = bench.measure(cmds, runs=3, pycache=str(tmp_path))
    assert order[:3] == ["x = 0", "x = 1", "x = 2"]  # the warm-up
    rounds = [order[3 + 3 * r : 6 + 3 * r] for r in range(3)]
    assert rounds == [["x = 0", "x = 1", "x = 2"], ["x = 1", "x = 2", "x = 0"], ["x = 2", "x = 0", "x = 1"]]
    for runs in samples.values():
        assert len(runs) == 3 and all(wall > 0 and cpu > 0 for wall, cpu in runs)


@pytest.mark.parametrize(("package", "most"), [("runner", 6), ("jobspec", 8)])
def test_few_modules_at_the_top(package: str, most: int) -> None:
    """Concepts live in folders (docs/development.md, "How the code is laid out"); the top holds entry points and base
    modules."""
    top = sorted(p.name for p in (ROOT / package).glob("*.py"))
    assert len(top) <= most, f"{package}/ has {len(top)} top-level modules: {top}; put the new one in a folder"
