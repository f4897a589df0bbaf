"""The training recipe of one rank: `Recipe(spec)`, `setup()`, `train()`, `cleanup()` (torchtune's shape).

`Recipe(spec)` checks what it can without a GPU, `setup()` takes the run directory's lease (rank 0,
runner/checkpoint/lease.py), probes, plans, builds data, model, optimizer and accelerate, resumes from the newest
intact checkpoint (damaged ones are skipped: runner/checkpoint/store.py) and checks the volume has room for
the next one, `train()` runs the loop and returns the exit code, `cleanup()` releases everything. The
loop is nanoGPT-plain: step ids -> `Stepper.train_step` -> log / eval / checkpoint. `runner/process/worker.py`
runs it as a process.

Debugging aid: JOBSPEC_RECORD_SAMPLES=1 makes every rank append `{step, rank, micro_batch, grad_accum,
ids}` per optimizer step to `<checkpoints.dir>/samples-rank<R>.jsonl` (the ids it actually trained on).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from jobspec import shared_dir
from jobspec.catalog import tiers
from jobspec.contract import EXIT_OK, EXIT_OOM_RETRY_TIER, EXIT_PREEMPTED, METRICS_FILE, TIER_STATE_FILE
from jobspec.errors import ConfigError
from jobspec.plan.planner import rows_per_sample
from jobspec.spec.models import JobSpec
from jobspec.spec.units import human_bytes
from runner import internals
from runner.checkpoint import remote, run_files, store
from runner.checkpoint.lease import Lease, LeaseHeld, check_holder
from runner.checkpoint.lineage import check_resume, lineage
from runner.data.dataset import PAD_MULTIPLE, data_order, load_data, rank_slice, total_steps
from runner.data.loader import Prefetcher
from runner.data.preference import PreferenceData, load_preference
from runner.data.stream import StreamData, load_stream
from runner.data.tokenizer import load_tokenizer
from runner.dist import Control, DistEnv, destroy_process_group, init_process_group
from runner.model.build import build_model
from runner.model.packing import confine_packing
from runner.oom import faults, ladder
from runner.oom.detect import is_oom, next_micro_batch, oom_guard, release_memory
from runner.oom.shrink import RankOOM, RecipeGuard, TierOOM, apply_cap, reset_wrapper
from runner.output import tracking
from runner.output.metrics import GpuUtil, Metrics, Progress, memory_bytes
from runner.sizing import traced
from runner.sizing.plan import (
    Plan,
    agree,
    initial_plan,
    measured_here,
    model_shape,
    size_for_tier,
    verify_micro_batch,
    with_micro_batch,
)
from runner.sizing.probe import describe, probe_host
from runner.train import engine, handoff, update
from runner.train.objectives import Objective
from runner.train.reference import attach_reference
from runner.train.step import EvalOOM, Preempted, Stepper, StepResult, StopFlag, get_lr

log = logging.getLogger("jobspec.runner")


class Recipe:
    """One rank's training run; OOM handling (shrink, tier ladder) is `self.guard` (runner/oom/shrink.py)."""

    def __init__(self, spec: JobSpec, env: DistEnv | None = None, stop: StopFlag | None = None,
                 fence: Callable[[], None] | None = None):  # fmt: skip
        gpu = spec.hardware.vendor != "cpu" and torch.cuda.is_available()
        if spec.training.precision == "fp16" and not gpu:  # rejected before any work is done
            raise ConfigError(
                f"training.precision fp16 needs a GPU (hardware.vendor {spec.hardware.vendor}, none visible): "
                "use bf16 or fp32"
            )
        self.spec, self.env = spec, env or DistEnv.from_env()
        tracking.check_packages(spec)  # a missing tracker client is a config error, found before any work
        self.root = Path(spec.run_dir)  # local; with an s3:// checkpoints.dir the steps are published there too
        self.bucket = remote.Bucket(spec.remote_dir) if spec.remote_dir else None  # runner/checkpoint/remote.py
        self.lease_file = remote.RemoteLeaseFile(self.bucket) if self.bucket else None  # the lease in the bucket
        self.stop = StopFlag() if stop is None else stop  # the worker's is installed for its whole life (worker.py)
        self.owns_stop = stop is None
        # Called right before this rank writes what the gang shares (checkpoint, metrics line, samples, lease):
        # raises, or ends the process, when the gang has moved on without it (runner/process/heartbeat.py).
        gang = fence or (lambda: None)

        def fenced() -> None:  # the heartbeat's verdict, then the run directory's: still the attempt that holds it
            gang()
            if self.attempt:
                check_holder(self.root, self.attempt, self.spec.name, self.lease_file)

        self.fence = fenced
        self.attempt = ""  # rank 0's lease holder when this attempt started, known to every rank (_take_lease)
        self.lease: Lease | None = None  # rank 0's claim on the run directory (runner/checkpoint/lease.py)
        self.step = 0  # optimizer steps completed
        self.first_step = 0  # where this process started (the resumed step)
        self.saved_step = -1  # step of the last checkpoint written or resumed from
        self.status: dict[str, Any] = {"tier": None, "step": 0, "loss": None, "reason": "starting"}
        self.metrics: Metrics | None = None
        self.progress: Progress | None = None
        self.record_samples = os.environ.get("JOBSPEC_RECORD_SAMPLES") == "1"
        self.eval_loss: float | None = None
        self.started = time.perf_counter()
        self.trained_tokens = 0  # input tokens (padding excluded) trained on by this process's run
        self.exported: Path | None = None
        self.task_dir = Path.cwd()  # eval.benchmarks' task files are relative to it (the worker: the spec file's dir)
        self.state_from = "checkpoint"  # where the last _build took the trained state from ("memory": a step-down)

    # --- setup ------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before the first step. A stop signal meanwhile ends it at once (`Stopped`): nothing has
        been trained since the last checkpoint, and a long build must not outlast the pod's grace period."""
        if self.owns_stop:
            self.stop.install()
        with self.stop.immediate():
            self._setup()

    def _setup(self) -> None:
        spec, env = self.spec, self.env
        self.host = probe_host()
        self.device, self.dev = engine.pick_device(spec, env.local_rank, self.host)
        log.info("%s", describe(self.dev, self.host))
        init_process_group(env, self.device, needed=False, timeout_s=spec.scheduling.collective_timeout_seconds)
        self.ctrl = Control(env.world_size)
        self._take_lease()
        # data.packing only where the model confines attention to each record (else off, and the log says why)
        self.spec = spec = confine_packing(spec, self.device, self.ctrl.any)

        self.tokenizer = load_tokenizer(spec.model.path, model_shape(spec).vocab)
        if spec.data.streaming:  # read and tokenized as the steps need it, by a thread (runner/data/stream.py)
            self.data = load_stream(spec, self.tokenizer, env.rank, env.world_size, write_index=env.is_main)
            self.order = self.data.order
        else:  # DPO: pairs, chosen and rejected in one micro-batch (runner/data/preference.py)
            pairs = spec.training.objective != "sft"  # dpo, simpo, orpo
            self.data = load_preference(spec, self.tokenizer) if pairs else load_data(spec, self.tokenizer)
            self.order = data_order(spec, self.data)  # several sources: mixed by weight (runner/data/mix.py)
        # Samples of each source trained since the last train record (several sources only).
        self.mixed = [0] * len(self.data.sources) if len(self.data.sources) > 1 else None
        self.total_steps = total_steps(spec, self.order)
        self.lineage = lineage(spec, self.data.train)
        resume = self._resume_point()  # verified; damaged ones skipped
        meta = store.read_meta(resume) if resume else None
        if meta is not None:
            check_resume(meta.get("lineage"), self.lineage, where=f"checkpoint {resume}",
                         force=spec.checkpoints.resume == "force")  # fmt: skip
        self.plan = self._plan(meta)
        self._build(resume, meta)
        store.ensure_space(self.root, self.model, rank=env.rank, ctrl=self.ctrl,
                                trainable_only=spec.model.lora is not None)  # fmt: skip
        if self.lease is not None:
            self.lease.beat(force=True)  # setup may have taken long (a big model, probe steps)
        self.first_step = self.step
        self.status.update(tier=self.plan.tier, step=self.step, reason="running")
        config = {"spec": spec.to_yaml_dict(), "plan": {k: v for k, v in self.plan.to_dict().items() if k != "reasons"}}
        objective = self.stepper.objective
        extra = (*(objective.metric_names if objective else ()), *(("router_aux_loss",) if self.stepper.router_aux_coef
                                                                      else ()))  # fmt: skip
        trackers = tracking.Trackers(spec, self.root, enabled=env.is_main, config=config, extra=extra)
        self.metrics = Metrics(self.root / METRICS_FILE, enabled=env.is_main, trackers=trackers)
        self._write_plan(resumed=resume is not None)
        self.gpu_util = GpuUtil(self.device)

    def _take_lease(self) -> None:
        """Rank 0 takes the run directory's lease (runner/checkpoint/lease.py); every rank stops when it cannot."""
        held: ConfigError | None = None
        if self.env.is_main:
            try:
                self.lease = Lease(self.root, self.spec.name, file=self.lease_file)
                self.lease.acquire()
            except ConfigError as err:  # LeaseHeld, or a bad JOBSPEC_LEASE_TIMEOUT_S
                held = err
        if self.ctrl.any(held is not None):
            raise held or LeaseHeld(f"{self.root} is in use by another run (rank 0's log names it)")
        # Every rank learns which lease stands for this attempt: before each shared write it checks that the lease
        # is still that one (lease.check_holder), so a rank of an attempt the gang left behind writes nothing.
        self.attempt = self.ctrl.from_rank0(self.lease.holder if self.lease is not None else "")

    def _build(self, resume: Path | None, meta: dict[str, Any] | None, kept: handoff.Handoff | None = None, *,
               verify: bool = True) -> None:  # fmt: skip
        """Model, optimizer, accelerator and stepper at `self.plan`, the state of `resume` (a checkpoint) or of
        `kept` (handed over in memory by an in-process tier step-down, which runs this again; the newest
        checkpoint when the new tier cannot take it), the loader from that step, and the OOM guard."""
        spec, env = self.spec, self.env
        internals.check(self.plan.tier, env.world_size, self.device.type)  # before any work at this tier
        if spec.training.loss_kernel == "liger":
            internals.check_liger(self.device.type)
        if self.plan.tier != "fast":
            timeout_s = spec.scheduling.collective_timeout_seconds
            init_process_group(env, self.device, needed=True, timeout_s=timeout_s)  # FSDP: a group even alone
        model = build_model(
            spec,
            bos=getattr(self.tokenizer, "BOS", self.tokenizer.eos_id),
            eos=self.tokenizer.eos_id,
            vocab=self.tokenizer.vocab_size,
            precision=self.plan.precision,
            quantize=self.plan.quantize,
            shards=self.plan.world_size,
        )
        optimizer = engine.make_optimizer(model, spec, self.device, self.plan.tier)
        self.accelerator, self.model, self.optimizer = engine.prepare(self.plan, spec, self.device, model, optimizer)
        self.stepper = Stepper(
            self.accelerator,
            self.model,
            self.optimizer,
            self.data,
            self.ctrl,
            self.stop,
            max_grad_norm=spec.training.max_grad_norm,
            loss_kernel=spec.training.loss_kernel,
            objective=Objective.of(spec.training),
            rows=rows_per_sample(spec),
        )
        dpo = spec.training.objective == "dpo"  # SimPO and ORPO are reference-free
        if dpo and isinstance(self.data, PreferenceData):  # the starting model's, before any checkpoint is loaded
            attach_reference(self.stepper, self.data, spec, precision=self.plan.precision, quantize=self.plan.quantize,
                             micro_batch=self.plan.micro_batch, is_main=env.is_main)  # fmt: skip
        probe_faults = faults.probe_injector(self.model, rank=env.rank, tier=self.plan.tier, run_dir=self.root)
        # every rank probes when any does (a fault rule for one rank makes the CPU probe): the steps are collective
        probing = self.dev.is_gpu or self.ctrl.any(probe_faults is not None)
        if verify and probing and (meta is None or self.plan.to_dict() != meta["plan"]):
            self._verify_micro_batch(probe_faults)  # a new plan: real probe steps check it
        if probe_faults is not None:
            probe_faults.remove()
        handed = kept is not None and self._give_state(kept)
        if kept is not None and not handed:  # the new tier cannot take it: the newest checkpoint, as before
            resume = self._newest_checkpoint()
        self.state_from = "memory" if handed else "checkpoint"  # for the step-down's log and event
        if resume is not None:
            meta = store.load(
                resume,
                self.model,
                self.optimizer,
                rank=env.rank,
                ctrl=self.ctrl,
                trainable_only=spec.model.lora is not None,
            )
            self.step = self.saved_step = int(meta["step"])
            log.info("resumed from %s: step %d of %d", resume, self.step, self.total_steps)
        update.prime(self.stepper.inner, self.stepper.params)  # Adam's state now: the first step allocates none
        pin = self.plan.pin_memory and self.device.type == "cuda"  # workers collate the next steps meanwhile
        # A stream is tokenized ahead by its own thread, in this process: collating it is cheap, and no worker can
        # take it (runner/data/stream.py).
        workers = 0 if isinstance(self.data, StreamData) else self.plan.num_workers
        self.stepper.prefetch = Prefetcher(self.data, self.step_ids, start=self.step, total=self.total_steps,
                                           micro_batch=self.plan.micro_batch, num_workers=workers,
                                           pin_memory=pin)  # fmt: skip
        self.guard = RecipeGuard(self)  # OOM: in-process shrink, fault injection, hand-over to the tier ladder

    def _write_plan(self, *, resumed: bool) -> None:
        self.metrics.write(
            {
                "kind": "plan",
                "step": self.step,
                "resumed": resumed,
                "total_steps": self.total_steps,
                "pid": os.getpid(),
                "device": self.device.type,
                **self.plan.to_dict(),
            }
        )

    def _teardown(self) -> None:
        """Release the model, optimizer, accelerator, loader and OOM guard (the process group stays)."""
        self.guard.close()
        self.stepper.prefetch.close()
        self.stepper = self.model = self.optimizer = self.accelerator = self.guard = None  # type: ignore[assignment]
        internals.reset_accelerate()  # the next Accelerator may carry another FSDP plugin
        release_memory()

    def _plan(self, meta: dict[str, Any] | None) -> Plan:
        """The checkpoint's plan when resuming the same batch on the same world size, else a fresh one; agreed."""
        spec, world = self.spec, self.env.world_size
        plan, tier = None, ladder.current_tier(self.root, spec.memory.tier)  # a tier the OOM ladder moved to wins
        if meta is not None:
            if meta.get("spec_hash") != spec.spec_hash():
                log.warning(
                    "resuming a checkpoint written by another spec (hash %s, now %s)",
                    meta.get("spec_hash"),
                    spec.spec_hash(),
                )
            saved = Plan.from_dict(meta["plan"])
            same_batch = saved.world_size == world and saved.global_batch == spec.training.global_batch
            if same_batch and tier in ("auto", saved.tier):
                plan = saved
                log.info(
                    "plan from checkpoint step %d: tier %s, micro-batch %d x %d",
                    meta["step"],
                    plan.tier,
                    plan.micro_batch,
                    plan.grad_accum,
                )
                asked = spec.training.micro_batch
                if isinstance(asked, int) and asked != plan.micro_batch:  # the spec wins: same training, other cut
                    plan = with_micro_batch(
                        plan,
                        asked,
                        f"micro-batch {plan.micro_batch} -> {asked}: training.micro_batch changed since the checkpoint "
                        f"(accumulation {plan.grad_accum} -> {plan.per_rank // asked}, global batch "
                        f"{plan.global_batch} unchanged)",
                        micro_batch_fixed=True,
                    )
        local = self.env.local_world_size
        if plan is None and tier != spec.memory.tier:
            why = [f"tier {tier} from {TIER_STATE_FILE} (the OOM ladder; the spec says {spec.memory.tier})"]
            plan = size_for_tier(spec, self.dev, self.host, world, tier, local_ranks=local, reasons=why)
        if plan is None:
            plan = initial_plan(spec, self.dev, self.host, world, local_ranks=local)
            if traced.wanted(spec, self.dev.is_gpu):
                if measured_here(spec, plan.tier):
                    plan = traced.skipped(plan, "this run directory measured the tier on the GPU before, which wins")
                else:
                    share = partial(self.ctrl.all_reduce, op="max")
                    plan = traced.from_traces(plan, spec, share, is_main=self.env.rank == 0, replan=lambda tier: (
                        size_for_tier(spec, self.dev, self.host, world, tier, local_ranks=local)))  # fmt: skip
        return agree(
            apply_cap(plan, self.root),
            self.ctrl.reduce_min,
            replan=lambda tier: size_for_tier(spec, self.dev, self.host, world, tier, local_ranks=local),
        )

    def _verify_micro_batch(self, injector: faults.FaultInjector | None = None) -> None:
        """Real probe steps on the GPU (on CPU an OOM is the kernel's kill, not an exception: nothing to probe,
        unless JOBSPEC_FAULT_OOM's `probes` injects them; `op=N,during=probe` counts the probe steps from 1)."""
        seq = min(self.plan.seq_len, -(-self.data.longest // PAD_MULTIPLE) * PAD_MULTIPLE)  # widest micro-batch
        cuda = self.device.type == "cuda"
        rng = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()

        def probe(mbs: int) -> bool:
            if injector is not None:
                injector.step += 1
            return self.stepper.probe_step(mbs, seq)  # False: an OOM on some rank, agreed by all

        if injector is not None:
            self.stepper.faults = injector.region
        try_step = oom_guard(probe, budget_bytes=self.plan.budget_bytes, reset=lambda: reset_wrapper(self.model))
        try:
            self.plan = verify_micro_batch(self.plan, try_step, reduce_min=self.ctrl.reduce_min)
        finally:
            self.stepper.faults = lambda _during, _mbs: nullcontext()
        self.stepper.reset_optimizer()
        if cuda:
            torch.cuda.set_rng_state(rng, self.device)
        else:
            torch.set_rng_state(rng)

    # --- train ------------------------------------------------------------------------------------------

    def lr(self, step: int) -> float:
        t = self.spec.training
        return get_lr(step, t.peak_lr, t.warmup_steps, self.total_steps, t.min_lr_ratio)

    def step_ids(self, step: int) -> list[int]:
        """This rank's contiguous share of the samples of optimizer step `step` (0-based)."""
        return rank_slice(self.order.step_samples(step), self.env.rank, self.env.world_size)

    def train_step(self, step: int) -> StepResult:
        """Optimizer step `step` at the plan's micro-batch; on OOM redone at a smaller one (runner.oom.shrink)."""
        return self.guard.train_step(step)

    def train(self) -> int:
        """Train to `total_steps`; returns the exit code (0, or 143 after a SIGTERM checkpoint).

        An OOM that micro-batch 1 cannot absorb steps down a tier in this process when every rank agreed
        on it (`_step_down`); otherwise it ends here with 75/76 and the supervisor (or the Job) relaunches.
        """
        while True:
            try:
                return self._loop()
            except TierOOM as err:  # micro-batch 1 ran out: checkpoint, persist "tier X failed"
                oom_at, t0 = time.time(), time.perf_counter()
                code = self.guard.give_up(err)
                if code != EXIT_OOM_RETRY_TIER or not self._can_step_down(err):
                    if self.bucket is not None and self.env.is_main:  # the ladder's state, for a pod created again
                        run_files.put(self.spec.checkpoints.dir, self.root)
                    return code  # 76, or the relaunch fallback (75)
                self._step_down(err, oom_at, give_up_s=time.perf_counter() - t0)

    def _loop(self) -> int:
        t, ck = self.spec.training, self.spec.checkpoints
        if self.progress is None:
            self.progress = Progress(self.total_steps, self.step, enabled=self.env.is_main)
        mine = rank_slice(self.data.eval_order(), self.env.rank, self.env.world_size)
        self.eval_ids = mine[: t.eval_batches * self.plan.micro_batch]
        tic, tokens = time.perf_counter(), 0
        check = self.device.type == "cuda" and self.step < self.total_steps
        if check:  # the first step's own peak, not the probe steps'
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            while self.step < self.total_steps:
                result = self.train_step(self.step)
                if check:
                    self._memory_check()
                    check = False
                self.step += 1
                self.status["step"] = self.step
                tokens += result.tokens
                self.trained_tokens += result.tokens
                if self.mixed is not None:  # the step's global samples, whichever share this rank trained
                    counts = self.order.step_counts(self.step - 1)
                    self.mixed = [a + int(b) for a, b in zip(self.mixed, counts, strict=True)]
                if self.record_samples:
                    self._record_samples(result.sample_ids)
                if self.step in (1, self.total_steps) or self.step % t.log_every == 0:
                    self._log_step(result, tokens / (time.perf_counter() - tic))
                    tic, tokens = time.perf_counter(), 0
                self.progress.update(self._bar_loss(result))
                if self.lease is not None:
                    self.fence()
                    self.lease.beat()  # a clock check; the file is rewritten every lease.interval seconds
                if (t.eval_every and self.step % t.eval_every == 0) or self.step == self.total_steps:
                    self._evaluate(final=self.step == self.total_steps)
                if self.step % ck.every_steps == 0 or self.step == self.total_steps:
                    self._save(final=self.step == self.total_steps)
            if self.step:
                self._save(final=True)  # written above, unless a tier step-down interrupted the last step's save
        except Preempted:
            return self._preempted()
        self.status["reason"] = "done"
        if self.env.is_main and self.spec.output.export:
            self._export()
            if self.spec.eval.benchmarks:
                self._benchmarks()
        self._summary()
        return EXIT_OK

    def _preempted(self) -> int:
        """Every rank agreed to stop: checkpoint the steps trained since the last checkpoint, if any, and say
        truthfully what was written (rank 0's reason becomes the termination message)."""
        signum, step = self.stop.signum, self.step
        if step == self.saved_step:
            reason = f"stopped at step {step}: nothing new since checkpoint step-{step}, which the next start resumes"
        elif step == 0:
            reason = "stopped before the first step: no checkpoint written (nothing trained yet)"
        else:
            log.warning("stop requested (signal %s): checkpointing step %d and exiting", signum, step)
            self._save()
            reason = f"preempted at step {step}: checkpoint step-{step} written"
        log.warning("%s", reason)
        self.status["reason"] = reason
        return EXIT_PREEMPTED

    def _can_step_down(self, err: TierOOM) -> bool:
        """Whether the next tier can start in this process: every rank knows (not a rank-local FSDP OOM),
        and the device still works (a CUDA error can leave the context unusable: then a new process)."""
        if err.local or err.cap is not None:
            return False
        if os.environ.get("JOBSPEC_STEP_DOWN", "in_process") == "restart":  # the fallback path, for benchmarks
            log.info("JOBSPEC_STEP_DOWN=restart: leaving the tier step-down to a new process")
            return False
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception as exc:  # a sticky CUDA error: only a new process recovers
                log.warning("device unusable after the OOM (%s): relaunching instead of stepping down in process",
                            exc)  # fmt: skip
                return False
        return True

    def _step_down(self, err: TierOOM, oom_at: float, give_up_s: float = 0.0) -> None:
        """The next tier in this process: release everything, plan the tier, rebuild, and go on from the step
        the OOM interrupted, redone from the same samples. When the weights were intact (give_up has written
        them as a checkpoint, the fallback should this process die), the state is handed over in memory
        (runner/train/handoff.py); otherwise, or when the new tier cannot take it, it comes from the newest
        checkpoint. No probe steps: the planner's micro-batch for the new tier is tried by the step itself, and
        the in-process shrink corrects it (probes cost several full steps at the longest rows, on a GPU most of a
        step-down's time). `oom_at`: when the OOM reached `train` (unix time); `give_up_s`: the checkpoint and
        tier state written before (both for the event, with where the rest of the time went)."""
        t0, old = time.perf_counter(), self.plan
        nxt = tiers.next_tier(err.tier, self.env.world_size)  # what give_up recorded, computed by every rank
        assert nxt is not None  # give_up returned 75: a next tier exists
        parts = {"give_up_s": give_up_s}
        mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            parts[name], mark = now - mark, now

        kept = self._take_state(err)
        lap("take_state_s")
        self._teardown()
        lap("teardown_s")
        why = [f"tier {old.tier} -> {nxt} in process after an OOM at micro-batch 1: {err.reason}"]
        local = self.env.local_world_size
        plan = size_for_tier(self.spec, self.dev, self.host, self.env.world_size, nxt, local_ranks=local, reasons=why)
        self.plan = agree(apply_cap(plan, self.root), self.ctrl.reduce_min)
        resume = self._newest_checkpoint() if kept is None else None
        lap("plan_s")
        with self.stop.immediate():  # give_up checkpointed the steps: a stop here loses none
            self._build(resume, None, kept, verify=False)
        lap("build_s")
        del kept  # the host copies
        self.status.update(tier=self.plan.tier, step=self.step, reason="running")
        seconds = time.perf_counter() - t0
        source = {"memory": "the state handed over in memory", "checkpoint": f"checkpoint step-{self.step}"}
        log.warning("tier %s -> %s in process in %.2f s; resuming at step %d from %s, micro-batch %d x %d",
                    old.tier, self.plan.tier, seconds, self.step, source[self.state_from] if self.step else "scratch",
                    self.plan.micro_batch, self.plan.grad_accum)  # fmt: skip
        self.metrics.write({"kind": "event", "event": "tier_change", "step": self.step, "from_tier": old.tier,
                            "to_tier": self.plan.tier, "in_process": True, "seconds": round(seconds, 3),
                            "state": self.state_from if self.step else "none", "oom_at": round(oom_at, 3),
                            "reason": err.reason, **{k: round(v, 4) for k, v in parts.items()}})  # fmt: skip
        self._write_plan(resumed=self.step > 0)

    def _newest_checkpoint(self) -> Path | None:
        """The checkpoint a step-down without the state in memory resumes from (collective); none: step 0."""
        resume = self._resume_point()
        if resume is None:
            self.step = 0
        return resume

    def _resume_point(self) -> Path | None:
        """The verified checkpoint every rank resumes from (collective); with an object store, first the bucket's
        newest intact step downloaded into the local run directory of every node (runner/checkpoint/remote.py)."""
        env = self.env
        if self.bucket is not None:
            remote.fetch(self.bucket, self.root, rank=env.rank, local_rank=env.local_rank,
                         local_world_size=env.local_world_size, ctrl=self.ctrl)  # fmt: skip
        return store.resume_point(self.root, rank=env.rank, ctrl=self.ctrl)

    def _take_state(self, err: TierOOM) -> handoff.Handoff | None:
        """The trained state to hand to the next tier in memory, when every rank can (weights intact: the
        OOM came before the optimizer step); None: the next tier loads the newest checkpoint."""
        if not err.weights_intact or os.environ.get("JOBSPEC_STEP_DOWN") == "checkpoint":
            return None
        room = None  # one CPU process: the host copies are the tensors themselves, or replace them
        if self.device.type != "cpu":
            room = int(handoff.HOST_SHARE * probe_host().available_bytes / self.env.local_world_size)
        try:
            kept = handoff.take(self.accelerator.unwrap_model(self.model), self.optimizer, rank=self.env.rank,
                                world=self.env.world_size, trainable_only=self.spec.model.lora is not None,
                                room=room)  # fmt: skip
        except (RuntimeError, MemoryError) as exc:  # the host copies did not fit: the checkpoint has it all
            kept = f"{type(exc).__name__}: {exc}"
        why = kept if isinstance(kept, str) else None
        if self.ctrl.any(why is not None):
            log.warning("tier step-down: the next tier loads the checkpoint instead of the state in memory (%s)",
                        why or "another rank cannot hand it over")  # fmt: skip
            return None
        return kept  # type: ignore[return-value]

    def _give_state(self, kept: handoff.Handoff) -> bool:
        """Write the handed-over state into the new tier; False on every rank when any cannot take it (the
        caller then loads the checkpoint, which overwrites whatever was written)."""
        model = self.accelerator.unwrap_model(self.model)
        why = handoff.fits(kept, model, self.optimizer)
        if why is None:
            try:
                handoff.give(kept, model, self.optimizer)
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # an optimizer with its own layout
                why = f"{type(exc).__name__}: {exc}"
        if self.ctrl.any(why is not None):
            log.warning("tier step-down: loading the checkpoint, the new tier cannot take the state in memory (%s)",
                        why or "on another rank")  # fmt: skip
            return False
        return True

    def _bar_loss(self, r: StepResult) -> float | None:
        """This step's loss for the progress bar (rank 0's share on several ranks); no sync without a bar."""
        if self.progress is None or self.progress.bar is None:
            return None
        return float(r.loss_sum) * self.env.world_size / max(r.targets, 1)

    def _export(self) -> None:
        """The final checkpoint as a Hugging Face directory (runner/output/export.py); skipped when already there."""
        from runner.output import export

        final = self.root / f"step-{self.step}"
        out = export.default_out(self.spec)
        done = export.read_provenance(out)
        if done and done.get("step") == self.step and done.get("source") == str(final.resolve()):
            log.info("model already exported at %s (step %d)", out, self.step)
        else:
            self.status["reason"] = "exporting"
            self.exported = export.export(final, out, spec=self.spec)
            self.status["reason"] = "done"
        self.exported = out
        if self.bucket is not None and not self.spec.output.dir:  # the pod's disk goes with it: the bucket keeps it
            self.fence()
            remote.upload_tree(self.bucket, out, remote.MODEL_DIR)
            log.info("model uploaded to %s", self.bucket.uri(remote.MODEL_DIR))

    def _benchmarks(self) -> None:
        """eval.benchmarks on the export (runner/output/benchmarks.py), once the training state has left the device.
        A failure is logged and recorded, not made the run's: the model is trained and exported, and a retried pod
        would find the run finished; `jobspec eval RUN_DIR` runs them again."""
        from runner.output import benchmarks

        assert self.exported is not None and self.metrics is not None  # called after _export, on rank 0
        self.status["reason"] = "benchmarks"
        self._teardown()  # the model, optimizer and accelerator: the export loads again, for inference
        items = benchmarks.entries(self.spec.eval.benchmarks, self.task_dir)
        try:
            benchmarks.run(self.exported, items, self.spec.eval, device=self.device, step=self.step,
                           write=self.metrics.write)  # fmt: skip
        except Exception as err:
            reason = f"{type(err).__name__}: {err}"[:4096]
            log.exception("benchmarks failed (the model is trained and exported; `jobspec eval %s` runs them again)",
                          self.root)  # fmt: skip
            self.metrics.write({"kind": "event", "event": "benchmark_failed", "step": self.step, "reason": reason})
        self.status["reason"] = "done"

    def _summary(self) -> None:
        if not self.env.is_main:
            return
        wall = time.perf_counter() - self.started
        loss, ev = self.status.get("loss"), self.eval_loss
        lines = [
            f"run complete: {self.step}/{self.total_steps} steps in {wall:.1f} s "
            f"(this process; {self.step - self.first_step} trained now)",
            f"  final train loss {loss:.4f}" if loss is not None else "  final train loss: not logged",
            f"  final eval loss {ev:.4f}" if ev is not None else "  eval: none (no held-out data or not reached)",
            f"  throughput {self.trained_tokens / wall:,.0f} input tokens/s (padding excluded), whole run incl. setup",
            f"  checkpoints {self.root} (newest step-{self.saved_step})",
            f"  model {self.exported}" if self.exported else "  model: not exported (output.export false)",
        ]
        log.info("%s", "\n".join(lines))

    def _memory_check(self) -> None:
        """The memory model's prediction against the device's peak over the first step trained here: every GPU run
        calibrates the model (a `memory_check` event in metrics.jsonl, and a log line)."""
        p = self.plan
        peak = int(torch.cuda.max_memory_allocated(self.device))
        reserved = int(torch.cuda.max_memory_reserved(self.device))
        ratio = peak / p.estimated_bytes if p.estimated_bytes else None
        self.metrics.write({"kind": "event", "event": "memory_check", "step": self.step + 1, "tier": p.tier,
                            "micro_batch": p.micro_batch, "predicted_bytes": p.estimated_bytes,
                            "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved,
                            "measured_over_predicted": None if ratio is None else round(ratio, 4)})  # fmt: skip
        log.info("memory: step %d at tier %s, micro-batch %d: peak %s allocated (%s reserved), the model predicted %s "
                 "with its overhead (%s)", self.step + 1, p.tier, p.micro_batch, human_bytes(peak),
                 human_bytes(reserved), human_bytes(p.estimated_bytes),
                 f"x{ratio:.2f}" if ratio is not None else "no prediction")  # fmt: skip

    def _log_step(self, r: StepResult, tokens_per_s: float) -> None:
        # a mixture of experts (the same on every rank): its router's load-balancing loss, each rank's mean summed
        router = [0.0 if r.router_aux is None else float(r.router_aux)] if self.stepper.router_aux_coef else []
        preference = [] if r.preference is None else r.preference.tolist()
        sums = self.ctrl.all_reduce([r.loss_sum.item(), *router, *preference])
        routed = {"router_aux_loss": sums[1] / self.ctrl.world_size} if router else {}
        sums = [sums[0], *sums[1 + len(router) :]]
        loss = sums[0] / max(r.targets, 1)  # global per-token mean (preference objectives: per-pair)
        obj = self.stepper.objective
        self.status.update(step=self.step, loss=loss)
        used, total = memory_bytes(self.device, self.host.total_bytes)
        p = self.plan
        self.fence()
        self.metrics.write(
            {
                "kind": "train",
                "step": self.step,
                "total_steps": self.total_steps,
                "loss": loss,
                "lr": self.lr(self.step - 1),
                "grad_norm": None if r.grad_norm is None else float(r.grad_norm),
                "tier": p.tier,
                "micro_batch": p.micro_batch,
                "grad_accum": p.grad_accum,
                "world_size": p.world_size,
                "global_batch": p.global_batch,
                "samples": self.step * p.global_batch,
                "epoch": self.order.epoch(self.step - 1),
                "targets": r.targets,
                "tokens_per_s": tokens_per_s,
                "mem_used_bytes": used,
                "mem_total_bytes": total,
                "gpu_util": self.gpu_util(),
                **self._mix(),
                **routed,
                **({} if r.preference is None or obj is None else obj.metrics(sums[1:], r.targets)),
            }
        )

    def _mix(self) -> dict[str, dict[str, int]]:
        """`samples_by_source`: each source's samples (all ranks) since the last train record, by source name;
        nothing with one source."""
        if self.mixed is None:
            return {}
        mix = dict(zip(self.data.sources, self.mixed, strict=True))
        self.mixed = [0] * len(self.mixed)
        return {"samples_by_source": mix}

    def _evaluate(self, *, final: bool = False) -> None:
        """Eval loss on this rank's share of the held-out data. A stop during the `final` one (after the last
        step) skips it: the run saves its final checkpoint and ends done, not preempted."""
        if not self.data.eval:
            return
        try:
            with self.guard.region("eval", self.step):
                loss, n = self.stepper.evaluate(self.eval_ids, self.plan.micro_batch)
        except Preempted:  # raised on every rank at the same agreed check
            if not final:
                raise
            log.warning("stop requested during the final evaluation: skipped; writing the final checkpoint")
            return
        except RankOOM as err:  # this rank alone, with no FSDP gate: restart every rank at a smaller micro-batch
            cap = next_micro_batch(self.plan.micro_batch, self.plan.per_rank) or 1
            raise TierOOM(self.plan.tier, f"out of memory in evaluation on rank {err.rank}: {err.reason}",
                          weights_intact=False, cap=cap, local=True) from None  # fmt: skip
        except EvalOOM as err:  # agreed by every rank: the evaluation is skipped, training goes on
            log.warning("evaluation at step %d skipped: %s", self.step, err)
            self.metrics.write({"kind": "event", "event": "eval_skipped", "step": self.step, "reason": str(err)})
            return
        self.eval_loss = loss
        self.fence()
        self.metrics.write({"kind": "eval", "step": self.step, "eval_loss": loss, "eval_tokens": n})

    def _save(self, *, final: bool = False) -> None:
        """Checkpoint the steps trained so far (collective). An OOM while writing it (agreed by every rank, its temp
        dir removed: runner/checkpoint/store.py) is written again once with the memory released; a second one skips a
        periodic checkpoint (training goes on, the previous checkpoint stays, the next one comes at its interval), and
        for the `final` one hands the run to the tier ladder."""
        if self.saved_step == self.step:
            return
        for attempt in (1, 2):
            try:
                self._write_checkpoint()
                return
            except store.CheckpointOOM as err:
                reason = str(err)
            release_memory()
            log.warning("checkpoint step %d: out of memory writing it (%s)%s", self.step, reason,
                        "; writing it again" if attempt == 1 else "")  # fmt: skip
        if final:
            raise TierOOM(self.plan.tier, f"out of memory writing the final checkpoint step-{self.step}: {reason}",
                          weights_intact=True)  # fmt: skip
        if self.metrics is not None:
            self.metrics.write({"kind": "event", "event": "checkpoint_skipped", "step": self.step, "reason": reason})

    def _write_checkpoint(self) -> None:
        self.fence()
        if self.lease is not None:
            self.lease.beat(force=True)  # still ours: a writer that lost its lease must not publish
        meta = {
            "epoch": self.order.epoch(max(self.step - 1, 0)),
            "samples": self.step * self.plan.global_batch,
            "plan": self.plan.to_dict(),
            "spec_hash": self.spec.spec_hash(),
            "world_size": self.env.world_size,
            "total_steps": self.total_steps,
            "lr_schedule": "warmup_cosine(step)",
            "loss": self.status["loss"],
            "eval_loss": self.eval_loss,
            "lineage": self.lineage,
        }
        with self.guard.region("save", self.step):
            store.save(
                self.root,
                self.step,
                self.model,
                self.optimizer,
                meta,
                rank=self.env.rank,
                ctrl=self.ctrl,
                keep=1 if self.bucket is not None else self.spec.checkpoints.keep,  # the bucket keeps `keep`
                trainable_only=self.spec.model.lora is not None,
                files={store.SPEC: yaml.safe_dump(self.spec.to_yaml_dict(), sort_keys=False).encode()},
                fence=self.fence,
                attempt=self.attempt,
                is_oom=is_oom,
            )
            if self.bucket is not None:  # shards, then the rest, manifest.json, DONE (runner/checkpoint/remote.py)
                remote.publish(self.bucket, self.root, self.step, rank=self.env.rank, ctrl=self.ctrl,
                               keep=self.spec.checkpoints.keep, attempt=self.attempt, fence=self.fence)  # fmt: skip
                if self.env.is_main:  # the metrics and the ladder's state beside the step (runner/checkpoint/run_files)
                    run_files.put(self.spec.checkpoints.dir, self.root)
        self.saved_step = self.step

    def _record_samples(self, ids: list[int]) -> None:
        self.fence()
        rec = {
            "step": self.step,
            "rank": self.env.rank,
            "micro_batch": self.plan.micro_batch,
            "grad_accum": self.plan.grad_accum,
            "ids": ids,
        }
        self.root.mkdir(parents=True, exist_ok=True)
        with shared_dir.open_append(self.root / f"samples-rank{self.env.rank}.jsonl") as f:  # never through a link
            f.write(json.dumps(rec) + "\n")

    # --- cleanup ----------------------------------------------------------------------------------------

    def cleanup(self) -> None:
        prefetch = getattr(getattr(self, "stepper", None), "prefetch", None)  # its DataLoader workers
        stream = getattr(self, "data", None) if isinstance(getattr(self, "data", None), StreamData) else None
        for closable in (self.progress, self.metrics, prefetch, stream):
            if closable is not None:
                closable.close()
        if self.lease is not None:
            self.lease.release()
        if self.owns_stop:
            self.stop.restore()
        internals.reset_accelerate()  # the next Recipe in this process starts clean
        destroy_process_group()
