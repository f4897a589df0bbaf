"""One training process (one rank): `python -m runner.process.worker SPEC [--set k=v ...]`, started by the supervisor.

Reads its place in the job from RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, runs `runner.train.recipe.Recipe` and exits with the contract's code: 0 done, 2 bad spec or
data (or a run directory held by another run, or without an intact checkpoint), 74 checkpoint volume
full or not writable, 75/76 no tier fits, 143 stopped by SIGTERM (the steps trained are checkpointed),
1 anything else (traceback logged), and 1 too when the gang lost a member (runner/process/heartbeat.py): the Job
restarts the pods, which resume together from the newest complete checkpoint.

The stop signals (SIGTERM, SIGINT, SIGHUP, SIGQUIT) only set the stop flag, from the first line of `main` to the
process's exit: a signal that comes after the run finished (final checkpoint written) cannot turn its exit 0 into a
death by signal. During setup (data, model build, probe steps, resume), where the loop never reads the flag, the
signal ends the process at once with 143 (`Stopped`); the supervisor kills what a long C call keeps from noticing.

A worker dies with its supervisor (runner/process/lifeline.py): when the supervisor ends without stopping it (a
SIGKILL), the worker gets SIGTERM from the kernel, checkpoints and stops as above, and kills itself if it has not
within the supervisor's stop grace.
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

from runner.process import lifeline

if __name__ == "__main__":  # before the imports below (torch: seconds), which a dead supervisor must not wait for
    lifeline.arm()

from jobspec import shared_dir
from jobspec.contract import EXIT_FAILED, EXIT_PREEMPTED, EXIT_STORAGE
from jobspec.errors import EXIT_DOCS, TROUBLESHOOTING, JobspecError, docs_link, see
from jobspec.spec.benchmarks import check_task_files
from jobspec.spec.loader import load_spec
from jobspec.spec.models import JobSpec
from runner import internals
from runner.checkpoint import files
from runner.checkpoint.storage import describe, volume_error
from runner.dist import DistEnv
from runner.oom.shrink import tier_failed
from runner.process import heartbeat, noise, redaction
from runner.sizing.plan import NoFit
from runner.train.engine import compile_failure
from runner.train.recipe import Recipe
from runner.train.step import StopFlag, Stopped

log = logging.getLogger("jobspec.runner")


def write_status(env: DistEnv, status: dict[str, Any], *, every_node: bool = False) -> None:
    """Rank 0 (`every_node`: each node's first rank) tells its supervisor how it ended (JOBSPEC_STATUS_FILE),
    for the termination message."""
    path = os.environ.get("JOBSPEC_STATUS_FILE")
    if path and (env.local_rank == 0 if every_node else env.is_main):
        Path(path).write_text(json.dumps(status))


def gang_lost(loss: heartbeat.Loss, recipe: Recipe | None, env: DistEnv,
              beat: heartbeat.Heartbeat | None = None) -> None:  # fmt: skip
    """The heartbeat declared a member lost (this runs on its watchdog thread): the main thread may wait in a
    collective that never returns, so record the loss and end the process here with EXIT_FAILED, which the Job
    retries; the restarted pods resume together from the newest complete checkpoint. Nothing is left half-written:
    a checkpoint is published by a rename after its shards and marker are complete, and a metrics record is one
    line. A rank that was itself frozen ("self", or frozen since it found the loss: `beat.acting_late()`) writes
    nothing shared: the gang has moved on without it."""
    try:
        step = recipe.step if recipe is not None else 0
        resumes = max(recipe.saved_step, 0) if recipe is not None else 0
        reason = (f"{loss.describe()}; last completed step {step}, newest checkpoint step-{resumes}: {step - resumes} "
                  "step(s) to redo")  # fmt: skip
        log.error("%s; exiting %d so that the Job restarts the pods", reason, EXIT_FAILED)
        status = {**(recipe.status if recipe is not None else {}), "step": step, "reason": reason}
        with contextlib.suppress(OSError):
            write_status(env, status, every_node=True)  # the survivor on another node has a supervisor too
        late = beat is not None and beat.acting_late()
        if recipe is not None and recipe.metrics is not None and loss.kind != "self" and not late:
            record = {"kind": "event", "event": "member_lost", "step": step, "member": loss.member, "cause": loss.kind,
                      "silent_s": round(loss.silent_s, 3), "detected_at": round(loss.detected_at, 3), "by": loss.by,
                      "checkpoint_step": resumes, "steps_to_redo": step - resumes}  # fmt: skip
            with contextlib.suppress(Exception):  # the record is a courtesy; the exit is what matters
                recipe.metrics.write(record, fence=recipe.holds_lease)  # the gang is lost: the lease alone decides
    finally:  # whatever the record met, the process ends: its main thread may never return
        _exit(EXIT_FAILED)


def check_benchmarks(spec: JobSpec, task_dir: Path) -> None:
    """Build every `eval.benchmarks` task with lm-eval (the data sets read into the hub cache) before training."""
    from runner.output import benchmarks

    benchmarks.require_lm_eval()
    check_task_files(spec.eval.benchmarks, task_dir)
    items = benchmarks.entries(spec.eval.benchmarks, task_dir)
    benchmarks.check(items, benchmarks.task_manager(items))


def torchao_quantized(model_path: str | None) -> bool:
    """Whether a local model's config.json says torchao quantized it (transformers then loads it through its torchao
    integration, which the worker otherwise keeps torchao out of: runner/internals/imports.py)."""
    config = Path(model_path or "") / "config.json"
    if not model_path or not config.is_file():
        return False
    try:
        text = files.read_json(config, 64 * 2**20, "model config.json")
    except (OSError, ValueError, JobspecError):
        return True  # unreadable here: leave transformers as it is; the build reports the file
    quant = text.get("quantization_config") if isinstance(text, dict) else None
    return isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "torchao"


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("jobspec.runner").setLevel(level)
    redaction.install()
    noise.quiet()  # before torchao's import (peft's and transformers'): its .so and pytree warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.process.worker", description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    stop = StopFlag()
    stop.install()  # never restored: see the module docstring
    lifeline.bind()  # after the handler: the kernel's SIGTERM on the supervisor's death then stops, not kills
    env = DistEnv.from_env()
    setup_logging(env.rank)
    worker: Recipe | None = None
    gang: heartbeat.Heartbeat | None = None
    code = EXIT_FAILED
    try:
        spec = load_spec(args.spec, args.overrides)
        if not torchao_quantized(spec.model.path):  # before transformers' model classes are imported
            internals.keep_torchao_out_of_transformers()
        gang = heartbeat.start(env, spec.scheduling.heartbeat_timeout_seconds,
                               lambda loss: gang_lost(loss, worker, env, gang), addr=os.environ.get("MASTER_ADDR"),
                               port=int(os.environ.get("MASTER_PORT") or 0))  # fmt: skip
        fenced = {"fence": gang.fence} if gang is not None else {}  # a writer checks the gang before it writes
        worker = Recipe(spec, env, stop=stop, **fenced)
        worker.task_dir = Path(args.spec).resolve().parent  # eval.benchmarks' task files are relative to the spec
        if env.is_main and spec.eval.benchmarks and spec.output.export:
            check_benchmarks(spec, worker.task_dir)  # before training: a task that cannot run is exit 2 now, not later
        worker.setup()
        code = worker.train()
    except NoFit as err:  # probe steps: micro-batch 1 does not fit this tier; persist it for the OOM ladder
        log.error("%s\n%s", err, see(err))
        assert worker is not None  # NoFit comes from Recipe.setup()
        worker.status["docs"] = docs_link(err)
        code, worker.status["reason"] = tier_failed(
            worker.root,
            err.tier,
            str(err),
            world_size=env.world_size,
            fallback=worker.spec.memory.fallback,
            writer=env.is_main,
        )
    except Stopped as err:  # SIGTERM/SIGINT before training: nothing new since the last checkpoint
        log.warning("%s", err)
        code = EXIT_PREEMPTED
        if worker is not None:
            worker.status["reason"] = str(err)
    except JobspecError as err:  # bad spec or data (2): message and its docs link, no traceback
        code = said(err, worker)
    except Exception as err:
        compiling = compile_failure(err, worker.spec.training.compile) if worker is not None else None
        # torch.compile's own error is the same at the next attempt: said as a spec error is, exit 2
        code = said(compiling, worker) if compiling is not None else crashed(err, worker)
    finally:
        if gang is not None:  # before the process group goes: rank 0's store stays up until all have said goodbye
            if not gang.fresh():  # woken up after the gang moved on (a collective failed on the way out)
                gang.fence()  # gang_lost ends the process: no lease release, nothing shared written
            gang.leave(bye=code != EXIT_FAILED)  # a crash may be this rank's alone: the others must find it lost
        if worker is not None:
            worker.cleanup()
            write_status(env, worker.status)
    return code


def said(err: JobspecError, worker: Recipe | None) -> int:
    """A bad spec or data (exit 2), or another fault the next attempt would meet again: its message and docs link,
    no traceback; the status file gets both."""
    log.error("%s\n%s", err, see(err))
    if worker is not None:
        worker.status["reason"] = redaction.scrubbed(str(err).splitlines()[0])  # torch's words in a compile error
        worker.status["docs"] = docs_link(err)  # the supervisor's last line points there too
    return err.exit_code


def crashed(err: Exception, worker: Recipe | None) -> int:
    """Any other error: a full volume (exit 6, described), else a crash (exit 1) with its traceback in the log."""
    volume = volume_error(err, worker.root) if worker is not None else None
    code = EXIT_STORAGE if volume is not None else EXIT_FAILED
    link = f"{TROUBLESHOOTING}#{EXIT_DOCS[code]}"
    if worker is not None and volume is not None:  # e.g. metrics.jsonl on a full volume
        worker.status["reason"] = describe(volume, worker.root)
        log.error("%s\n%s", worker.status["reason"], see(link))
    else:
        log.error("training failed", exc_info=err)
        log.error("%s", see(link))
        if worker is not None:
            worker.status["reason"] = redaction.scrubbed(f"{type(err).__name__}: {err}")[:300]
    if worker is not None:
        worker.status["docs"] = link
    return code


def _exit(code: int) -> None:
    """Leave without the interpreter's finalization, once everything is written.

    By now the checkpoints are published (fsynced), the status file written, the trackers closed and the
    process group destroyed. What finalization would still run is the C++ teardown of torch's and gloo's
    threads, which can end in std::terminate ("terminate called without an active exception", exit -6:
    seen twice in the multi-rank tests, on a rank that had finished its run; pytorch#179291), turning a
    finished run into a failed pod. So flush what Python buffers and exit with the code.

    Called from the heartbeat's watchdog thread too (`gang_lost`), while the main thread may be inside a write:
    `shared_dir.seal()` first removes the temporary of a write under way and refuses any later one, so that the
    process leaves nothing half-written in the run directory (CI, 2026-11-30: a rank 0 woken after its gang had
    gone created the lease's temporary on waking and ended before writing it: an empty `.lease.json.<hex>.tmp`)."""
    shared_dir.seal()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing left to flush
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
