"""Helpers for the training tests: a tiny CPU spec, in-process and subprocess runs, metrics, test data.

Real training everywhere (tiny preset, short sequences, few steps); only the GPU probe is ever faked.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from runner.data.dataset import BUNDLED

ROOT = Path(__file__).resolve().parents[2]

# Training subprocesses take 5-60 s on 2 idle cores; shared CI machines run them several times slower.
# A limit only decides how long a hang takes to fail, so it is generous, and scaled by the environment.
TIMEOUT_SCALE_ENV = "JOBSPEC_TEST_TIMEOUT_SCALE"
TRAINING_TIMEOUT_S = 600.0
STDERR_TAIL = 4000  # characters of stderr a timeout report shows


def tiny_spec_dict(run_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A CPU spec that trains in a second or two: tiny preset, seq 64, global batch 8, fp32."""
    spec: dict[str, Any] = {
        "name": "runner-test",
        "model": {"preset": "tiny"},
        "data": {"max_seq_len": 64},
        "training": {
            "global_batch": 8,
            "learning_rate": 3e-3,
            "warmup_steps": 2,
            "steps": 8,
            "precision": "fp32",
            "log_every": 1,
        },
        "hardware": {"vendor": "cpu", "gpus": 1},
        "memory": {"tier": "fast"},
        "checkpoints": {"dir": str(run_dir), "every_steps": 4, "keep": 5},
    }
    for section, values in sections.items():
        spec[section] = {**spec.get(section, {}), **values}
    return spec


def tiny_spec(run_dir: Path, **sections: dict[str, Any]):  # -> JobSpec
    from jobspec.spec.loader import parse_spec

    return parse_spec(yaml.safe_dump(tiny_spec_dict(run_dir, **sections)))


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def train_in_process(spec, keep_worker: bool = False):
    """Run one Recipe (rank 0 of 1) in this process; returns (exit code, worker)."""
    from runner.train.recipe import Recipe

    worker = Recipe(spec)
    try:
        worker.setup()
        code = worker.train()
    finally:
        worker.cleanup()
    return code, worker


def train_and_resume(base: Path, sections: dict[str, Any], at: int = 4):
    """The same spec trained twice in this process: uninterrupted in `base/full`, and in `base/part` from a copy of
    full's checkpoint step-`at` alone; both must exit 0. Returns the two workers (full, resumed)."""
    from jobspec.contract import EXIT_OK

    code, full = train_in_process(tiny_spec(base / "full", **sections))
    assert code == EXIT_OK, "the uninterrupted run failed"
    (base / "part").mkdir()
    shutil.copytree(base / "full" / f"step-{at}", base / "part" / f"step-{at}")
    code, part = train_in_process(tiny_spec(base / "part", **sections))
    assert code == EXIT_OK, "the resumed run failed"
    return full, part


def worker_in_process(spec_file: Path, status_file: Path, *overrides: str) -> tuple[int, dict[str, Any]]:
    """`python -m runner.process.worker SPEC` (rank 0 of 1) in this process: (exit code, the status it reports to the
    supervisor). The worker's signal handlers are put back afterwards."""
    from runner.process import worker

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    previous = os.environ.get("JOBSPEC_STATUS_FILE")
    os.environ["JOBSPEC_STATUS_FILE"] = str(status_file)
    try:
        code = worker.main([str(spec_file), *[a for o in overrides for a in ("--set", o)]])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if previous is None:
            os.environ.pop("JOBSPEC_STATUS_FILE", None)
        else:
            os.environ["JOBSPEC_STATUS_FILE"] = previous
    return code, json.loads(status_file.read_text())


def records(run_dir: Path, kind: str = "train") -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("kind") == kind]


def runner_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("JOBSPEC_FAULT_OOM", None)  # fault injection only when a test passes it in `extra`
    return {**env, **extra}


def timeout_s(base: float = TRAINING_TIMEOUT_S) -> float:
    """`base` seconds times $JOBSPEC_TEST_TIMEOUT_SCALE (default 1; e.g. 3 on a slow, shared machine)."""
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not scale > 0:  # nan too
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={raw!r}: expected a positive number, e.g. 2")
    return base * scale


def _timeout_report(what: str, limit: float, stderr: str | bytes | None) -> str:
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    tail = (stderr or "")[-STDERR_TAIL:] or "(nothing on stderr)"
    return (
        f"timed out after {limit:g} s ({TIMEOUT_SCALE_ENV}={os.environ.get(TIMEOUT_SCALE_ENV, '1')}) "
        f"waiting for {what}; killed it. Last stderr:\n{tail}"
    )


