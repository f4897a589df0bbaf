"""The user path under a real OOM: `jobspec run` (supervisor and worker) while memory is taken away from outside.

    python -m bench.gpu.userpath [--cpu] [--seed S] [--out DIR] [--keep]

GPU (the default): the `llama-1b` preset, bf16, seq 512, global batch 64, `memory.tier: fast`, the bundled
synthetic set, run as a user runs it (`python -m jobspec run SPEC`). A separate process (bench/gpu/hog.py, started
first, no project code in the run) takes the GPU's memory away at moments chosen by a seeded random generator: a
random step, then a random fraction of a step's time into it, twice:

  squeeze 1  the run is left what `fast` needs at half its micro-batch: the runner must shrink in process;
  squeeze 2  the run is left less than `fast` needs at micro-batch 1 (more than `zero2_offload` does): no micro-batch
             of `fast` fits, the runner must step down a tier in process.

With a caching allocator in its steady state a run allocates nothing new in a step (its cache serves every step), so
no outside process could make it fail; the run's environment turns the cache off (`PYTORCH_NO_CUDA_MEMORY_CACHING=1`,
torch's own setting, no project code): each allocation of a step goes to the device, and the hog's grab lands at
whatever op comes next. That costs step time (recorded); `--caching` keeps the cache (the squeezes then bite only
where the run grows: start-up, the first steps, after an OOM's release).

CPU (`--cpu`, and tests/runner/oom/test_user_path.py in the normal suite): the tiny preset, with the project's own
fault injection instead of a hog (JOBSPEC_FAULT_OOM: two seeded random steps at a seeded random allocating op; the
second at micro-batch 1, which no micro-batch of `fast` passes, so the tier steps down in process).

Required, and reported in the record: every optimizer step trained and recorded exactly once (metrics.jsonl train
records 1..N), the global batch unchanged on every record, a shrink and an in-process tier step-down happened, every
phase the runner logs as starting ("X ...") ends ("X: done in ..." / "X: failed after ..."), the longest silence of
the log from the first OOM to the step after the step-down with no phase open (at most GAP_LIMIT_S; the longest
silence of any kind is reported beside it), the whole step-down's seconds, the tier's give-up included (goal <= 10 s
on an H200), and start-up to step 1 (goal <= 15 s on an H200).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GiB = 1024**3
STEPDOWN_GOAL_S = 10.0  # issue 41: a 1B step-down in process on an H200
STARTUP_GOAL_S = 15.0  # issue 41: `jobspec run` to step 1 of a 1B model on an H200
CONTEXT_BYTES = 1 * GiB  # the run's CUDA context and the workspaces outside the model's count
STEP_DOWN_SHARE = 0.35  # where the step-down squeeze leaves the run, from zero2_offload's need to fast's
GAP_LIMIT_S = {"cuda": 10.0, "cpu": 20.0}  # the longest silence of the log allowed during a recovery
_PREFIX = re.compile(r"^\d\d:\d\d:\d\d(?:[.,]\d+)? +[A-Z]+ +\[[^\]]+\] ")  # the worker's / supervisor's log format
_END = re.compile(r"^(?P<what>.+?): (?:done in|failed after) [0-9.]+ s\b")


@dataclass
class Setup:
    device: str  # "cuda" | "cpu"
    preset: str
    seq: int
    global_batch: int
    micro_batch: int | str
    steps: int
    precision: str
    checkpoint_every: int = 4
    caching: bool = False  # GPU: keep the caching allocator on in the run

    @classmethod
    def gpu(cls) -> Setup:
        # checkpoints: the final one and the step-down's own (a 1B checkpoint is seconds of the part's budget)
        return cls("cuda", "llama-1b", 512, 64, "auto", 10, "bf16", checkpoint_every=100)

    @classmethod
    def cpu(cls) -> Setup:
        return cls("cpu", "tiny", 64, 8, 2, 8, "fp32")


def spec_dict(s: Setup, run_dir: Path) -> dict[str, Any]:
    return {
        "name": "user-path",
        "model": {"preset": s.preset},
        "data": {"max_seq_len": s.seq},  # no data.path: the bundled synthetic set
        "training": {"global_batch": s.global_batch, "micro_batch": s.micro_batch, "steps": s.steps,
                     "precision": s.precision, "learning_rate": 1e-4, "warmup_steps": 2, "log_every": 1},
        "hardware": {"vendor": s.device, "gpus": 1},
        "memory": {"tier": "fast", "regrow_after": None},  # a regrow try would be a third, unplanned squeeze
        "checkpoints": {"dir": str(run_dir), "every_steps": s.checkpoint_every, "keep": 2},
        "output": {"export": False},  # not what is checked; a 1B export is seconds of the part's budget
    }  # fmt: skip


@dataclass
class LogWatch:
    """Every line the run prints (stdout and stderr merged), with the time it arrived here."""

    lines: list[tuple[float, str]] = field(default_factory=list)

    def follow(self, stream: Any) -> threading.Thread:
        def pump() -> None:
            for line in stream:
                self.lines.append((time.time(), line.rstrip("\n")))

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        return thread


def message(line: str) -> str:
    return _PREFIX.sub("", line).strip()


_REDO = re.compile(r"^step (\d+): redoing it at micro-batch ")  # a shrink's redo (runner/oom/shrink.py run_step) ends
# with the step ("step N recovered from its OOM: ...") or with its own OOM ("step N: out of memory ...": a new phase)


class Phases:
    """The phases open at each line of the log: "X ..." opens X, "X: done in W s" / "X: failed after W s" closes it
    (runner/phase.py); a shrink's redo is closed by its step's recovery or its next OOM."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        self.started = self.ended = 0

    def _close(self, what: str) -> None:
        self.open[what] -= 1
        self.ended += 1

    def feed(self, line: str) -> None:
        text = message(line)
        m = _END.match(text)
        if m and self.open.get(m["what"], 0) > 0:
            self._close(m["what"])
            return
        for what, n in list(self.open.items()):
            redo = _REDO.match(what)
            if n > 0 and redo and text.startswith((f"step {redo[1]} recovered from its OOM",
                                                   f"step {redo[1]}: out of memory")):  # fmt: skip
                self._close(what)
        if text.endswith(" ...") and not text.startswith("..."):
            self.open[text[:-4]] = self.open.get(text[:-4], 0) + 1
            self.started += 1

    def any_open(self) -> bool:
        return any(n > 0 for n in self.open.values())


