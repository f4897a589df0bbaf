"""One training process (one rank): `python -m runner.process.worker SPEC [--set k=v ...]`, started by the supervisor.

Reads its place in the job from RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, runs `runner.train.recipe.Recipe` and exits with the contract's code: 0 done, 2 bad spec or
data (or a run directory held by another run, or without an intact checkpoint), 74 checkpoint volume
full or not writable, 75/76 no tier fits, 143 stopped by SIGTERM (the steps trained are checkpointed),
1 anything else (traceback logged).

SIGTERM and SIGINT only set the stop flag, from the first line of `main` to the process's exit: a signal
that comes after the run finished (final checkpoint written) cannot turn its exit 0 into a death by signal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from jobspec.contract import EXIT_FAILED, EXIT_STORAGE
from jobspec.errors import JobspecError
from jobspec.spec.loader import load_spec
from runner.checkpoint.storage import describe, volume_error
from runner.dist import DistEnv
from runner.oom.shrink import tier_failed
from runner.sizing.plan import NoFit
from runner.train.recipe import Recipe
from runner.train.step import StopFlag

log = logging.getLogger("jobspec.runner")


def write_status(env: DistEnv, status: dict[str, Any]) -> None:
    """Rank 0 tells the supervisor how it ended (JOBSPEC_STATUS_FILE), for the termination message."""
    path = os.environ.get("JOBSPEC_STATUS_FILE")
    if path and env.is_main:
        Path(path).write_text(json.dumps(status))


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("jobspec.runner").setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.process.worker", description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    stop = StopFlag()
    stop.install()  # never restored: see the module docstring
    env = DistEnv.from_env()
    setup_logging(env.rank)
    worker: Recipe | None = None
    code = EXIT_FAILED
    try:
        worker = Recipe(load_spec(args.spec, args.overrides), env, stop=stop)
        worker.setup()
        code = worker.train()
    except NoFit as err:  # probe steps: micro-batch 1 does not fit this tier; persist it for the OOM ladder
        log.error("%s", err)
        assert worker is not None  # NoFit comes from Recipe.setup()
        code, worker.status["reason"] = tier_failed(
            worker.root,
            err.tier,
            str(err),
            world_size=env.world_size,
            fallback=worker.spec.memory.fallback,
            writer=env.is_main,
        )
    except JobspecError as err:  # bad spec or data (2): message, no traceback
        log.error("%s", err)
        code = err.exit_code
        if worker is not None:
            worker.status["reason"] = str(err).splitlines()[0]
    except Exception as err:
        volume = volume_error(err, worker.root) if worker is not None else None
        if worker is not None and volume is not None:  # e.g. metrics.jsonl on a full volume
            code, worker.status["reason"] = EXIT_STORAGE, describe(volume, worker.root)
            log.error("%s", worker.status["reason"])
        else:
            log.exception("training failed")
            if worker is not None:
                worker.status["reason"] = f"{type(err).__name__}: {err}"[:300]
    finally:
        if worker is not None:
            worker.cleanup()
            write_status(env, worker.status)
    return code


def _exit(code: int) -> None:
    """Leave without the interpreter's finalization, once everything is written.

    By now the checkpoints are published (fsynced), the status file written, the trackers closed and the
    process group destroyed. What finalization would still run is the C++ teardown of torch's and gloo's
    threads, which can end in std::terminate ("terminate called without an active exception", exit -6:
    seen twice in the multi-rank tests, on a rank that had finished its run; pytorch#179291), turning a
    finished run into a failed pod. So flush what Python buffers and exit with the code."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing left to flush
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
