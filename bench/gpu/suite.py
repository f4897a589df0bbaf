"""One call, the parts in order, each in a process of its own that ends at its budget; the record after every item.

The suite's own process (`run`) never imports torch (a CUDA context here would take memory from every part). It
writes the data, the config and the record's skeleton into the output directory, then starts each part of
PART_ORDER as `python -m bench.gpu --child PART ...` in a session of its own and waits for it until the part's
budget (capped by what the call's total has left) is spent:

  at budget - GRACE_S  SIGUSR1: the part raises `Overrun` wherever it is (its Recipe is released on the way out),
                       marks itself overrun and writes what it measured; it starts no new item after that point
                       anyway (its `Budget`);
  at the budget        SIGKILL to its whole process group (a runner it started, DataLoader workers, a trace).

The part writes the record (gpu-suite*.json and .md) itself after every item, so a kill of the whole call, at any
moment, leaves everything measured so far; after each part the suite adds the part's status, seconds and budget
and writes the record again. A part that fails or overruns is marked and the next one starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu import common, device
from bench.gpu.report import KEYS, markdown

log = logging.getLogger("bench.gpu")
SCHEMA = 4  # 4: issue 42's rows ("sides") first in throughput; 3: part userpath after recovery; 2: tests, recovery,
# memory, throughput; 1: tests, sizing, throughput
GRACE_S = 8.0  # between SIGUSR1 and SIGKILL: a part writes what it has
MIN_PART_S = 15.0  # a part with less than this left of the total is not started
EXIT_NO_GPU = 2


class Overrun(BaseException):  # not an Exception: the parts' per-item `except Exception` let it pass
    """The part's budget is spent (SIGUSR1 from the suite)."""


