"""Installs that work anywhere: the distribution's name is not PyPI's unrelated `jobspec`, and every
install line the project prints or documents names the distribution this project builds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

from jobspec import DISTRIBUTION, install_hint
from jobspec.report import INSTALL_HINT

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Text a user reads or runs: the docs, the package's messages, the image build.
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    ROOT / "images" / "README.md",
    ROOT / "images" / "jobspec-image.sh",
    ROOT / "Dockerfile",
    *(ROOT / "images").glob("Dockerfile.*"),
    *(ROOT / "jobspec").rglob("*.py"),
    *(ROOT / "runner").rglob("*.py"),
]


def test_the_distribution_is_not_pypis_jobspec() -> None:
    # PyPI's `jobspec` is an unrelated project; `jobspec-k8s` was free on PyPI when chosen (checked with
    # `pip index versions jobspec-k8s` and https://pypi.org/pypi/jobspec-k8s/json: not found).
    assert PYPROJECT["project"]["name"] == DISTRIBUTION == "jobspec-k8s"
    assert PYPROJECT["project"]["scripts"] == {"jobspec": "jobspec.cli:main"}  # the command stays `jobspec`
    assert install_hint("report") == "pip install 'jobspec-k8s[report]'" == INSTALL_HINT


def test_every_install_line_names_the_distribution() -> None:
    # `pip install [options] jobspec` or `'jobspec[extra]'`: one command (a token never spans `&&`).
    wrong = re.compile(r"pip install(\s+[^\s&;|`]+)*?\s+['\"]?jobspec(?=[\[\s'\"`]|$)", re.M)
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in SOURCES for m in wrong.finditer(p.read_text())]
    assert found == []


def test_extras_named_in_hints_exist() -> None:
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = {m for p in SOURCES for m in re.findall(r"jobspec-k8s\[(\w+)\]", p.read_text())}
    assert named and named <= extras


def test_the_image_build_finds_the_wheel_of_this_distribution() -> None:
    wheel = re.sub(r"[-_.]+", "_", DISTRIBUTION)  # a wheel's file name normalises the name (PEP 427)
    script = (ROOT / "images" / "jobspec-image.sh").read_text()
    assert f'"$dist"/{wheel}-*.whl' in script


def test_the_docs_install_this_project_and_cpu_torch() -> None:
    readme = (ROOT / "README.md").read_text()
    install = (ROOT / "docs" / "getting-started" / "one-machine.md").read_text()  # the install page
    assert "pip install -e '.[runner]'" in readme and "pip install ." in install
    for text in (readme, install):
        assert "git+https://" not in text  # no public repository to install from yet: no URL that does not exist
        assert "--index-url https://download.pytorch.org/whl/cpu" in text


def test_the_command_reports_the_package_version() -> None:
    out = subprocess.run([sys.executable, "-m", "jobspec", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"jobspec {PYPROJECT['project']['version']}"
