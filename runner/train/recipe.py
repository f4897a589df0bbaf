"""The training recipe of one rank: `Recipe(spec)`, `setup()`, `train()`, `cleanup()` (torchtune's shape).

`Recipe(spec)` checks what it can without a GPU, `setup()` takes the run directory's lease (rank 0,
runner/checkpoint/lease.py), probes, plans, builds data, model, optimizer and accelerate, resumes from the newest
intact checkpoint (damaged ones are skipped: runner/checkpoint/store.py) and checks the volume has room for
the next one, `train()` runs the loop and returns the exit code, `cleanup()` releases everything. The
loop is nanoGPT-plain: step ids -> `Stepper.train_step` -> log / eval / checkpoint; an OOM that micro-batch 1 cannot
absorb steps down a tier in process (runner/train/stepdown.py); the records, summary and export are in
runner/train/outputs.py. Every long phase of start-up (data, plan, model build, placement, probe steps, checkpoint
load) is logged when it starts and when it ends (runner/phase.py). `runner/process/worker.py` runs it as a process.

Debugging aid: JOBSPEC_RECORD_SAMPLES=1 makes every rank append `{step, rank, micro_batch, grad_accum,
ids}` per optimizer step to `<checkpoints.dir>/samples-rank<R>.jsonl` (the ids it actually trained on).
"""

from __future__ import annotations

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