def write(out: Path, stem: str, record: dict[str, Any]) -> Path:
    """The record as JSON (atomically) and its report as Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, out / f"{stem}.json")
    tmp = out / f".{stem}.md.tmp"
    tmp.write_text(markdown(record))
    os.replace(tmp, out / f"{stem}.md")
    return out / f"{stem}.md"


def read(out: Path, stem: str) -> dict[str, Any]:
    return json.loads((out / f"{stem}.json").read_text())


# --- the suite's process -------------------------------------------------------------------------------------


def child_command(part: str, work: Path, out: Path, stem: str, deadline: float) -> list[str]:
    verbose = ["-v"] if logging.getLogger().isEnabledFor(logging.INFO) else []  # the runner's INFO log too
    return [sys.executable, "-m", "bench.gpu", "--child", part, "--work", str(work), "--out", str(out),
            "--stem", stem, "--deadline", f"{deadline:.3f}", *verbose]  # fmt: skip


def supervise(cmd: list[str], budget_s: float, log_path: Path) -> tuple[int | None, bool, float]:
    """Run `cmd` in a session of its own for at most `budget_s` (SIGUSR1 GRACE_S before, SIGKILL to its process
    group at the end); (exit code, whether it overran, seconds). Output goes to `log_path`."""
    t0 = time.perf_counter()
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, cwd=common.ROOT, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        overran = False
        try:
            proc.wait(timeout=max(0.0, budget_s - GRACE_S))
        except subprocess.TimeoutExpired:
            overran = True
            proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=min(GRACE_S, budget_s))
        finally:
            # whatever is left of its group: a runner's workers, a trace, a test's training run
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, overran, time.perf_counter() - t0


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run(
    cfg: common.Config,
    parts: list[str],
    out: Path,
    stem: str,
    keep: bool = False,
    command: Callable[[str, Path, Path, str, float], list[str]] = child_command,
) -> tuple[dict[str, Any], int]:
    """Every part of `parts` in PART_ORDER, each in its own process within its budget; (the record, exit code:
    0, or EXIT_NO_GPU when a part found no GPU to run on)."""
    parts = [p for p in common.PART_ORDER if p in parts]
    work = Path(tempfile.mkdtemp(prefix="jobspec-gpu-suite-"))
    record: dict[str, Any] = dict.fromkeys(KEYS)
    record.update(
        schema=SCHEMA,
        environment=device.host_environment(cfg),
        config=cfg.to_dict(),
        parts=parts,
        seconds={},
        status={p: {"status": "not run yet", "budget_s": cfg.budgets[p]} for p in parts},
    )
    (work / "config.json").write_text(json.dumps(cfg.to_dict()))
    batches = (cfg.per_rank, cfg.throughput_batch, cfg.tier_batch, cfg.soak_batch, cfg.recovery_batch)
    common.write_data(work / "data.jsonl", rows=2 * max(batches) + 16, seq=cfg.seq)
    write(out, stem, record)
    total, t0, code = sum(cfg.budgets[p] for p in parts), time.perf_counter(), 0
    try:
        for part in parts:
            budget = min(cfg.budgets[part], total - (time.perf_counter() - t0))
            if budget < MIN_PART_S:
                record["status"][part] = {"status": "skipped: the call's total budget is spent", "budget_s": budget}
                write(out, stem, record)
                continue
            log.info("part %s: starting (budget %.0f s)", part, budget)
            logfile = out / f"{stem}-{part}.log"
            logfile.unlink(missing_ok=True)
            rc, overran, seconds = supervise(command(part, work, out, stem, time.time() + budget), budget, logfile)
            record = read(out, stem)  # with what the part wrote
            said = (record.get("status") or {}).get(part) or {}
            status = said.get("status", "not run yet")
            if status == "not run yet":  # it wrote no status of its own: killed, or crashed before it could
                status = (f"overrun: killed at its budget ({budget:.0f} s)" if overran
                          else f"failed: exit {rc}: {_tail(logfile, 3)}"[:600])  # fmt: skip
            record["status"][part] = {**said, "status": status, "budget_s": round(budget, 1), "exit_code": rc}
            record["seconds"][part] = round(seconds, 1)
            write(out, stem, record)
            log.info("part %s: %s in %.0f s", part, status.splitlines()[0][:120], seconds)
            if rc == EXIT_NO_GPU:
                print(_tail(logfile, 3), file=sys.stderr)
                code = EXIT_NO_GPU
                break
    finally:
        if keep:
            log.info("work directory kept: %s", work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return record, code


def specs(cfg: common.Config, work: Path, data: Path) -> list[tuple[str, Any]]:
    """(name, spec) of every spec the parts build with `cfg`, each parsed and validated (a JobSpec; the relaunch's
    as the dict bench/recovery.py writes to a file, validated here too). tests/test_gpu_suite.py builds them for
    the GPU's sizes on the CPU: a bad value (the H100's target_utilization 0.45) fails in CI, not on a device."""
    import yaml

    from bench.gpu import oom, sizing, throughput, userpath
    from jobspec.spec.loader import parse_spec

    out: list[tuple[str, Any]] = [("recovery", oom.recovery_spec(cfg, work / "oom", data))]
    out.append(("relaunch", parse_spec(yaml.safe_dump(oom.relaunch_spec(cfg, work / "relaunch")))))
    setup = userpath.Setup.cpu() if cfg.smoke else userpath.Setup.gpu()
    out.append(("userpath", parse_spec(yaml.safe_dump(userpath.spec_dict(setup, work / "userpath")))))
    out += [(f"memory {p} {t}", sizing.sizing_spec(cfg, work, data, p, t))
            for p in cfg.memory_presets for t in cfg.memory_tiers]  # fmt: skip
    out += [(f"sides {r}", throughput.side_spec(cfg, r, work, data)) for r in cfg.sides_rows]
    out.append(("runner vs plain", throughput.plain_spec(cfg, work, data)))
    out += [(f"tier speed {t}", throughput.tier_spec(cfg, work, data, t, 0)) for t in cfg.tiers]
    out.append(("soak", throughput.soak_spec(cfg, work, data)))
    return out


# --- a part's process ----------------------------------------------------------------------------------------


def _overrun(signum: int, frame: object) -> None:
    raise Overrun


def child(part: str, work: Path, out: Path, stem: str, deadline: float) -> int:
    """Run one part against the record in `out` (written after every item); its status into the record, also when
    the suite's SIGUSR1 ends it (`Overrun`, wherever it lands once the handler is in place)."""
    signal.signal(signal.SIGUSR1, _overrun)
    cfg = common.Config.from_dict(json.loads((work / "config.json").read_text()))
    record = read(out, stem)

    def save() -> None:
        write(out, stem, record)

    status, code, t0 = "ok", 0, time.perf_counter()
    try:
        if cfg.threads:  # also for the subprocesses (pytest, a trace)
            os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
            import torch

            torch.set_num_threads(cfg.threads)
        if not cfg.smoke:
            import torch

            if not torch.cuda.is_available():
                raise NoGPU("python -m bench.gpu needs a CUDA or ROCm GPU (torch.cuda.is_available() is False); "
                            "--smoke runs it on the CPU")  # fmt: skip
        if part != "tests":  # its process only waits for pytest: a CUDA context here would take memory from the tests
            record["environment"].update(device.device_environment(cfg))
        budget = common.Budget(deadline - GRACE_S - time.time())  # no new item after it: the SIGUSR1 lands then
        _part(part, cfg, work, work / "data.jsonl", out, budget, save, record)
    except Overrun:
        status = f"overrun: ended at its budget, {time.perf_counter() - t0:.0f} s into the part"
    except NoGPU as err:
        print(err, file=sys.stderr)
        status, code = f"error: {err}", EXIT_NO_GPU
    except Exception as err:  # the part's own bug: marked, and the suite goes on
        traceback.print_exc()
        status, code = f"error: {type(err).__name__}: {err}"[:600], 1
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a late SIGUSR1 must not cut the last write short
    record["status"][part] = {"status": status}
    save()
    return code


class NoGPU(Exception):
    pass


def _part(part: str, cfg: common.Config, work: Path, data: Path, out: Path, budget: common.Budget,
          save: Callable[[], None], record: dict[str, Any]) -> None:  # fmt: skip
    if part == "tests":
        from bench.gpu import gputests

        record["gpu_tests"] = gputests.run(out, timeout_s=budget.left() - gputests.INTERRUPT_S)
        save()
    elif part == "recovery":
        from bench.gpu import oom

        oom.run(cfg, work, data, budget, save, record)
    elif part == "userpath":
        from bench.gpu import userpath

        userpath.part(cfg, work, budget, save, record)
    elif part == "memory":
        from bench.gpu import sizing

        sizing.run(cfg, work, data, budget, save, record)
    elif part == "throughput":
        from bench.gpu import throughput

        name = None if cfg.device == "cpu" else record["environment"]["device"]
        throughput.run(cfg, work, data, budget, save, record, name)
    else:
        raise ValueError(f"unknown part {part!r}: one of {', '.join(common.PART_ORDER)}")