def _kill_group(proc: subprocess.Popen) -> tuple[Any, Any]:
    """SIGKILL the process group (supervisor, workers, dataloader workers) and collect what they wrote."""
    with contextlib.suppress(ProcessLookupError):  # already gone, with all its children
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired as err:  # a child left the group and holds the pipe open
        proc.kill()
        return err.stdout, err.stderr


def run_supervisor(args: list[str], timeout: float = TRAINING_TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
    """`python -m runner ARGS` to its end. Every call starts training (or a process that could), so the
    limit is never below TRAINING_TIMEOUT_S, and it is scaled (timeout_s). On a timeout the whole process
    group is killed and the failure says what was running, for how long, and the end of its stderr."""
    cmd = [sys.executable, "-m", "runner", *args]
    limit = timeout_s(max(timeout, TRAINING_TIMEOUT_S))
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=runner_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills the workers too
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _, err = _kill_group(proc)
        shown = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, cmd)])
        raise AssertionError(_timeout_report(f"`{shown}`", limit, err)) from None
    except BaseException:  # Ctrl-C, or an error here: never leave a training run behind
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class Drained(subprocess.Popen):
    """A Popen whose pipes are read while the process writes, each by a thread of its own.

    A test that polls a run's files (or waits on one rank) while the run logs into a pipe nobody reads hangs the
    run once 64 KiB are written: the run blocks in its next log line, and a gang's other rank in the collective
    that waits for it (a 600 s hang in CI, test_lease, 2026-11-29). `communicate()` returns what was read, as
    Popen's does; a grandchild that keeps the pipe open past the end delays it at most READER_JOIN_S."""

    READER_JOIN_S = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._chunks: dict[str, list[Any]] = {}
        self._readers: list[threading.Thread] = []
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                chunks = self._chunks[name] = []
                reader = threading.Thread(target=_read_all, args=(stream, chunks), daemon=True)
                reader.start()
                self._readers.append(reader)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if input is not None:
            raise ValueError("Drained runs take no input")
        self.wait(timeout)
        for reader in self._readers:
            reader.join(self.READER_JOIN_S)
        return self.read_so_far("stdout"), self.read_so_far("stderr")

    def read_so_far(self, name: str = "stderr") -> Any:
        """What the process wrote to `name` until now (None when it is not a pipe)."""
        chunks = self._chunks.get(name)
        if chunks is None:
            return None
        text = isinstance(getattr(self, name), io.TextIOBase)
        return ("" if text else b"").join(list(chunks))


def _read_all(stream: Any, chunks: list[Any]) -> None:
    with contextlib.suppress(ValueError, OSError):  # closed under us: the test is ending
        for line in stream:
            chunks.append(line)


def communicate_or_fail(proc: subprocess.Popen, what: str, timeout: float | None = None) -> tuple[Any, Any]:
    """`proc.communicate()` within timeout_s() (or `timeout`); on a timeout kill it and fail naming `what`."""
    limit = timeout_s() if timeout is None else timeout
    try:
        return proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(_timeout_report(what, limit, err)) from None


CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "ok"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_test_tokenizer(
    path: Path,
    template: str | None = None,
    *,
    specials: tuple[str, ...] = ("<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"),
    vocab: int = 300,
    **named: str,
) -> None:
    """A small byte-level BPE tokenizer with a chat template, trained here on the bundled data (nothing
    downloaded). `named`: its special tokens by role (eos_token, pad_token, bos_token), from `specials`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(BUNDLED.read_text().splitlines()[:vocab], trainer)
    roles = named or {"eos_token": "<|end|>", "pad_token": "<|pad|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, **roles)
    fast.chat_template = CHAT_TEMPLATE if template is None else template
    fast.save_pretrained(path)


def steps_with_an_oom(update: Any, opt: Any, steps: int, set_grads: Any, fail_at: int | None = None) -> int:
    """`steps` optimizer steps through `update` (runner/train/update.py `Update`) of `opt`, each after
    `set_grads(step)`; the `fail_at`-th call of `opt.step` raises an OOM (this instance only), and `apply` is called
    again (3 tries), as the runner retries a rank's step. Returns how many times `opt.step` was called."""
    import torch

    calls = {"n": 0}
    real = type(opt).step

    def flaky(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (test: injected at an optimizer step)")
        return real(self, *args, **kwargs)

    opt.step = flaky.__get__(opt)
    for step in range(steps):
        set_grads(step)
        prepared = update.prepare([torch.tensor(1.0)], torch.device("cpu"))
        for _ in range(3):
            try:
                update.apply(prepared, 1e-2)
                break
            except torch.OutOfMemoryError:
                continue
        opt.zero_grad(set_to_none=True)
    return calls["n"]
