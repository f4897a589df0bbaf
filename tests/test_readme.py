"""The README stays short and true: what jobspec is, the two commands CI runs, links into the docs site that resolve.
Everything else lives in docs/ (tests/test_docs.py keeps its generated pages current: the spec reference, the CLI,
the errors, the layout of the code). `python tests/test_readme.py` regenerates those pages, as it regenerated the
README's sections before they moved there."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python tests/test_readme.py`
    sys.path.insert(0, str(ROOT))

README = (ROOT / "README.md").read_text()
MAX_LINES = 200  # a front page: what it is, the two commands, an example, links; the rest is docs/
# The text a reader is pointed to: the README and every page of the site.
DOCS_TEXT = {"README.md": README} | {
    str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))
}


def test_readme_stays_short() -> None:
    lines = len(README.splitlines())
    assert lines < MAX_LINES, f"README.md has {lines} lines: keep it under {MAX_LINES}, move the detail to docs/"


def test_quick_start_commands_come_first() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert "jobspec run examples/quickstart.yaml" in blocks[0]
    assert "pytest" in blocks[1] and "torch==2.13.0" in blocks[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pytest" in ci and "torch==2.13.0" in ci


def test_readme_links_into_the_docs_resolve() -> None:
    """Every `docs/PAGE.md#anchor` link of the README names a page and a heading that exist (mkdocs checks the
    site's own links; the README is not part of the site)."""
    from tests.test_docs import anchors

    links = re.findall(r"\]\((docs/[\w/.-]+\.md)(?:#([\w-]+))?\)", README)
    assert len(links) >= 10, "the README should point into the docs for everything it leaves out"
    for page, frag in links:
        assert (ROOT / page).is_file(), page
        assert not frag or frag in anchors(ROOT / page), f"{page}#{frag}"
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    for must in ("docs/getting-started/one-machine.md", "docs/getting-started/cluster.md", "docs/reference/spec.md",
                 "docs/troubleshooting.md", "docs/benchmarks.md"):  # fmt: skip
        assert must in pages and must in {p for p, _ in links}, must


def test_spec_reference_is_generated() -> None:
    """The spec reference moved from the README to docs/reference/spec.md, generated from the models."""
    from jobspec.spec.reference import markdown

    page = (ROOT / "docs" / "reference" / "spec.md").read_text()
    assert markdown().strip() in page, "docs/reference/spec.md is stale: run `python tests/test_readme.py`"
    assert "SPEC-REFERENCE" not in README and "LAYOUT:START" not in README


def _summary(path: Path) -> str:
    """The first sentence of a module's (or a package's __init__) docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    para = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s", para, maxsplit=1)[0]


def layout() -> str:
    """docs/development.md's "How the code is laid out", from the import-linter layers in pyproject.toml and the
    docstrings: every package and top-level module, top layer first; a layer's siblings (`|`) may not import each
    other."""
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
    page = (ROOT / "docs" / "development.md").read_text()
    section = re.search(r"<!-- LAYOUT:START -->\n(.*)<!-- LAYOUT:END -->", page, re.S)
    assert section, "docs/development.md lost its layout markers"
    assert section.group(1).strip() == layout(), "the layout is stale: run `python tests/test_readme.py`"


def test_every_package_is_in_a_layer() -> None:
    """A new package must be placed in the layers (pyproject.toml), else lint-imports would not check it."""
    text = layout()
    for root in ("jobspec", "runner"):
        for pkg in sorted(p.parent for p in (ROOT / root).glob("*/__init__.py")):
            assert f" {pkg.name}/ " in text, f"{root}/{pkg.name}/ is in no import-linter layer"


def test_source_files_named_in_the_docs_exist() -> None:
    """A file the README or a docs page points a reader to is where it says (the layout moves; the prose must
    follow)."""
    # a repository path, not the tail of an absolute one (/var/run/secrets/jobspec/gcs/key.json is the pod's)
    pattern = r"(?<![/\w.-])((?:runner|jobspec|tests|bench|images|\.ci)/[\w/.-]+\.(?:py|sh|json))\b"
    named = {(page, n) for page, text in DOCS_TEXT.items() for n in re.findall(pattern, text)}
    missing = sorted(f"{page}: {n}" for page, n in named if not (ROOT / n).is_file() and "/out/" not in n)
    assert not missing, missing


def test_examples_named_in_the_docs_exist() -> None:
    for page, text in DOCS_TEXT.items():
        for name in set(re.findall(r"examples/([\w.]+\.yaml)", text)):
            assert (ROOT / "examples" / name).is_file(), f"{page}: examples/{name}"


if __name__ == "__main__":  # regenerate the docs' generated pages (spec reference, CLI, errors, layout)
    from tests import docs_gen

    written = docs_gen.write()
    for path in written:
        print(f"wrote {path.relative_to(ROOT)}")
    if not written:
        print("the docs' generated pages are current")
