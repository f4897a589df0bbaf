"""Telemetry: metrics.jsonl (one JSON record per logged step or evaluation), a log line, a progress bar, and
the machine-readable progress line `jobspec status` reads from the pod's log (progress.py). On a terminal (a local
`jobspec run`) the progress line is logged at DEBUG only: a person reads the human line, and no pod log is read.

Only rank 0 writes. Train records carry at least: step, loss, lr, tier, micro_batch, grad_accum,
global_batch, samples, tokens_per_s, mem_used_bytes, mem_total_bytes, gpu_util (null when unknown);
eval records carry step and eval_loss; benchmark records (runner/output/benchmarks.py) step, task and `metrics`
{"eval/<task>/<metric>": value}. `kind` tells them apart ("train" | "eval" | "benchmark" | "plan" | "event").
With several data sources, train records also carry `samples_by_source`: {source name: samples since the previous
train record}.
Memory on GPU is the allocator's peak since the previous record; on CPU the process's peak RSS.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from jobspec import shared_dir
from jobspec.errors import ConfigError
from runner.output.progress import ProgressLine

log = logging.getLogger("jobspec.runner")
GiB = 1024**3


def memory_bytes(device: torch.device, host_total: int) -> tuple[int | None, int | None]:
    """(used, total): GPU peak allocated since the last call and the card's total; on CPU, peak RSS and
    the container's memory."""
    if device.type == "cuda":
        used = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(used), int(torch.cuda.get_device_properties(device).total_memory)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, host_total  # ru_maxrss is KiB on Linux


class GpuUtil:
    """GPU utilisation in percent from `torch.cuda.utilization` (NVML on NVIDIA, amdsmi on ROCm), else None.

    torch picks the vendor's library and maps the device through CUDA/HIP_VISIBLE_DEVICES itself. It
    raises when that library is missing (ModuleNotFoundError; NVMLError_LibraryNotFound without the
    driver's libnvidia-ml), the driver does not load or the device is not visible (RuntimeError), or
    the card does not report it (NVMLError_NotSupported on a MIG slice, AmdSmiException). The first
    failure is logged once and every later call returns None without asking again: the query sits in
    the training loop, and a step must not pay for one that cannot work (nor print it each time).
    """

    def __init__(self, device: torch.device):
        self.device: torch.device | None = device if device.type == "cuda" else None

    def __call__(self) -> int | None:
        if self.device is None:
            return None
        try:
            return int(torch.cuda.utilization(self.device))
        except Exception as err:  # any of the above; the field stays null for the rest of the run
            log.info("gpu_util: not available on %s (%s: %s); recorded as null", self.device, type(err).__name__, err)
            self.device = None
            return None


