"""The README stays true: its spec reference is the generated one, its commands exist."""

from __future__ import annotations

import re
from pathlib import Path

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
    (ROOT / "README.md").write_text(text)
