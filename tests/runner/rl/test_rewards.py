"""GRPO's reward functions: the built-ins against TRL's own where TRL has one (think_format_reward,
get_soft_overlong_punishment), the accuracy reward's final-answer extraction, a Python reward file called as TRL calls
reward functions, and every way a reward file or its answer can be wrong refused with the reward named (exit 2)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jobspec.errors import ConfigError
from jobspec.spec.models import THINK_FORMAT, RewardSpec
from runner.rl.rewards import Rewards, final_answer, normalise


def rewards(tmp_path, *specs: dict, max_completion_length: int = 100) -> Rewards:
    return Rewards([RewardSpec(**s) for s in specs], tmp_path, max_completion_length)


def test_format_and_length_equal_trls_own_reward_functions(tmp_path):
    pytest.importorskip("trl")
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    texts = ["<think>\nreason\n</think>\nanswer", "<think>a</think><think>b</think>", "no think", "<think>x</think>",
             "x<think>y</think>"]  # fmt: skip
    ids = [[1] * n for n in (10, 79, 80, 81, 95, 100, 101, 130)]
    r = rewards(tmp_path, {"kind": "format"}, {"kind": "length", "cache": 20})
    chats = [[{"role": "assistant", "content": t}] for t in texts]
    got = r.score(["p"] * len(texts), chats, [[1]] * len(texts), [{}] * len(texts))[:, 0]
    assert got.tolist() == think_format_reward(chats)
    assert RewardSpec(kind="format").pattern == THINK_FORMAT
    got = r.score(["p"] * len(ids), ["t"] * len(ids), ids, [{}] * len(ids))[:, 1]
    assert got.tolist() == pytest.approx(get_soft_overlong_punishment(100, 20)(ids))


@pytest.mark.parametrize(
    ("text", "answer"),
    [("so the total is \\boxed{\\frac{1}{3}} indeed", "\\frac{1}{3}"), ("... #### 1,234", "1,234"),
     ("The answer is: Paris.", "Paris."), ("I get 3 apples and then 42", "42"), ("no number\nlast line", "last line"),
     ("\\boxed{a{b}c} and \\boxed{x_{1}}", "x_{1}")],
    ids=["boxed", "gsm8k", "answer-colon", "last-number", "last-line", "last-boxed-nested"],
)  # fmt: skip
def test_the_final_answer_is_the_last_boxed_then_marked_then_number_then_line(text, answer):
    assert final_answer(text) == answer


def test_accuracy_compares_numbers_by_value_and_text_loosely_and_skips_empty_gold(tmp_path):
    assert normalise("1,000") == normalise("1000.0") == normalise("$1000$")
    assert normalise(" Paris. ") == normalise("paris")
    r = rewards(tmp_path, {"kind": "accuracy", "column": "solution"})
    completions = ["it is \\boxed{1000}", "#### 12", "I think 7", "whatever", "anything"]
    columns = [{"solution": "1,000"}, {"solution": 13}, {"solution": "7"}, {"solution": ""}, {}]
    got = r.score(["p"] * 5, completions, [[1]] * 5, columns)[:, 0]
    assert got[:3].tolist() == [1.0, 0.0, 1.0] and np.isnan(got[3:]).all()
    assert np.isnan(r.total(got[:, None])[3:]).all()  # nothing applied: NaN, left out of the group's mean


def test_a_reward_file_is_called_as_trl_calls_a_reward_function(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def score(prompts, completions, completion_ids, answer, **kw):\n"
        "    return [float(len(i)) if a == 'x' else None for i, a in zip(completion_ids, answer)]\n"
    )
    r = rewards(tmp_path, {"kind": "python", "file": "mine.py", "function": "score", "weight": 0.5},
                {"kind": "length", "cache": 50, "weight": 2.0})  # fmt: skip
    assert r.names == ["score", "length"]
    got = r.score(["a", "b"], ["t", "u"], [[1, 2, 3], [4] * 60], [{"answer": "x"}, {"answer": "y", "z": 1}])
    assert got[0].tolist() == [3.0, 0.0] and np.isnan(got[1, 0]) and got[1, 1] == pytest.approx(-0.2)
    assert r.total(got).tolist() == pytest.approx([1.5, -0.4])


@pytest.mark.parametrize(
    ("source", "message"),
    [("def reward(completions, **kw):\n    return [1.0]\n", "returned 1 values for 2 completions"),
     ("def reward(completions, **kw):\n    return ['high', 0.0]\n", "returned 'high' for completion 0"),
     ("def reward(completions, **kw):\n    return [float('nan'), 0.0]\n", "returned 'nan' for completion 0"),
     ("def reward(completions, **kw):\n    return {}['missing']\n", "raised KeyError"),
     ("def other(completions, **kw):\n    return [0.0, 0.0]\n", "defines no such function (it defines: other)"),
     ("import nothing_of_that_name\n", "running it failed: ModuleNotFoundError"),
     ("def reward(:\n", "running it failed: SyntaxError"),
     ("def reward(completions, log_metric, **kw):\n    log_metric('m', 'high')\n    return [0.0, 0.0]\n",
      "the value must be a finite number"),
     ("def reward(completions, log_metric, **kw):\n    log_metric('', 1.0)\n    return [0.0, 0.0]\n",
      "log_metric's name must be"),
     ("def reward(completions, log_extra, **kw):\n    log_extra(None, [1])\n    return [0.0, 0.0]\n",
      "log_extra's column must be a name")],
    ids=["length", "not-a-number", "nan", "raises", "no-function", "import", "syntax", "metric-value", "metric-name",
         "extra-column"],
)  # fmt: skip
def test_a_reward_file_that_fails_is_refused_naming_the_reward(tmp_path, source, message):
    (tmp_path / "r.py").write_text(source)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        r = rewards(tmp_path, {"kind": "python", "file": "r.py"})
        r.score(["a", "b"], ["t", "u"], [[1], [2]], [{}, {}])


def test_a_reward_file_is_read_only_as_a_regular_file_through_no_link(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "r.py").write_text("def reward(completions, **kw):\n    return [1.0] * len(completions)\n")
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    os.symlink(outside / "r.py", spec_dir / "r.py")
    with pytest.raises(ConfigError, match=r"r\.py"):
        rewards(spec_dir, {"kind": "python", "file": "r.py"})
    with pytest.raises(ConfigError, match=r"cannot be read|does not exist|no such"):
        rewards(spec_dir, {"kind": "python", "file": "absent.py"})
    assert rewards(outside, {"kind": "python", "file": "r.py"}).names == ["reward"]


def test_two_rewards_of_one_name_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="share a name"):
        rewards(tmp_path, {"kind": "format"}, {"kind": "format", "pattern": "x"})
