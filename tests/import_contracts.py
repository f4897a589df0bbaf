"""An import-linter contract for what import-linter's own contracts cannot see: private framework names.

import-linter's graph knows external packages only by their top-level name (`torch`, not `torch._utils`),
and an attribute such as `reducer._reset_state` is no import at all. So this contract reads the source of
every module of the root packages and reports, outside the allowed modules and packages (runner/internals/):

- an import of a private module of a framework: `from torch.distributed.fsdp._fully_shard import ...`,
  `import torch._dynamo`, or a private name from one: `from accelerate.state import _x`;
- an attribute `x._name` (one leading underscore) read or written on anything but `self`/`cls`, when no
  module of the root packages defines `_name` itself (so the project's own private helpers are not counted;
  `os._exit` and the like are listed in `allowed_names`).

Configured in pyproject.toml (`[tool.importlinter]`, contract type `private_names`), run by `lint-imports`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _sources(package: str) -> Iterator[tuple[str, Path]]:
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return
    for base in map(Path, spec.submodule_search_locations):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join((package, *parts))
            yield name.removesuffix(".__init__"), path


def _defined_private_names(trees: list[ast.AST]) -> set[str]:
    """Private names the project defines: functions, classes, assignments (`self._x = ...`, `_X = ...`)."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if _private(n)}


class PrivateNamesContract(Contract):
    type_name = "private_names"

    source_packages = fields.ListField(subfield=fields.StringField())
    frameworks = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField())
    allowed_names = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: object, verbose: bool) -> ContractCheck:
        frameworks = set(self.frameworks)  # type: ignore[arg-type]
        allowed_modules = set(self.allowed_modules)  # type: ignore[arg-type]
        allowed_names = set(self.allowed_names or ())  # type: ignore[arg-type]
        modules = [(name, path, ast.parse(path.read_text(), str(path)))
                   for package in self.source_packages for name, path in _sources(package)]  # type: ignore[attr-defined]  # fmt: skip
        own = _defined_private_names([tree for _, _, tree in modules])
        found: list[str] = []
        for name, _path, tree in modules:
            if any(name == allowed or name.startswith(allowed + ".") for allowed in allowed_modules):
                continue  # an allowed module, or a module of an allowed package
            for node in ast.walk(tree):
                where = f"{name}:{getattr(node, 'lineno', '?')}"
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    parts = node.module.split(".")
                    if parts[0] in frameworks:
                        if any(map(_private, parts)):
                            found.append(f"{where} imports {node.module}")
                        found += [f"{where} imports {node.module}.{a.name}" for a in node.names if _private(a.name)]
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        parts = alias.name.split(".")
                        if parts[0] in frameworks and any(map(_private, parts)):
                            found.append(f"{where} imports {alias.name}")
                elif isinstance(node, ast.Attribute) and _private(node.attr):
                    owner = node.value
                    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                        continue
                    if node.attr in own or node.attr in allowed_names:
                        continue
                    found.append(f"{where} uses .{node.attr} ({ast.unparse(node)})")
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for line in check.metadata["found"]:
            output.print_error(f"- {line}", bold=False)
        output.new_line()
        output.print(
            "Private framework names go through the runner/internals/ package only: add a function there, with why "
            "there is no public way and the versions it was checked on."
        )
