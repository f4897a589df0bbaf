"""The docs site stays true: its generated pages are the code's (`python tests/docs_gen.py` rewrites them), every spec
field, CLI flag and error class is documented, and every docs link jobspec prints points at an anchor that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobspec.errors import TROUBLESHOOTING, anchor, docs_link
from tests import docs_gen

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def slugify(text: str) -> str:
    """Python-Markdown's toc slug (markdown.extensions.toc.slugify with "-"), without needing the docs extra."""
    import unicodedata

    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def anchors(page: Path) -> set[str]:
    """The anchors a Markdown page defines: its headings' slugs (Python-Markdown's toc, as mkdocs builds them) and
    every explicit `{ #id }` (attr_list)."""
    found, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        found |= set(re.findall(r"\{\s*#([\w-]+)[^}]*\}", line))
        heading = re.match(r"#{1,6} (.*?)\s*(\{[^}]*\})?\s*$", line)
        if heading and not heading.group(2):
            found.add(slugify(re.sub(r"[`*]", "", heading.group(1))))
    return found


@pytest.mark.parametrize("path", sorted(docs_gen.pages()), ids=lambda p: str(p.relative_to(DOCS)))
def test_generated_pages_are_current(path: Path) -> None:
    assert path.is_file() and path.read_text() == docs_gen.pages()[path], (
        f"{path.relative_to(ROOT)} is stale: run `python tests/docs_gen.py`"
    )


def test_development_layout_is_current() -> None:
    page = (DOCS / "development.md").read_text()
    assert "<!-- LAYOUT:START -->" in page
    assert docs_gen.development_page(page) == page, "docs/development.md layout is stale: python tests/docs_gen.py"


def test_every_spec_field_has_a_description() -> None:
    from jobspec.spec.models import JobSpec
    from jobspec.spec.reference import _models

    bare = [f"{m.__name__}.{n}" for m in _models(JobSpec) for n, f in m.model_fields.items() if not f.description]
    assert not bare, f"spec fields without a description (the spec reference shows them empty): {bare}"


def test_every_cli_flag_has_help() -> None:
    from jobspec.cli import build_parser

    parser = build_parser()
    bare = [f"jobspec {name}: {a.dest}" for name, (_, sub) in docs_gen._subcommands(parser).items()
            for a in docs_gen.cli_flags(sub) if not (a.help or "").strip()]  # fmt: skip
    assert not bare, f"CLI arguments without help (the CLI reference shows them empty): {bare}"
    assert set(docs_gen._subcommands(parser)) >= {"init", "validate", "plan", "render", "run", "submit", "status"}


def test_every_error_class_has_a_troubleshooting_section() -> None:
    classes = docs_gen.error_classes()
    assert {"SpecError", "ConfigError", "ClusterError", "StorageError", "TierOOM", "NoFit"} <= {c.name for c in classes}
    defined = anchors(ROOT / TROUBLESHOOTING)
    missing = [f"{c.name} (#{c.anchor})" for c in classes if c.anchor not in defined]
    assert not missing, f"error classes without a section in {TROUBLESHOOTING}: {missing}"


def test_status_reasons_have_a_troubleshooting_section() -> None:
    from jobspec.cluster.output import REASON_DOCS, reason_link

    defined = anchors(ROOT / TROUBLESHOOTING)
    missing = [r for r in REASON_DOCS if anchor(r) not in defined]
    assert not missing, f"jobspec status reasons without a section in {TROUBLESHOOTING}: {missing}"
    assert reason_link("SomethingNew").endswith("#job-not-running") and "job-not-running" in defined


def test_every_link_to_the_docs_in_the_code_exists() -> None:
    """A `docs/PAGE.md#anchor` written anywhere in jobspec/ or runner/ names a page and an anchor that exist."""
    links = {
        m for top in ("jobspec", "runner") for path in (ROOT / top).rglob("*.py")
        for m in re.findall(r"docs/[\w/-]+\.md(?:#[\w-]+)?", path.read_text())
    }  # fmt: skip
    assert f"{TROUBLESHOOTING}" in links
    for link in links:
        page, _, frag = link.partition("#")
        assert (ROOT / page).is_file(), link
        assert not frag or frag in anchors(ROOT / page), link


def test_cli_errors_end_with_their_docs_link(tmp_path: Path) -> None:
    from tests.cli_helpers import run_cli

    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nmodel:\n  preset: tiny\ntraining:\n  global_batch: 0\n")
    done = run_cli("validate", str(spec))
    assert done.returncode == 2
    assert done.stderr.rstrip().endswith("see: docs/troubleshooting.md#spec-error"), done.stderr
    assert "spec-error" in anchors(ROOT / TROUBLESHOOTING)


def test_docs_link_names_the_class() -> None:
    from jobspec.errors import ConfigError

    assert docs_link(ConfigError("x")) == "docs/troubleshooting.md#config-error"
    assert anchor("TierOOM") == "tier-oom" and anchor("CreateContainerConfigError") == "create-container-config-error"


def test_the_site_links_every_page() -> None:
    """mkdocs builds every page; one left out of the nav is a page no reader finds (mkdocs only logs it)."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def leaves(item: object) -> list[str]:
        if isinstance(item, str):
            return [item]
        if isinstance(item, dict):
            return [leaf for v in item.values() for leaf in leaves(v)]
        return [leaf for v in item for leaf in leaves(v)] if isinstance(item, list) else []

    listed = set(leaves(nav))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == listed, (pages - listed, listed - pages)
