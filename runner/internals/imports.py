"""transformers' check for torchao, answered "absent" for a run that does not need transformers' torchao integration.

transformers imports torchao whenever it is installed (its quantizers module, at the first model class's import):
about 2.6 s of CPU at every worker's start on a machine where torchao is (the GPU images carry it for zero2_offload
and NF4, which the runner calls directly, never through transformers). The check (`is_torchao_available`, public,
in transformers.utils and transformers.utils.import_utils) is bound by name when a module imports it, so it is
replaced before transformers' modeling modules are imported, or not at all. A model whose config.json was quantized
by torchao needs the integration: the worker leaves the check alone for it.
"""

from __future__ import annotations

import sys

from runner.internals.versions import has

MODELING = ("transformers.modeling_utils", "transformers.quantizers")


def keep_torchao_out_of_transformers() -> bool:
    """Make transformers take torchao for absent; False (nothing changed) once its modeling modules are imported or
    where this transformers has no such check."""
    if any(name in sys.modules for name in MODELING):
        return False
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    if not (has(utils, "is_torchao_available") and has(import_utils, "is_torchao_available")):
        return False

    def absent(*args: object, **kwargs: object) -> bool:
        return False

    utils.is_torchao_available = import_utils.is_torchao_available = absent  # type: ignore[attr-defined]
    return True