class Metrics:
    """Appends records to `<dir>/metrics.jsonl` and logs a line for each (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool, trackers: Any = None, fence: Callable[[], None] | None = None):
        self.enabled = enabled
        # Called right before each line is written (runner/train/recipe.py `fence`): raises when the gang or the run
        # directory moved on without this process, so a rank frozen anywhere up to here writes nothing.
        self.fence = fence
        self.trackers = trackers  # runner.output.tracking.Trackers: the same records to TensorBoard, W&B, MLflow
        self.file = None
        self.progress = ProgressLine()  # the live-progress log line of each train record (output/progress.py)
        # In a pod (stderr is never a terminal there) the progress line is for `jobspec status`; on a terminal each
        # step would be logged twice, once for a person and once in JSON: there it shows with --debug only.
        self.progress_level = logging.DEBUG if sys.stderr.isatty() else logging.INFO
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.progress.seed(path)  # an earlier start's last OOM or tier change
            # Held for the whole run; line-buffered so that every record lands even if the process dies. The run
            # directory is shared: never appended through a link planted at the name (jobspec.shared_dir).
            try:
                self.file = shared_dir.open_append(path)
            except shared_dir.Unsafe as err:  # the same at every attempt: exit 2, naming the file
                raise ConfigError(f"{path}: {err.detail}, refused (a run directory's metrics are a file of its own, "
                                  "never written through a link): remove it, or give the run another checkpoints.dir"
                                  ) from None  # fmt: skip

    def write(self, record: dict[str, Any], fence: Callable[[], None] | None = None) -> None:
        """Append `record` (rank 0). `fence`: instead of the one given at construction, for this record."""
        if self.file is None:
            return
        stamped = {"time": round(time.time(), 3), **record}
        line = json.dumps(stamped, separators=(",", ":")) + "\n"
        fence = fence or self.fence
        if fence is not None:
            fence()  # the last thing before the write: the record is built, the line serialized
        self.file.write(line)
        if record.get("kind") != "event":  # events (an OOM shrink) were logged in words where they happened
            log.info("%s", format_line(record))
        line = self.progress.observe(stamped)
        if line is not None:
            log.log(self.progress_level, "%s", line)
        if self.trackers is not None:
            self.trackers.log(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def format_line(r: dict[str, Any]) -> str:
    """The human form of a record: `step 50/150 | loss 1.234 | lr 2.9e-03 | 12,345 input tok/s | ...`.

    tokens_per_s counts the input tokens of every rank, padding excluded (not only the scored targets)."""
    if r.get("kind") == "eval":
        return f"eval step {r['step']} | eval_loss {r['eval_loss']:.4f} | {r['eval_tokens']} tokens"
    if r.get("kind") == "benchmark":
        shown = ", ".join(f"{k.rsplit('/', 1)[-1]} {v:.4f}" for k, v in r["metrics"].items() if "_stderr" not in k)
        return f"benchmark {r['task']} (step {r['step']}): {shown} | {r['samples']} samples in {r['seconds']:.1f} s"
    if r.get("kind") == "plan":
        return (
            f"plan: tier {r['tier']}, micro-batch {r['micro_batch']} x {r['grad_accum']} accumulation x "
            f"{r['world_size']} ranks = {r['global_batch']}, {r['precision']}, checkpointing "
            f"{'on' if r['checkpointing'] else 'off'}, from step {r['step']} of {r['total_steps']}"
        )
    if r.get("kind") != "train":
        return json.dumps(r)
    mem = ""
    if r.get("mem_used_bytes") is not None and r.get("mem_total_bytes"):
        mem = f" | mem {r['mem_used_bytes'] / GiB:.2f}/{r['mem_total_bytes'] / GiB:.1f} GiB"
    util = f" | gpu {r['gpu_util']}%" if r.get("gpu_util") is not None else ""
    reward = ""  # GRPO: what its runs are watched by (its loss is near 0 by construction)
    if r.get("reward") is not None:
        reward = (f" | reward {r['reward']:.3f} (std {r['reward_std']:.3f}) | completion "
                  f"{r['completions/mean_length']:.0f} tok")  # fmt: skip
    return (
        f"step {r['step']}/{r['total_steps']} | loss {r['loss']:.4f}{reward} | lr {r['lr']:.2e} | "
        f"{r['tokens_per_s']:,.0f} input tok/s | {r['tier']} mbs {r['micro_batch']} x {r['grad_accum']} "
        f"x {r['world_size']} = {r['global_batch']}{mem}{util}{format_mix(r.get('samples_by_source'))}"
    )


def format_mix(mix: dict[str, int] | None) -> str:
    """` | mix chat 75% code 25%`: each source's share of the samples since the previous record."""
    total = sum(mix.values()) if mix else 0
    if not total:
        return ""
    return " | mix " + " ".join(f"{name} {n / total:.0%}" for name, n in mix.items())


class Progress:
    """A tqdm bar over optimizer steps with the current loss, only when stderr is a terminal (never in pod
    logs or CI). While it is up, log records are written through tqdm so they print above the bar."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        self._redirect: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)
            self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger()])
            self._redirect.__enter__()

    def update(self, loss: float | None = None) -> None:
        if self.bar is not None:
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
