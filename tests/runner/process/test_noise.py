"""torchao's failed optional .so loads and torch's pytree deprecation about torchao's enums stay out of a run's log
(runner/process/noise.py): a user cannot act on them. Anything else those loggers say still comes through."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.util import find_spec

import pytest

from runner.process import noise


def test_the_known_lines_are_dropped_and_others_kept(caplog: pytest.LogCaptureFixture) -> None:
    noise.quiet()
    noise.quiet()  # once per logger
    assert sum(isinstance(f, noise._Drop) for f in logging.getLogger("torchao").filters) == 1
    with caplog.at_level(logging.INFO):
        logging.getLogger("torchao").warning("Failed to load /x/site-packages/torchao/_C_mxfp8.so: Could not load")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.", "<enum>")
        logging.getLogger("torchao").warning("Skipping import of cpp extensions due to incompatible torch version.")
        logging.getLogger("torch.utils._pytree").warning("something else")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["Skipping import of cpp extensions due to incompatible torch version.", "something else"]
    logging.getLogger("jobspec.runner").setLevel(logging.DEBUG)  # --debug shows everything
    try:
        with caplog.at_level(logging.DEBUG):
            logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_cutlass_90a.abi3.so: no")
        assert "Failed to load /x/torchao/_C_cutlass_90a.abi3.so: no" in caplog.text
    finally:
        logging.getLogger("jobspec.runner").setLevel(logging.NOTSET)


@pytest.mark.skipif(find_spec("torchao") is None or find_spec("peft") is None, reason="torchao and peft installed")
def test_a_worker_importing_peft_with_torchao_prints_neither() -> None:
    code = ("from runner.process.worker import setup_logging; setup_logging(0); import peft, torchao; "
            "import logging; logging.getLogger('jobspec.runner').info('ready')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "ready" in done.stderr
    assert "Failed to load" not in done.stderr and "is an Enum subclass" not in done.stderr, done.stderr
