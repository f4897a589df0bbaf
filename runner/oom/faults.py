"""Fault injection for tests and demos: `JOBSPEC_FAULT_OOM` makes chosen forwards raise a real OOM.

Comma-separated rules, all optional, combined with OR (any matching rule fires); `rank=R` narrows
all of them to one global rank:

    mbs>N      a micro-batch of more than N samples runs out of memory (every time)
    tier=NAME  every step at memory tier NAME runs out of memory (repeatable: tier=fast,tier=zero2)
    step=K     optimizer step K (1-based, as in metrics.jsonl) runs out of memory once (repeatable);
               "once" survives a restart
    rank=R     only global rank R injects; the other ranks run clean
    probes     the rules also apply to the planner's probe steps, which then run on the CPU too (the
               GPU planning path, exercised without a GPU)
    backward   the rules fire mid-backward instead of before the forward: when the gradient reaches the
               output of the model's middle layer, after the forward and half the backward have run
               (and, on a sharded tier, after FSDP's gathers and reduce-scatters of the upper half)
    op=N       the rules fire at the N-th allocating op of the region instead of before the forward: any op,
               wherever an allocator can fail (forward, FSDP2's hooks and collective buffers, the loss,
               backward, DDP's gradient exchange, clipping, the optimizer step), counted by a dispatch mode
               (runner/oom/anywhere.py). A region that ends with fewer ops records how many it had.
    during=R   the region `op=N` counts in: train (one attempt at a training step: its micro-steps, gradient
               exchange, clipping and optimizer step; the default), eval (the evaluation after step K),
               save (the checkpoint written after step K) or probe (the planner's K-th probe step; implies
               probes). Needs op=N.

Example: `JOBSPEC_FAULT_OOM="mbs>2,rank=1,backward"`; `JOBSPEC_FAULT_OOM="step=3,op=41"` runs out of memory at
the 41st allocating op of step 3, whatever that op is. The error raised is a real `torch.OutOfMemoryError`,
from a forward pre-hook on the model (or a gradient hook on the middle layer's output), so it takes
the same path as an allocator failure. Without
`probes` it is installed after planning: the rules apply to training steps only. Steps
that fired are recorded per rank in `FIRED_FILE_TEMPLATE` in the run directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobspec import shared_dir
from jobspec.catalog.tiers import TIERS
from jobspec.errors import ConfigError
from jobspec.untrusted import json_loads, read_bounded

if TYPE_CHECKING:  # torch is imported where an error is raised: the supervisor parses the rules without it
    import torch

log = logging.getLogger("jobspec.runner")

ENV_VAR = "JOBSPEC_FAULT_OOM"
FIRED_FILE_TEMPLATE = "fault_oom_fired.rank{rank}.json"
_RULE = re.compile(r"^\s*(?:(mbs)\s*>\s*(\d+)|(tier|step|rank|op|during)\s*=\s*([A-Za-z0-9_]+)|(probes|backward))\s*$")
_SYNTAX = "rules are mbs>N, tier=NAME, step=K, rank=R, op=N, during=REGION, probes and backward, separated by commas"
REGIONS = ("train", "eval", "save", "probe")  # where `op=N` counts (`during=`)
# op=N: each region that fired ({"fired_at": N}) or ended before its N-th op ({"ops": how many it had})
OPS_FILE_TEMPLATE = "fault_oom_ops.rank{rank}.jsonl"


@dataclass(frozen=True)
class FaultRules:
    """Parsed `JOBSPEC_FAULT_OOM`. `reason()` is pure: no state, no I/O."""

    mbs_above: int | None = None
    tiers: frozenset[str] = frozenset()
    steps: frozenset[int] = frozenset()
    rank: int | None = None
    probes: bool = False  # also in the planner's probe steps
    backward: bool = False  # fire mid-backward (the middle layer's output gradient), not before the forward
    op: int | None = None  # fire at the op-th allocating op of a region (runner/oom/anywhere.py), not before a forward
    during: str = "train"  # the region `op` counts in (REGIONS)

    def reason(self, *, rank: int, tier: str, step: int, micro_batch: int, fired: frozenset[int] = frozenset()) -> str:
        """Why this forward must run out of memory; "" when no rule fires. `fired`: steps already used."""
        if self.rank is not None and rank != self.rank:
            return ""
        if self.mbs_above is not None and micro_batch > self.mbs_above:
            return f"mbs>{self.mbs_above} (micro-batch {micro_batch})"
        if tier in self.tiers:
            return f"tier={tier}"
        if step in self.steps and step not in fired:
            return f"step={step}"
        return ""


def parse_rules(text: str | None) -> FaultRules | None:
    """`JOBSPEC_FAULT_OOM` text -> rules; None when unset or blank. Bad text raises ConfigError."""
    if text is None or not text.strip():
        return None
    mbs: int | None = None
    rank: int | None = None
    op: int | None = None
    during: str | None = None
    tiers: set[str] = set()
    steps: set[int] = set()
    flags = {"probes": False, "backward": False}
    for raw in text.split(","):
        m = _RULE.match(raw)
        if not m:
            raise ConfigError(f"{ENV_VAR}={text!r}: cannot read rule {raw.strip()!r}; {_SYNTAX}")
        if m.group(5):
            flags[m.group(5)] = True
            continue
        if m.group(1):
            if mbs is not None:
                raise ConfigError(f"{ENV_VAR}={text!r}: mbs>N is given twice; keep one")
            mbs = int(m.group(2))
            continue
        key, value = m.group(3), m.group(4)
        if key == "tier":
            if value not in TIERS:
                raise ConfigError(f"{ENV_VAR}={text!r}: unknown tier {value!r}; expected one of {', '.join(TIERS)}")
            tiers.add(value)
        elif key == "during":
            if value not in REGIONS:
                raise ConfigError(f"{ENV_VAR}={text!r}: unknown region during={value!r}; expected one of "
                                  f"{', '.join(REGIONS)}")  # fmt: skip
            if during is not None:
                raise ConfigError(f"{ENV_VAR}={text!r}: during=REGION is given twice; keep one")
            during = value
        elif not value.isdigit():
            raise ConfigError(f"{ENV_VAR}={text!r}: {key}={value!r} needs a non-negative integer")
        elif key in ("step", "op") and int(value) < 1:
            where = "the `step` of metrics.jsonl" if key == "step" else "the first allocating op of the region"
            raise ConfigError(f"{ENV_VAR}={text!r}: {key}=K counts from 1 ({where})")
        elif key == "step":
            steps.add(int(value))
        elif key == "op":
            if op is not None:
                raise ConfigError(f"{ENV_VAR}={text!r}: op=N is given twice; keep one")
            op = int(value)
        elif rank is not None:
            raise ConfigError(f"{ENV_VAR}={text!r}: rank=R is given twice; keep one")
        else:
            rank = int(value)
    if mbs is None and not tiers and not steps:
        raise ConfigError(
            f"{ENV_VAR}={text!r}: rank=R, probes, backward, op=N or during=REGION alone injects nothing; add mbs>N, "
            "tier=NAME or step=K"
        )
    if during is not None and op is None:
        raise ConfigError(f"{ENV_VAR}={text!r}: during={during} needs op=N (the allocating op of the region to fail)")
    if op is not None and flags["backward"]:
        raise ConfigError(f"{ENV_VAR}={text!r}: op=N and backward are two ways to place the fault; keep one")
    probes = flags["probes"] or during == "probe"
    return FaultRules(mbs, frozenset(tiers), frozenset(steps), rank, probes, flags["backward"], op, during or "train")


def rules_from_env(env: Mapping[str, str] | None = None) -> FaultRules | None:
    """The rules in the environment (`os.environ` by default)."""
    return parse_rules((os.environ if env is None else env).get(ENV_VAR))


def _micro_batch_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Samples in a forward call: the first dimension of input_ids (or of the first tensor argument)."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args, *kwargs.values()):
        if hasattr(value, "dim") and hasattr(value, "shape") and value.dim() > 0:  # a tensor
            return int(value.shape[0])
    return 0


@dataclass
class FaultInjector:
    """Applies `rules` on one rank. The loop sets `step` (1-based: the step being computed) before each one.

    `run_dir` makes `step=K` fire once across restarts: a fired step is written to a per-rank file
    there before the error is raised, and read back when the injector is built.
    """

    rules: FaultRules
    rank: int
    tier: str
    run_dir: Path | None = None
    step: int = 0
    fired: set[int] = field(default_factory=set)
    injected: int = 0  # errors raised so far (for tests and the benchmark)
    handles: list[Any] = field(default_factory=list)  # the hooks, once installed
    pending: int | None = None  # `backward`: the micro-batch of the forward in flight
    per_sample_bytes: int = 0  # mbs>N: the memory model's bytes a sample, to word the OOM like the allocator
    device_type: str = "cpu"  # op=N: the device whose allocations count (set by `install`)

    def __post_init__(self) -> None:
        path = self._fired_path()
        if path is not None and os.path.lexists(path):
            try:
                record = json_loads(read_bounded(path, 1 << 20, what="fault record", follow=False))
                self.fired |= {int(s) for s in record["fired_steps"]}
            except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
                log.warning("fault injection: ignoring unreadable %s (%s)", path, exc)

    def _fired_path(self) -> Path | None:
        return None if self.run_dir is None else Path(self.run_dir) / FIRED_FILE_TEMPLATE.format(rank=self.rank)

    def check(self, micro_batch: int) -> None:
        """Raise `torch.OutOfMemoryError` when a rule fires for a forward of `micro_batch` samples."""
        why = self.rules.reason(
            rank=self.rank, tier=self.tier, step=self.step, micro_batch=micro_batch, fired=frozenset(self.fired)
        )
        if not why:
            return
        if why.startswith("step="):
            self.fired.add(self.step)
            self._persist_fired()
        self.injected += 1
        import torch

        raise torch.OutOfMemoryError(
            f"CUDA out of memory (injected by {ENV_VAR}: {why}; rank {self.rank}, tier {self.tier}, "
            f"step {self.step}, micro-batch {micro_batch}).{self._allocator_words(micro_batch)}"
        )

    def _allocator_words(self, micro_batch: int) -> str:
        """For mbs>N, the allocator's numbers of a device where exactly N samples fit (N + 1/2 samples free):
        the fault fires before any compute, so the whole micro-batch is what it "tried to allocate"."""
        if self.rules.mbs_above is None or micro_batch <= self.rules.mbs_above or self.per_sample_bytes <= 0:
            return ""
        ps, held = self.per_sample_bytes, 1024**3  # held: the weights and optimizer state, nominally
        free = int((self.rules.mbs_above + 0.5) * ps)
        return (
            f" Tried to allocate {_bytes(micro_batch * ps)}. GPU 0 has a total capacity of {_bytes(held + free)} "
            f"of which {_bytes(free)} is free. Of the allocated memory {_bytes(held)} is allocated by PyTorch, "
            "and 0 bytes is reserved by PyTorch but unallocated."
        )

    def _persist_fired(self) -> None:
        path = self._fired_path()
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        shared_dir.write_atomic(path, json.dumps({"fired_steps": sorted(self.fired)}).encode(), fsync=False)

    def region(self, during: str, micro_batch: int = 0) -> AbstractContextManager[Any]:
        """With `op=N`: the dispatch mode (runner/oom/anywhere.py) around one region (`during`, one of REGIONS) of
        the current `step`, when a rule fires for it; a null context otherwise. The caller sets `step` first (the
        step being trained; for eval and save, the step just finished; for probe, the probe's number)."""
        rules = self.rules
        if rules.op is None or rules.during != during or (rules.rank is not None and rules.rank != self.rank):
            return nullcontext()
        why = rules.reason(rank=self.rank, tier=self.tier, step=self.step, micro_batch=micro_batch,
                           fired=frozenset(self.fired))  # fmt: skip
        return self._op_region(why, during, micro_batch) if why else nullcontext()

    @contextmanager
    def _op_region(self, why: str, during: str, micro_batch: int) -> Iterator[None]:
        from runner.oom.anywhere import OpFault

        step, target = self.step, self.rules.op
        assert target is not None

        def fire() -> None:
            if why.startswith("step="):
                self.fired.add(step)
                self._persist_fired()
            self.injected += 1
            self._record_ops({"during": during, "step": step, "tier": self.tier, "micro_batch": micro_batch,
                              "fired_at": target})  # fmt: skip

        def describe(n: int, op: str) -> str:
            return (f"CUDA out of memory (injected by {ENV_VAR}: {why}, allocating op {n} ({op}) of the {during} "
                    f"region; rank {self.rank}, tier {self.tier}, step {step}, micro-batch {micro_batch}).")

        mode = OpFault(target, self.device_type, describe, fire)
        with mode:
            yield
        if not mode.fired:  # the region had fewer ops: say how many (the sweep reads this to know a region's length)
            self._record_ops({"during": during, "step": step, "tier": self.tier, "micro_batch": micro_batch,
                              "ops": mode.ops})  # fmt: skip

    def _record_ops(self, record: dict[str, Any]) -> None:
        if self.run_dir is None:
            return
        path = Path(self.run_dir) / OPS_FILE_TEMPLATE.format(rank=self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with shared_dir.open_append(path) as f:
            f.write(json.dumps(record) + "\n")

    def install(self, model: torch.nn.Module) -> None:
        """Hook `check` in front of `model`'s forward (prepended: it fires before FSDP's gathers), or with the
        `backward` rule, on the gradient of the middle layer's output (`_middle_layer`). With `op=N` no hook: the
        regions (`region`) count ops on the device `model`'s parameters live on."""
        param = next(iter(model.parameters()), None)
        self.device_type = param.device.type if param is not None else "cpu"
        if self.rules.op is not None:
            return

        def before_forward(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.rules.backward:
                self.pending = _micro_batch_of(args, kwargs)  # planted on the middle layer's output below
            else:
                self.check(_micro_batch_of(args, kwargs))

        def plant(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            micro_batch, self.pending = self.pending, None  # once per model forward (not in a recompute)
            out = _first_tensor(output)
            if micro_batch is not None and out is not None and out.requires_grad:
                out.register_hook(lambda _grad: self.check(micro_batch))

        self.handles = [model.register_forward_pre_hook(before_forward, with_kwargs=True, prepend=True)]
        if self.rules.backward:
            self.handles.append(_middle_layer(model).register_forward_hook(plant))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _middle_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The middle block of the model's longest ModuleList (a transformer's layers); the model itself if none."""
    import torch

    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not stacks:
        return model
    layers = max(stacks, key=len)
    return layers[len(layers) // 2]


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The hidden states a layer returns: a tensor, the first of a tuple, or the first value of a ModelOutput."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output:
        return _first_tensor(output[0])
    if isinstance(output, dict) and output:
        return _first_tensor(next(iter(output.values())))
    return None


def install_from_env(
    model: torch.nn.Module, *, rank: int, tier: str, run_dir: Path | None, env: Mapping[str, str] | None = None
) -> FaultInjector | None:
    """Build and install the injector when `JOBSPEC_FAULT_OOM` is set; None (nothing installed) when not."""
    rules = rules_from_env(env)
    if rules is None:
        return None
    injector = FaultInjector(rules, rank=rank, tier=tier, run_dir=run_dir)
    if rules.rank is None or rules.rank == rank:
        injector.install(model)
        log.warning("fault injection on rank %d: %s=%r", rank, ENV_VAR, (os.environ if env is None else env)[ENV_VAR])
    return injector


def _bytes(n: int) -> str:
    """Sizes as the CUDA caching allocator writes them in its OOM message."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


def probe_injector(
    model: torch.nn.Module, *, rank: int, tier: str, run_dir: Path | None = None
) -> FaultInjector | None:
    """An injector for the planner's probe steps when the rules say `probes` (removed after planning). With op=N
    (during=probe) `step=K` is the K-th probe step of this build."""
    rules = rules_from_env()
    if rules is None or not rules.probes or (rules.rank is not None and rules.rank != rank):
        return None
    if rules.op is not None and rules.during != "probe":
        return None  # op=N counts in another region: the probes run clean
    injector = FaultInjector(rules, rank=rank, tier=tier, run_dir=run_dir)
    injector.install(model)
    log.warning("fault injection in the planner's probe steps on rank %d: %s=%r", rank, ENV_VAR, os.environ[ENV_VAR])
    return injector
