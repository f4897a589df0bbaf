"""The job spec: what a user writes, read once, checked once. Read in this order:

    models.py       the Pydantic models (`JobSpec` and its sections): fields, descriptions, defaults
    units.py        value types that parse human shorthand once: sizes ("16Gi"), GPUs ("H100:8")
    rules.py        rules that span sections (a batch that does not divide, an unknown GPU type)
    loader.py       a YAML file and `--set` overrides -> `JobSpec`, every problem at once with file:line
    safe_yaml.py    the bounded YAML reader under it (size, nodes, depth, numbers)
    credentials.py  what a secret looks like (names, token formats, URLs with passwords)
    secrets.py      which strings of a spec are secrets, and problems scrubbed of them
    reference.py    the JSON Schema and the Markdown reference, generated from the models

Depends on `jobspec.catalog` (presets, GPU types, tiers) and the base modules (`errors`, `contract`) only.
"""

# The package's face, for code that builds on jobspec (`from jobspec.spec import JobSpec, load_spec`): looked
# up on first use, so that importing one light module of the package (units, credentials) loads no pydantic.
_PUBLIC = {"load_spec": "loader", "parse_spec": "loader"}


def __getattr__(name: str) -> object:
    import importlib

    module = importlib.import_module(f"jobspec.spec.{_PUBLIC.get(name, 'models')}")
    if name.startswith("_") or not hasattr(module, name):
        raise AttributeError(f"module 'jobspec.spec' has no attribute {name!r}")
    return getattr(module, name)
