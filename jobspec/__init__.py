"""jobspec: a job spec for GPU fine-tuning, rendered to Kubernetes, run by a runner that sizes itself."""

__version__ = "0.1.0"
