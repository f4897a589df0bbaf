"""The README stays true: its spec reference is the generated one, its commands exist."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from jobspec.spec.reference import markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_spec_reference_is_generated() -> None:
    section = re.search(r"<!-- SPEC-REFERENCE:START -->\n(.*)<!-- SPEC-REFERENCE:END -->", README, re.S)
    assert section, "README lost its spec reference markers"
    assert section.group(1).strip() == markdown().strip(), (
        "README spec reference is stale: run `python tests/test_readme.py` to regenerate it"
    )


def test_quick_start_commands_come_first() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert "jobspec run examples/quickstart.yaml" in blocks[0]
    assert "pytest" in blocks[1] and "torch==2.13.0" in blocks[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pytest" in ci and "torch==2.13.0" in ci


def _summary(path: Path) -> str:
    """The first sentence of a module's (or a package's __init__) docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    para = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s", para, maxsplit=1)[0]


def layout() -> str:
    """README's "How the code is laid out", from the import-linter layers in pyproject.toml and the docstrings:
    every package and top-level module, top layer first; a layer's siblings (`|`) may not import each other."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = []
    for root in config["root_packages"]:
        layers = next(
            c["layers"] for c in config["contracts"] if c["type"] == "layers" and c["layers"][0].startswith(root + ".")
        )
        lines += ["", f"{root}/  {_summary(ROOT / root / '__init__.py')}"]
        named = set()
        for depth, layer in enumerate(layers, 1):
            for name in (n.strip() for n in layer.split("|")):
                named.add(name)
                rel = Path(*name.split("."))
                if (ROOT / rel).is_dir():
                    path, shown = rel / "__init__.py", f"{rel.name}/"
                else:
                    path, shown = rel.with_suffix(".py"), f"{rel.name}.py"
                lines.append(f"  {depth}. {shown:<14} {_summary(ROOT / path)}")
        for path in sorted((ROOT / root).glob("*.py")):
            if f"{root}.{path.stem}" not in named and path.stem != "__init__":
                lines.append(f"     {path.name:<14} {_summary(path)}")
    return "```\n" + "\n".join(lines).strip("\n") + "\n```"


def test_layout_section_is_the_generated_one() -> None:
    section = re.search(r"<!-- LAYOUT:START -->\n(.*)<!-- LAYOUT:END -->", README, re.S)
    assert section, "README lost its layout markers"
    assert section.group(1).strip() == layout(), "README layout is stale: run `python tests/test_readme.py`"


def test_every_package_is_in_a_layer() -> None:
    """A new package must be placed in the layers (pyproject.toml), else lint-imports would not check it."""
    text = layout()
    for root in ("jobspec", "runner"):
        for pkg in sorted(p.parent for p in (ROOT / root).glob("*/__init__.py")):
            assert f" {pkg.name}/ " in text, f"{root}/{pkg.name}/ is in no import-linter layer"


def test_source_files_named_in_readme_exist() -> None:
    """A file the README points a reader to is where it says (the layout moves; the prose must follow)."""
    named = set(re.findall(r"\b((?:runner|jobspec|tests|bench|images|\.ci)/[\w/.-]+\.(?:py|sh|json))\b", README))
    missing = sorted(n for n in named if not (ROOT / n).is_file() and "/out/" not in n)
    assert not missing, missing


def test_examples_named_in_readme_exist() -> None:
    for name in set(re.findall(r"examples/([\w.]+\.yaml)", README)):
        assert (ROOT / "examples" / name).is_file(), name


if __name__ == "__main__":  # regenerate the section
    text = re.sub(
        r"(<!-- SPEC-REFERENCE:START -->\n).*(<!-- SPEC-REFERENCE:END -->)",
        lambda m: m.group(1) + markdown().strip() + "\n" + m.group(2),
        README,
        flags=re.S,
    )
    text = re.sub(
        r"(<!-- LAYOUT:START -->\n).*(<!-- LAYOUT:END -->)",
        lambda m: m.group(1) + layout() + "\n" + m.group(2),
        text,
        flags=re.S,
    )
    (ROOT / "README.md").write_text(text)
