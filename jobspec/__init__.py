"""jobspec: a job spec for GPU fine-tuning, rendered to Kubernetes, run by a runner that sizes itself."""

__version__ = "0.1.0"
# The distribution's name (pip install ...): `jobspec` on PyPI is an unrelated project.
DISTRIBUTION = "jobspec-k8s"


def install_hint(extra: str) -> str:
    """The pip line that adds an extra, e.g. install_hint("report") -> pip install 'jobspec-k8s[report]'."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"
