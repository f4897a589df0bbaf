"""Library log lines a user cannot act on, kept out of a run's log (shown with --debug / JOBSPEC_DEBUG logging).

Each is matched by its logger and the start of its text, nothing broader, so a new warning from the same library
still comes through:
- torchao, at import (peft and transformers import it when it is installed): "Failed to load .../torchao/_C_*.so"
  for its optional compiled kernels (MX formats, CUTLASS for sm90a) that this machine's CUDA or CPU cannot load;
  jobspec uses its pure-Python NF4 and CPUOffloadOptimizer, which do not need them.
- torch.utils._pytree, at torchao's import: "<enum ...> is an Enum subclass and is now natively supported by
  torch.compile ...", a deprecation addressed to torchao's authors.
"""

from __future__ import annotations

import logging

NOISE: tuple[tuple[str, str, str], ...] = (  # (logger, text starts with, text holds)
    ("torchao", "Failed to load ", "/torchao/_C"),
    ("torch.utils._pytree", "", "is an Enum subclass and is now natively supported by torch.compile"),
)


class _Drop(logging.Filter):
    def __init__(self, start: str, holds: str) -> None:
        super().__init__()
        self.start, self.holds = start, holds

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger("jobspec.runner").isEnabledFor(logging.DEBUG):
            return True
        try:
            text = record.getMessage()
        except Exception:  # a record whose arguments do not format: not ours to judge
            return True
        return not (text.startswith(self.start) and self.holds in text)


def quiet() -> None:
    """Install the filters (once per logger): before the libraries are imported, or they have spoken already."""
    for name, start, holds in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and (f.start, f.holds) == (start, holds) for f in logger.filters):
            logger.addFilter(_Drop(start, holds))