from jobspec.contract import EXIT_OK, EXIT_OOM_RETRY_TIER, EXIT_PREEMPTED, METRICS_FILE, TIER_STATE_FILE
from jobspec.errors import ConfigError
from jobspec.plan.planner import rows_per_sample
from jobspec.spec.models import REFERENCE_OBJECTIVES, JobSpec
from runner import internals
from runner.checkpoint import remote, run_files, store
from runner.checkpoint.lease import Lease, LeaseHeld, check_holder
from runner.checkpoint.lineage import check_resume, lineage
from runner.data.dataset import PAD_MULTIPLE, RepeatedOrder, data_order, load_data, rank_slice, total_steps
from runner.data.loader import Prefetcher
from runner.data.preference import PreferenceData, load_preference
from runner.data.stream import StreamData, load_stream
from runner.data.tokenizer import load_tokenizer
from runner.dist import Control, DistEnv, destroy_process_group, init_process_group
from runner.model.build import build_model
from runner.model.packing import confine_packing
from runner.oom import faults, ladder
from runner.oom.detect import is_oom, oom_guard, release_memory
from runner.oom.shrink import RecipeGuard, TierOOM, apply_cap, reset_wrapper
from runner.output import tracking
from runner.output.metrics import GpuUtil, Metrics, Progress
from runner.phase import phase
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
from runner.train import engine, grpo, handoff, outputs, stepdown, update
from runner.train.objectives import Objective
from runner.train.reference import attach_reference
from runner.train.step import Preempted, Stepper, StepResult, StopFlag, get_lr

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

        def holds() -> None:  # the run directory's verdict: still the attempt that holds it
            if self.attempt:
                check_holder(self.root, self.attempt, self.spec.name, self.lease_file)

        def fenced() -> None:  # the run directory's verdict, then the heartbeat's: it reads no file, so the time
            # from the last verdict to the write is the shortest (a process frozen in between writes when it wakes:
            # CI, 2026-11-30: a rank 0 woken after its gang had gone wrote one metrics line)
            holds()
            gang()

        self.fence = fenced
        self.holds_lease = holds  # a survivor recording the loss of a member (worker.gang_lost): the gang is gone
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
        self.sampled: Any = None  # GRPO's batch across a rebuild of the stepper (`_teardown`, `_build`)
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

        with phase("loading the tokenizer and the data"):
            self._load_data()
        self.total_steps = total_steps(spec, self.order)
        self.lineage = lineage(spec, self.data.train)
        with phase("looking for the newest intact checkpoint in %s", self.root):
            resume = self._resume_point()  # verified; damaged ones skipped
        meta = store.read_meta(resume) if resume else None
        if meta is not None:
            check_resume(meta.get("lineage"), self.lineage, where=f"checkpoint {resume}",
                         force=spec.checkpoints.resume == "force")  # fmt: skip
        with phase("planning the tier and micro-batch"):
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
        self.metrics = Metrics(self.root / METRICS_FILE, enabled=env.is_main, trackers=trackers, fence=self.fence)
        self._write_plan(resumed=resume is not None)
        self.gpu_util = GpuUtil(self.device)

    def _load_data(self) -> None:
        spec, env = self.spec, self.env
        self.tokenizer = load_tokenizer(spec.model.path, model_shape(spec).vocab)
        if spec.data.streaming:  # read and tokenized as the steps need it, by a thread (runner/data/stream.py)
            self.data = load_stream(spec, self.tokenizer, env.rank, env.world_size, write_index=env.is_main)
            self.order = self.data.order
        elif spec.training.objective == "grpo":  # prompts; each step's rows are sampled (runner/rl/rollout.py)
            self.data, self.rewards = grpo.load(spec, self.tokenizer, self.task_dir)
            self.order = data_order(spec, self.data)
            assert spec.training.grpo is not None
            if spec.training.grpo.num_iterations > 1:  # each batch of prompts trained on num_iterations steps
                self.order = RepeatedOrder(self.order, spec.training.grpo.num_iterations)
        else:  # pairs, chosen and rejected in one micro-batch; KTO: a record and its KL row (runner/data/preference.py)
            pairs = spec.training.objective != "sft"  # dpo, ipo, simpo, orpo, kto
            self.data = load_preference(spec, self.tokenizer) if pairs else load_data(spec, self.tokenizer)
            self.order = data_order(spec, self.data)  # several sources: mixed by weight (runner/data/mix.py)
        # Samples of each source trained since the last train record (several sources only).
        self.mixed = [0] * len(self.data.sources) if len(self.data.sources) > 1 else None

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
        if spec.training.optimizer in ("adamw_8bit", "auto"):
            internals.check_low_bit()
        if self.plan.tier != "fast":
            timeout_s = spec.scheduling.collective_timeout_seconds
            init_process_group(env, self.device, needed=True, timeout_s=timeout_s)  # FSDP: a group even alone
        # The state in memory has every weight (no LoRA base, no quantized one): the preset is built without them.
        empty = kept is not None and spec.model.preset is not None and spec.model.lora is None
        # Tier fast holds the whole model on the GPU anyway (full fine-tuning: 16 bytes a parameter, so the fp32 build's
        # 4 fit): built and initialised there, no pass on the host. LoRA's base is cast to 16 bits after the build.
        gpu_build = self.plan.tier == "fast" and self.device.type == "cuda" and spec.model.lora is None
        on = self.device if gpu_build and not empty else None
        how = "without weights (the state in memory has them)" if empty else f"on {on}" if on else "on the host"
        with phase("building the model %s (%s)", how, spec.model.preset or spec.model.path):
            model = build_model(spec, bos=getattr(self.tokenizer, "BOS", self.tokenizer.eos_id),
                                eos=self.tokenizer.eos_id, vocab=self.tokenizer.vocab_size,
                                precision=self.plan.precision, quantize=self.plan.quantize, shards=self.plan.world_size,
                                device=on, weights="none" if empty else "init", train_on=self.device.type)  # fmt: skip
            if empty and not handoff.give_transient(kept, model):  # type: ignore[arg-type]
                raise RuntimeError("the state in memory lacks the model's non-persistent buffers")
        with phase("placing the model for tier %s (%s)", self.plan.tier, self.device):
            optimizer = engine.make_optimizer(model, spec, self.device, self.plan.tier, self.plan.optimizer)
            self.accelerator, self.model, self.optimizer = engine.prepare(self.plan, spec, self.device, model,
                                                                          optimizer)  # fmt: skip
        # the loss head's probe forward: the wrapped model's first (FSDP2's lazy init; 10 s of a CPU step-down's 14)
        with phase("setting up the step at tier %s (the chunked loss's probe forward)", self.plan.tier):
            self.stepper = Stepper(self.accelerator, self.model, self.optimizer, self.data, self.ctrl, self.stop,
                                   max_grad_norm=spec.training.max_grad_norm, loss_kernel=spec.training.loss_kernel,
                                   objective=Objective.of(spec.training), rows=rows_per_sample(spec))  # fmt: skip
        scored = spec.training.objective in REFERENCE_OBJECTIVES  # dpo, ipo, kto: SimPO and ORPO are reference-free
        if scored and isinstance(self.data, PreferenceData):  # the starting model's, before any checkpoint is loaded
            attach_reference(self.stepper, self.data, spec, precision=self.plan.precision, quantize=self.plan.quantize,
                             micro_batch=self.plan.micro_batch, is_main=env.is_main)  # fmt: skip
        if spec.training.objective == "grpo":
            grpo.attach(self.stepper, self.data, self.rewards, spec, self.tokenizer)  # type: ignore[arg-type]
        probe_faults = faults.probe_injector(self.model, rank=env.rank, tier=self.plan.tier, run_dir=self.root)
        # every rank probes when any does (a fault rule for one rank makes the CPU probe): the steps are collective
        probing = self.dev.is_gpu or self.ctrl.any(probe_faults is not None)
        if verify and probing and (meta is None or self.plan.to_dict() != meta["plan"]):
            with phase("probe steps at tier %s, micro-batch %d", self.plan.tier, self.plan.micro_batch):
                self._verify_micro_batch(probe_faults)  # a new plan: real probe steps check it
        if probe_faults is not None:
            probe_faults.remove()
        if kept is not None:
            with phase("handing the state in memory over to tier %s", self.plan.tier):
                handed = stepdown.give_state(self, kept)
        else:
            handed = False
        if kept is not None and not handed:  # the new tier cannot take it: the newest checkpoint, as before
            resume = self._newest_checkpoint()
            if empty and resume is None:  # nothing written yet, and this model has no weights: build it with them
                self.stepper = self.model = self.optimizer = self.accelerator = None  # type: ignore[assignment]
                internals.reset_accelerate()
                release_memory()
                return self._build(None, None, None, verify=verify)
        self.state_from = "memory" if handed else "checkpoint"  # for the step-down's log and event
        if resume is not None:
            with phase("loading checkpoint %s", resume):
                meta = store.load(resume, self.model, self.optimizer, rank=env.rank, ctrl=self.ctrl,
                                  trainable_only=spec.model.lora is not None)  # fmt: skip
            self.step = self.saved_step = int(meta["step"])
            log.info("resumed from %s: step %d of %d", resume, self.step, self.total_steps)
            if meta.get(store.RANK_ITEMS) and self.stepper.rollouts is not None:  # GRPO's batch, mid-iterations
                try:
                    self.stepper.rollouts.restore(meta[store.RANK_ITEMS])
                except ValueError as err:
                    raise store.DamagedCheckpoint(f"checkpoint {resume} cannot be resumed: {err}") from None
        elif kept is not None and self.sampled is not None and self.stepper.rollouts is not None:
            # a step-down in memory: the batch still being trained on, and its metrics
            self.stepper.rollouts.made, self.stepper.rollouts.metrics = self.sampled
        update.prime(self.stepper.inner, self.stepper.params)  # Adam's state now: the first step allocates none
        pin = self.plan.pin_memory and self.device.type == "cuda"  # workers collate the next steps meanwhile
        # A stream is tokenized ahead by its own thread, in this process: collating it is cheap, and no worker can
        # take it (runner/data/stream.py).
        workers = 0 if isinstance(self.data, StreamData) or self.stepper.rollouts else self.plan.num_workers
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
        if self.stepper.rollouts is not None:  # GRPO's batch, for the steps it still trains (num_iterations > 1)
            self.sampled = (self.stepper.rollouts.made, self.stepper.rollouts.metrics)
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
        low = ladder.low_bit_tiers(self.root)  # tiers whose AdamW moments ran out: 8-bit under optimizer auto
        size = partial(size_for_tier, spec, self.dev, self.host, world, local_ranks=self.env.local_world_size,
                       low_bit=low)  # fmt: skip
        if plan is None and tier != spec.memory.tier:
            plan = size(tier, reasons=[f"tier {tier} from {TIER_STATE_FILE} (the OOM ladder; the spec says "
                                       f"{spec.memory.tier})"])  # fmt: skip
        if plan is None:
            plan = initial_plan(spec, self.dev, self.host, world, local_ranks=self.env.local_world_size, low_bit=low)
            if traced.wanted(spec, self.dev.is_gpu):
                if measured_here(spec, plan.tier):
                    plan = traced.skipped(plan, "this run directory measured the tier on the GPU before, which wins")
                else:
                    share = partial(self.ctrl.all_reduce, op="max")
                    plan = traced.from_traces(plan, spec, share, is_main=self.env.rank == 0, replan=size)
        return agree(apply_cap(plan, self.root), self.ctrl.reduce_min, replan=size)

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
        if self.stepper.rollouts is not None:  # GRPO: the step's completions are drawn for this step
            self.stepper.rollouts.step, self.stepper.rollouts.max_steps = step, self.total_steps
        return self.guard.train_step(step)

    def train(self) -> int:
        """Train to `total_steps`; returns the exit code (0, or 143 after a SIGTERM checkpoint).

        An OOM that micro-batch 1 cannot absorb steps down a tier in this process when every rank agreed
        on it (runner/train/stepdown.py); otherwise it ends here with 75/76 and the supervisor (or the Job) relaunches.
        """
        while True:
            try:
                return self._loop()
            except TierOOM as err:  # micro-batch 1 ran out: checkpoint, persist "tier X failed"
                oom_at = time.time()
                with phase("out of memory at tier %s (%s): checkpointing the finished steps and recording the tier's "
                           "failure", err.tier, err.reason) as took:  # fmt: skip
                    code = self.guard.give_up(err)
                if code != EXIT_OOM_RETRY_TIER or not stepdown.can_step_down(self, err):
                    if self.bucket is not None and self.env.is_main:  # the ladder's state, for a pod created again
                        run_files.put(self.spec.checkpoints.dir, self.root)
                    return code  # 76, or the relaunch fallback (75)
                stepdown.step_down(self, err, oom_at, give_up_s=took.wall_s)

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
                    outputs.memory_check(self)
                    check = False
                self.step += 1
                self.status["step"] = self.step
                tokens += result.tokens
                self.trained_tokens += result.tokens
                if self.mixed is not None:  # the step's global samples, whichever share this rank trained
                    counts = self.order.step_counts(self.step - 1)
                    self.mixed = [a + int(b) for a, b in zip(self.mixed, counts, strict=True)]
                if self.record_samples:
                    outputs.record_samples(self, result.sample_ids)
                logged = self.step in (1, self.total_steps) or self.step % t.log_every == 0
                if logged:
                    outputs.train_record(self, result, tokens / (time.perf_counter() - tic))
                    tic, tokens = time.perf_counter(), 0
                self.progress.update(self._bar_loss(result) if logged else None)  # the loss read when logged only
                if self.lease is not None:
                    self.fence()
                    self.lease.beat()  # a clock check; the file is rewritten every lease.interval seconds
                if (t.eval_every and self.step % t.eval_every == 0) or self.step == self.total_steps:
                    outputs.evaluate(self, final=self.step == self.total_steps)
                if self.step % ck.every_steps == 0 or self.step == self.total_steps:
                    self._save(final=self.step == self.total_steps)
            if self.step:
                self._save(final=True)  # written above, unless a tier step-down interrupted the last step's save
        except Preempted:
            return self._preempted()
        self.status["reason"] = "done"
        if self.env.is_main and self.spec.output.export:
            outputs.export_model(self)
            if self.spec.eval.benchmarks:
                outputs.run_benchmarks(self)
        outputs.summary(self)
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

    def _bar_loss(self, r: StepResult) -> float | None:
        """This step's loss for the progress bar (rank 0's share on several ranks); no sync without a bar. Read on the
        logged steps only (training.log_every): reading it every step made the host wait for the GPU at every step
        of a run watched on a terminal; the bar keeps the last loss shown between them."""
        if self.progress is None or self.progress.bar is None:
            return None
        return float(r.loss_sum) * self.env.world_size / max(r.denominator or r.targets, 1)

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
                rank_items=self.stepper.rollouts.saved(self.step) if self.stepper.rollouts is not None else None,
            )
            if self.bucket is not None:  # shards, then the rest, manifest.json, DONE (runner/checkpoint/remote.py)
                remote.publish(self.bucket, self.root, self.step, rank=self.env.rank, ctrl=self.ctrl,
                               keep=self.spec.checkpoints.keep, attempt=self.attempt, fence=self.fence)  # fmt: skip
                if self.env.is_main:  # the metrics and the ladder's state beside the step (runner/checkpoint/run_files)
                    run_files.put(self.spec.checkpoints.dir, self.root)
        self.saved_step = self.step

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
