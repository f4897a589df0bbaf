"""GRPO's reward functions (`training.grpo.rewards`), called as TRL's GRPOTrainer calls its `reward_funcs`.

Each function gets the step's completions of this rank, keyword by keyword: `prompts` (each completion's prompt, a
text or a message list), `completions` (a text for a text prompt; for a chat, TRL's `[{"role": "assistant",
"content": text}]`), `completion_ids` (token id lists) and every other column of the records by its name (each
record's value repeated for its group; None where a record lacks the column). It returns one reward per completion:
a number, or None for "not applicable" (left out of its group's mean, as TRL's NaN). The rewards are summed by
weight (`Rewards.total`); the per-function values feed TRL's `rewards/<name>/mean|std`. As TRL's, every function also
gets `trainer_state` (`TrainerState`: the optimizer steps done before this one, `global_step`, and `max_steps`),
`log_metric(name, value)` (a number for the step's metrics, averaged over the calls on every rank, TRL's) and
`log_extra(column, values)` (columns for TRL's completions table, which it writes only with `log_completions`; jobspec
has no such table: the values are checked and dropped).

Built in:
- `accuracy`: 1.0 when the completion's final answer equals the record's `column` after normalising, else 0.0; None
  when the column is empty (TRL's accuracy_reward skips an unparseable gold answer the same way). The final answer is
  the last `\\boxed{...}`, else what follows the last `####` (GSM8K) or `answer:`, else the last number, else the last
  line. Numbers compare by value (`1,000` = `1000.0`), anything else as lowercase text without spaces, `$` or a
  trailing period. This is exact-answer matching, not math_verify's symbolic equivalence.
- `format`: 1.0 when the completion matches `pattern` from its start (re.DOTALL | re.MULTILINE), else 0.0; the
  default pattern is TRL's think_format_reward.
- `length`: TRL's get_soft_overlong_punishment(max_completion_length, cache) (DAPO, Eq. 13), on the token count.
- `python`: `function` of `file`. The file is a program of the user's: it is run only because the spec names it
  (relative to the spec file, shipped beside it in the pod; or an absolute path in the image or a volume), read as a
  regular file of at most MAX_FILE_BYTES through no link out of its directory, and executed in a module of its own.
  An exception it raises, or a return value that is not one number-or-None per completion, is a ConfigError naming
  the reward (exit 2: the same code fails again on the next attempt).
"""

from __future__ import annotations

import math
import re
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from jobspec.errors import ConfigError
from jobspec.spec.models import RewardSpec
from jobspec.untrusted import read_bounded

MAX_FILE_BYTES = 1 << 20
MAX_METRIC_NAME = 100  # characters of a name a reward function logs (a metrics.jsonl key)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
AFTER = re.compile(r"(?:####|answer\s*(?:is)?\s*[:\uff1a])\s*([^\n]*)", re.IGNORECASE)

RewardFn = Callable[..., Sequence[Any]]


def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def final_answer(text: str) -> str:
    """The answer a completion ends on (see the module docstring)."""
    if (inside := boxed(text)) is not None:
        return inside
    after = AFTER.findall(text)
    if after and after[-1].strip():
        return after[-1]
    numbers = NUMBER.findall(text)
    if numbers:
        return numbers[-1]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def normalise(answer: object) -> str | Fraction:
    """A number as its exact value, anything else as lowercase text without spaces, `$`, `\\text{}` wrappers or a
    trailing period."""
    text = str(answer).strip().replace("$", "").replace("\\!", "")
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text).strip().rstrip(".").strip()
    plain = text.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text) else text
    try:
        return Fraction(plain)
    except (ValueError, ZeroDivisionError):
        return re.sub(r"\s+", "", text).lower()


def accuracy(column: str) -> RewardFn:
    def reward(completions: Sequence[Any], **columns: Any) -> list[float | None]:
        gold = columns.get(column) or [None] * len(completions)
        out: list[float | None] = []
        for completion, answer in zip(completions, gold, strict=True):
            if answer is None or str(answer).strip() == "":
                out.append(None)
                continue
            out.append(float(normalise(final_answer(content(completion))) == normalise(answer)))
        return out

    return reward


def format_match(pattern: str) -> RewardFn:
    compiled = re.compile(pattern, re.DOTALL | re.MULTILINE)

    def reward(completions: Sequence[Any], **_: Any) -> list[float]:
        return [1.0 if compiled.match(content(c)) else 0.0 for c in completions]

    return reward


def soft_overlong(max_completion_length: int, cache: int) -> RewardFn:
    """DAPO's soft overlong punishment, as TRL's get_soft_overlong_punishment computes it."""

    def reward(completion_ids: Sequence[Sequence[int]], **_: Any) -> list[float]:
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= max_completion_length - cache:
                out.append(0.0)
            elif n <= max_completion_length:
                out.append((max_completion_length - cache - n) / cache)
            else:
                out.append(-1.0)
        return out

    return reward