def check_phases(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """Phases started and ended (`Phases`): the ones never ended, the number of each."""
    ph = Phases()
    for _, line in lines:
        ph.feed(line)
    return {"started": ph.started, "ended": ph.ended, "never_ended": sorted(k for k, v in ph.open.items() if v > 0)}


def longest_gap(lines: list[tuple[float, str]], t0: float, t1: float, *, unexplained: bool = False) -> float:
    """The longest silence of the log between t0 and t1 (unix seconds), its ends included. `unexplained`: only
    silences during which no phase was open (a phase that said "X ..." and has not ended explains its own)."""
    ph = Phases()
    best, last = 0.0, t0
    for t, line in lines:
        if t >= t1:
            break
        if t > t0:
            if not (unexplained and ph.any_open()):
                best = max(best, t - last)
            last = t
        ph.feed(line)
    return best if unexplained and ph.any_open() else max(best, t1 - last)


def rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def estimates(s: Setup, spec: Any) -> dict[str, int]:
    """The memory model's GPU bytes: fast at micro-batch 1, zero2_offload at micro-batch 1 (one rank)."""
    from jobspec.plan import memory
    from jobspec.plan.planner import estimate_kwargs, model_shape

    kw = estimate_kwargs(spec, 1, s.precision)
    shape = model_shape(spec)
    est = {
        t: memory.estimate(shape, tier=t, micro_batch=1, grad_accum=s.global_batch, **kw).gpu_bytes
        for t in ("fast", "zero2_offload")
    }
    return {"fast_mbs1": est["fast"], "zero2_offload_mbs1": est["zero2_offload"]}


def step_down_cap(est: dict[str, int]) -> int:
    """What the step-down squeeze leaves the run: between what zero2_offload needs at micro-batch 1 and what fast does,
    nearer zero2_offload (llama-1b: 14.0 and 25.7 GiB with the model's overhead -> 19.1 GiB with the run's context):
    fast fits only if the model overestimates it by over a quarter."""
    z2o, fast = est["zero2_offload_mbs1"], est["fast_mbs1"]
    return CONTEXT_BYTES + z2o + int(STEP_DOWN_SHARE * (fast - z2o))


class Hog:
    """bench/gpu/hog.py in its own process: `cap(bytes)` leaves the others that much of the GPU."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.gpu.hog"], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        assert self.proc.stdout is not None
        self.ready = self.proc.stdout.readline().strip()

    def command(self, text: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        try:
            self.command("quit")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired, AssertionError):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def fault_rules(rng: random.Random, steps: int) -> tuple[str, dict[str, Any]]:
    """CPU: JOBSPEC_FAULT_OOM for two OOMs at seeded random steps, each at a seeded random allocating op of its step.
    The first, at the spec's micro-batch 2, is shrunk to 1; the second lands at micro-batch 1 (regrow is off), where
    no micro-batch of `fast` is left: the tier steps down."""
    k1 = rng.randint(2, steps // 2 - 1)
    k2 = rng.randint(k1 + 2, steps - 2)
    op = rng.randint(1, 40)  # a tiny step has well over 40 allocating ops: forward, loss, backward, optimizer
    return f"step={k1},step={k2},op={op}", {"shrink_step": k1, "step_down_step": k2, "op": op}


def run(s: Setup, work: Path, seed: int = 0, timeout_s: float = 420.0) -> dict[str, Any]:
    """One run of the scenario; the figures and `failures` (empty: every requirement held)."""
    import yaml

    from jobspec.spec.loader import parse_spec

    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    spec_path = work / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(s, run_dir)))
    spec = parse_spec(spec_path.read_text())
    env = {k: v for k, v in os.environ.items() if k != "JOBSPEC_FAULT_OOM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out: dict[str, Any] = {"device": s.device, "preset": s.preset, "seed": seed, "seq": s.seq,
                           "global_batch": s.global_batch, "steps": s.steps, "squeezes": []}  # fmt: skip
    hog: Hog | None = None
    if s.device == "cpu":
        env["JOBSPEC_FAULT_OOM"], planned = fault_rules(rng, s.steps)
        out.update(faults=env["JOBSPEC_FAULT_OOM"], **planned)
    else:
        est = estimates(s, spec)
        out["model_bytes"] = est
        if not s.caching:
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        out["caching_allocator"] = s.caching
        hog = Hog()  # before the run: its own context is what it sees taken at start
        out["hog"] = hog.ready
    watch = LogWatch()
    t_launch = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "jobspec", "run", str(spec_path)], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    watch.follow(proc.stdout)
    metrics = run_dir / "metrics.jsonl"
    try:
        if hog is not None:
            try:
                _squeeze(s, hog, proc, metrics, rng, out, t_launch + timeout_s)
            except (OSError, ValueError, KeyError) as err:  # the hog died (no GPU?), a record without its fields
                out["squeeze_error"] = f"{type(err).__name__}: {err} (hog: {hog.ready!r})"[:500]
        try:
            proc.wait(timeout=max(1.0, t_launch + timeout_s - time.time()))
        except subprocess.TimeoutExpired:
            out["timeout"] = f"no end after {timeout_s:.0f} s: killed"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if hog is not None:
            hog.close()
    time.sleep(0.2)  # the reader thread's last lines
    out["exit_code"] = proc.returncode
    out["wall_s"] = round(time.time() - t_launch, 2)
    judge(s, out, rows(metrics), watch.lines, t_launch)
    out["log_tail"] = [line for _, line in watch.lines[-25:]]
    return out


def _squeeze(s: Setup, hog: Hog, proc: subprocess.Popen, metrics: Path, rng: random.Random, out: dict[str, Any],
             deadline: float) -> None:  # fmt: skip
    """GPU: two squeezes at random steps, a random fraction of a step into each."""
    est = out["model_bytes"]
    plan = _wait(metrics, lambda r: r.get("kind") == "plan", proc, deadline)
    if plan is None:
        return
    fixed, per_sample, mbs = int(plan["fixed_bytes"]), int(plan["per_sample_bytes"]), int(plan["micro_batch"])
    shrink_cap = CONTEXT_BYTES + fixed + per_sample * max(1, mbs // 2)
    k1 = rng.randint(2, 3)
    k2 = rng.randint(k1 + 3, s.steps - 3)
    for name, step, cap in (("shrink", k1, shrink_cap), ("step-down", k2, step_down_cap(est))):
        before = _wait(metrics, lambda r, k=step: r.get("kind") == "train" and r["step"] == k - 1, proc, deadline)
        if before is None:
            out["squeezes"].append({"squeeze": name, "error": f"step {step - 1} never recorded"})
            return
        trains = [r for r in rows(metrics) if r.get("kind") == "train"]
        step_s = (trains[-1]["time"] - trains[-2]["time"]) if len(trains) >= 2 else 1.0
        delay = rng.uniform(0.05, 0.95) * step_s
        time.sleep(delay)
        t = time.time()
        answer = hog.command(f"cap {cap}")
        out["squeezes"].append({"squeeze": name, "at_step": step, "delay_s": round(delay, 3), "at": round(t, 3),
                                "cap_gib": round(cap / GiB, 2), "hog": answer,
                                "step_s": round(step_s, 3)})  # fmt: skip


def _wait(metrics: Path, want: Any, proc: subprocess.Popen, deadline: float) -> dict[str, Any] | None:
    while time.time() < deadline and proc.poll() is None:
        for r in rows(metrics):
            if want(r):
                return r
        time.sleep(0.05)
    return None


def recoveries(train: list[dict[str, Any]], shrinks: list[dict[str, Any]],
               changes: list[dict[str, Any]]) -> list[tuple[float, float]]:  # fmt: skip
    """(first OOM, end) of each step that ran out: a shrunk step's recovery ends with its redone step's record (the
    redo is a phase the runner opens), a step-down's with the `tier_change` event ("resuming at step N"), written
    when the next tier is built. An `oom_shrink` names the step it redoes, a `tier_change` the last step done."""
    starts: dict[int, float] = {}
    for e in shrinks:
        if isinstance(e.get("oom_at"), int | float) and e["oom_at"] > 0:
            starts[e["step"]] = min(starts.get(e["step"], e["oom_at"]), e["oom_at"])
    ends = {c["step"] + 1: c["time"] for c in changes if isinstance(c.get("time"), int | float)}
    for c in changes:
        starts[c["step"] + 1] = min(starts.get(c["step"] + 1, c["oom_at"]), c["oom_at"])
    out = []
    for step, t0 in sorted(starts.items()):
        done = ends.get(step) or next((r["time"] for r in train if r["step"] == step and r["time"] >= t0), None)
        if done is not None:
            out.append((t0, done))
    return out


def judge(s: Setup, out: dict[str, Any], recs: list[dict[str, Any]], lines: list[tuple[float, str]],
          t_launch: float) -> None:  # fmt: skip
    """The requirements, each a failure line when it does not hold; the figures beside them."""
    fail: list[str] = []
    train = [r for r in recs if r.get("kind") == "train"]
    shrinks = [r for r in recs if r.get("event") == "oom_shrink"]
    changes = [r for r in recs if r.get("event") == "tier_change"]
    steps = [r["step"] for r in train]
    out["train_steps"] = steps
    out["tiers"] = [r["tier"] for r in train]
    out["micro_batches"] = [r["micro_batch"] for r in train]
    out["shrinks"] = [f"{e['from_micro_batch']}->{e['to_micro_batch']} at step {e.get('step')}" for e in shrinks]
    out["tier_changes"] = [{k: v for k, v in e.items() if k not in ("kind", "event", "reason")} for e in changes]
    if out.get("exit_code") != 0:
        fail.append(f"exit code {out.get('exit_code')} (expected 0)")
    if steps != list(range(1, s.steps + 1)):
        fail.append(f"train records of steps {steps}, expected 1..{s.steps} each once")
    bad = [r["step"] for r in train if r["micro_batch"] * r["grad_accum"] * r["world_size"] != s.global_batch
           or r["global_batch"] != s.global_batch]  # fmt: skip
    if bad:
        fail.append(f"global batch changed at steps {bad}")
    if not shrinks:
        fail.append("no in-process shrink (oom_shrink event)")
    in_process = [e for e in changes if e.get("in_process")]
    if not in_process:
        fail.append("no in-process tier step-down (tier_change event with in_process)")
    phases = check_phases(lines)
    out["phases"] = phases
    if phases["never_ended"]:
        fail.append(f"phases started and never ended: {phases['never_ended'][:5]}")
    first = train[0]["time"] if train else None
    out["startup_to_step1_s"] = round(first - t_launch, 2) if first else None
    windows = recoveries(train, shrinks, in_process)
    out["recoveries"] = [{"from_oom": round(t0, 3), "to_step": round(t1, 3), "seconds": round(t1 - t0, 2)}
                         for t0, t1 in windows]  # fmt: skip
    if windows:
        out["longest_log_silence_s"] = round(max(longest_gap(lines, t0, t1) for t0, t1 in windows), 2)
        gap = max(longest_gap(lines, t0, t1, unexplained=True) for t0, t1 in windows)
        out["longest_unexplained_silence_s"] = round(gap, 2)
        if gap > GAP_LIMIT_S[s.device]:
            fail.append(f"the log was silent {gap:.1f} s with no phase open during a recovery (limit "
                        f"{GAP_LIMIT_S[s.device]:g} s)")  # fmt: skip
    if in_process:
        change = in_process[0]
        out["step_down_s"] = change["seconds"]
        # the whole step-down: the checkpoint and tier state written when the tier gave up, then the next tier
        total = float(change["seconds"]) + float(change.get("give_up_s") or 0.0)
        out["step_down_total_s"] = round(total, 2)
        after = next((r for r in train if r["tier"] == change["to_tier"]), None)
        if after is not None:
            out["oom_to_step_after_step_down_s"] = round(after["time"] - change["oom_at"], 2)
        if s.device == "cuda" and total > STEPDOWN_GOAL_S:
            fail.append(f"step-down took {total:.1f} s in process (give-up included; goal <= {STEPDOWN_GOAL_S:g} s)")
    if s.device == "cuda" and first and first - t_launch > STARTUP_GOAL_S:
        out["startup_note"] = f"start-up to step 1 {first - t_launch:.1f} s (goal <= {STARTUP_GOAL_S:g} s)"
    if out.get("timeout"):
        fail.append(out["timeout"])
    if out.get("squeeze_error"):
        fail.append(f"the squeeze failed: {out['squeeze_error']}")
    out["failures"] = fail
    out["ok"] = not fail


PART_MARGIN_S = 12.0  # of the suite part's budget: the hog's and the run's ends, the record's write


def part(cfg: Any, work: Path, budget: Any, save: Any, record: dict[str, Any]) -> None:
    """The suite's part `userpath` (bench/gpu/suite.py): one GPU run within the part's budget. `--smoke` does not run
    it: its CPU analog is tests/runner/oom/test_user_path.py, in the normal suite (about a minute and a half here)."""
    if cfg.smoke:
        record["userpath"] = {"status": "skipped in --smoke: its CPU analog is tests/runner/oom/test_user_path.py"}
        save()
        return
    seconds = budget.left() - PART_MARGIN_S
    if seconds < 30:
        record["userpath"] = {"status": budget.skip_note()}
        save()
        return
    record["userpath"] = {"status": f"running (at most {seconds:.0f} s)"}
    save()
    record["userpath"] = run(Setup.gpu(), work / "userpath", cfg.userpath_seed, timeout_s=seconds)
    save()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="the tiny preset with fault injection on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--caching", action="store_true", help="GPU: keep the run's caching allocator on")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds before the run is killed")
    p.add_argument("--out", type=Path, default=None, help="write userpath.json here")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    args = p.parse_args(argv)
    setup = Setup.cpu() if args.cpu else Setup.gpu()
    setup.caching = args.caching
    work = Path(tempfile.mkdtemp(prefix="jobspec-userpath-"))
    try:
        result = run(setup, work, args.seed, args.timeout)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "userpath.json").write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