def content(completion: Any) -> str:
    """A completion's text: itself, or the content of its one assistant message (a chat prompt's completion)."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


def load_function(spec: RewardSpec, base: Path, where: str) -> RewardFn:
    """`spec.function` of `spec.file`, the file resolved against `base` (the spec file's directory)."""
    assert spec.file is not None
    path = Path(spec.file) if Path(spec.file).is_absolute() else base / spec.file
    try:
        source = read_bounded(path, MAX_FILE_BYTES, what=f"{where}.file", root=path.parent).decode("utf-8")
    except ConfigError as err:  # not a regular file, a link out of its directory, too large, absent
        raise ConfigError(f"{where}.file {spec.file}: {err}; give a .py file beside the spec file (shipped with the "
                          "job), or an absolute path in the pod") from None  # fmt: skip
    except UnicodeDecodeError:
        raise ConfigError(f"{where}.file {spec.file}: not UTF-8 text (a Python file)") from None
    except OSError as err:
        raise ConfigError(f"{where}.file {spec.file}: cannot be read ({err.strerror or err}); give a .py file "
                          "beside the spec file, or an absolute path in the pod") from None  # fmt: skip
    module = types.ModuleType(f"jobspec_reward_{path.stem}")
    module.__file__ = str(path)
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # the spec names this file: the user's program
    except Exception as err:
        raise ConfigError(f"{where}.file {spec.file}: running it failed: {_why(err)}") from None
    fn = module.__dict__.get(spec.function)
    if not callable(fn):
        names = sorted(k for k, v in module.__dict__.items() if callable(v) and not k.startswith("_"))
        raise ConfigError(f"{where}.function {spec.function!r}: {spec.file} defines no such function (it defines: "
                          f"{', '.join(names[:10]) or 'none'}); set `function` to one of them")  # fmt: skip
    return fn


def _why(err: BaseException) -> str:
    """An exception in the user's code, with the innermost frame of their file."""
    frames = traceback.extract_tb(err.__traceback__)
    at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {str(err)[:300]}{at}"


@dataclass(frozen=True)
class TrainerState:
    """What a reward function reads of TRL's `trainer_state`: `global_step`, the optimizer steps done before the one
    being sampled for (0 at the first), and `max_steps`, the run's steps."""

    global_step: int
    max_steps: int


class Rewards:
    """The spec's reward functions; `score` calls each on a rank's completions."""

    def __init__(self, specs: Sequence[RewardSpec], base: Path, max_completion_length: int):
        self.names = [s.label for s in specs]
        self.weights = np.array([s.weight for s in specs], dtype=np.float64)
        self.fns: list[RewardFn] = []
        for i, s in enumerate(specs):
            where = f"training.grpo.rewards[{i}]"
            if s.kind == "accuracy":
                self.fns.append(accuracy(s.column))
            elif s.kind == "format":
                self.fns.append(format_match(s.pattern))
            elif s.kind == "length":
                self.fns.append(soft_overlong(max_completion_length, s.cache))
            else:
                self.fns.append(load_function(s, base, where))
        if len(set(self.names)) < len(self.names):
            raise ConfigError("training.grpo.rewards: two rewards share a name in the metrics; give each a `name`")
        self.custom = any(s.kind == "python" for s in specs)  # only a user's function can log a metric
        self.logged: dict[str, list[float]] = {}  # log_metric's values since the last `take_logged`

    def _log_metric(self, name: object, value: object) -> None:
        """TRL's `log_metric`: one value of metric `name` for this step."""
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_METRIC_NAME or not name.isprintable():
            raise ConfigError(f"log_metric's name must be a printable text of 1 to {MAX_METRIC_NAME} characters, "
                              f"not {str(name)[:40]!r}")  # fmt: skip
        if not isinstance(value, int | float | np.number | np.bool_) or not math.isfinite(float(value)):
            raise ConfigError(f"log_metric({name!r}, {str(value)[:40]!r}): the value must be a finite number")
        self.logged.setdefault(name, []).append(float(value))

    @staticmethod
    def _log_extra(column: object, values: object) -> None:
        """TRL's `log_extra`: accepted (its completions table is not kept here), the column name checked."""
        if not isinstance(column, str) or not column.strip():
            raise ConfigError(f"log_extra's column must be a name, not {str(column)[:40]!r}")

    def take_logged(self) -> dict[str, list[float]]:
        """The metrics the functions logged since the last call (and forget them)."""
        out, self.logged = self.logged, {}
        return out

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
              columns: Sequence[dict[str, Any]], state: TrainerState | None = None) -> np.ndarray:  # fmt: skip
        """(completions, functions) float64: each function's reward of each completion, NaN for None."""
        passed = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
        keys = sorted({k for c in columns for k in c} - set(passed))
        kwargs: dict[str, Any] = {k: [c.get(k) for c in columns] for k in keys}
        kwargs |= {"trainer_state": state, "log_metric": self._log_metric, "log_extra": self._log_extra}
        out = np.full((len(completions), len(self.fns)), np.nan)
        for j, (name, fn) in enumerate(zip(self.names, self.fns, strict=True)):
            try:
                values = fn(prompts=list(prompts), completions=list(completions),
                            completion_ids=[list(ids) for ids in completion_ids], **kwargs)  # fmt: skip
            except Exception as err:
                raise ConfigError(f"training.grpo.rewards: reward {name!r} raised {_why(err)}") from None
            out[:, j] = _checked(values, len(completions), name)
        return out

    def total(self, per_function: np.ndarray) -> np.ndarray:
        """The weighted sum of each completion's rewards (NaN-free functions only; NaN where every one is NaN)."""
        summed = np.nansum(per_function * self.weights, axis=1)
        summed[np.isnan(per_function).all(axis=1)] = np.nan
        return summed


def _checked(values: Any, n: int, name: str) -> np.ndarray:
    try:
        values = list(values)
    except TypeError:
        values = None
    if values is None or len(values) != n:
        got = "not a list" if values is None else f"{len(values)} values"
        raise ConfigError(f"training.grpo.rewards: reward {name!r} returned {got} for {n} completions: return one "
                          "number (or None) per completion, in order")  # fmt: skip
    out = np.full(n, np.nan)
    for i, v in enumerate(values):
        if v is None:
            continue
        if not isinstance(v, int | float | np.number | np.bool_) or not math.isfinite(float(v)):
            raise ConfigError(f"training.grpo.rewards: reward {name!r} returned {str(v)[:40]!r} for completion {i}: "
                              "each reward is a finite number, or None when it does not apply")  # fmt: skip
        out[i] = float(v)
    return out
