"""Benchmarks with lm-evaluation-harness: `eval.benchmarks` at the end of a job and `jobspec eval RUN_DIR`.

A real run of the tiny preset on the CPU (the worker's own main, in this process) with a local multiple-choice task
(a task YAML beside the spec, lm-eval's `dataset_path: json` over a jsonl file of its own): nothing comes from the
hub. The accuracies lm-eval reports are checked against the exported model's own log-likelihoods, computed here
with transformers, so a wrong model, tokenizer or scoring fails the test, not only a missing record.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from tests.cli_helpers import ROOT, cli
from tests.runner.train_helpers import records, tiny_spec_dict, worker_in_process, write_jsonl, write_spec

pytest.importorskip("lm_eval")

# Questions with choices of one length each: acc and acc_norm then differ only where lengths differ.
DOCS = [
    ("2 + 3 =", ["5", "7", "9", "1"]),
    ("The sky is", ["green", "blue", "red", "black"]),
    ("Water is", ["dry", "solid", "wet", "loud"]),
    ("Fire is", ["cold", "wet", "blue", "hot"]),
    ("A cat says", ["moo", "meow", "woof", "quack"]),
    ("Ice is", ["hot", "cold", "loud", "soft"]),
    ("One plus one is", ["two", "three", "four", "five"]),
    ("The sun is", ["a star", "a moon", "a rock", "a lake"]),
]
LIMIT = 6  # eval.limit: the job's benchmark reads the first 6 of the 8 docs


def task_yaml(name: str, data: Path) -> dict:
    """A multiple-choice task in lm-eval's own format over a local jsonl file (MMLU-style prompt and metrics)."""
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
    }  # fmt: skip


def write_task(directory: Path, name: str, answers: list[int]) -> Path:
    data = write_jsonl(directory / f"{name}.jsonl", [{"question": q, "choices": c, "answer": a}
                                                     for (q, c), a in zip(DOCS, answers, strict=True)])  # fmt: skip
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(task_yaml(name, data), sort_keys=False))
    return path


def choice_logprobs(export_dir: Path) -> list[list[float]]:
    """log P(" choice" | "Question: q\\nAnswer:") of every choice, summed over its tokens: lm-eval's loglikelihood,
    computed here from the exported model and tokenizer (no special tokens added; the context's tokens, then the
    continuation's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(export_dir)
    out = []
    for question, choices in DOCS:
        context = f"Question: {question}\nAnswer:"
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        row = []
        for choice in choices:
            whole = tok(context + " " + choice, add_special_tokens=False)["input_ids"]
            cont = whole[len(ctx):]
            ids = torch.tensor([whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
            row.append(sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)))
        out.append(row)
    return out


def accuracy(logprobs: list[list[float]], answers: list[int], n: int, *, norm: bool = False) -> float:
    """lm-eval's acc (argmax of the log-likelihoods) or acc_norm (divided by the choice's length in characters)."""
    right = 0
    for (_, choices), lls, answer in zip(DOCS[:n], logprobs[:n], answers[:n], strict=True):
        scores = [ll / len(c) if norm else ll for ll, c in zip(lls, choices, strict=True)]
        right += max(range(len(scores)), key=scores.__getitem__) == answer
    return right / n


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of the tiny preset whose spec asks for a local task at the end of the job: (run dir, answers)."""
    base = tmp_path_factory.mktemp("bench")
    (base / "tasks").mkdir()
    answers = [0, 1, 2, 3, 1, 1, 0, 0]
    write_task(base / "tasks", "tiny_mc", answers)
    run = base / "run"
    spec = tiny_spec_dict(run, training={"steps": 4}, eval={"benchmarks": ["tasks/tiny_mc.yaml"], "limit": LIMIT})
    spec_file = write_spec(base / "spec.yaml", spec)  # the task file is relative to it
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_CACHE", str(base / "datasets"))  # the json builder's cache, not the user's
        mp.setenv("HF_HUB_OFFLINE", "1")
        code, status = worker_in_process(spec_file, base / "status.json")
    assert code == EXIT_OK, status
    return run, answers


def test_the_jobs_benchmarks_land_in_metrics_with_the_exported_models_accuracy(finished):
    run, answers = finished
    got = records(run, "benchmark")
    assert [r["task"] for r in got] == ["tiny_mc"]
    rec = got[0]
    last = records(run, "train")[-1]["step"]
    assert rec["step"] == last == 4 and rec["samples"] == LIMIT and rec["limit"] == LIMIT
    assert {"eval/tiny_mc/acc", "eval/tiny_mc/acc_norm", "eval/tiny_mc/acc_stderr"} <= set(rec["metrics"])
    logprobs = choice_logprobs(run / "model")
    assert rec["metrics"]["eval/tiny_mc/acc"] == pytest.approx(accuracy(logprobs, answers, LIMIT))
    assert rec["metrics"]["eval/tiny_mc/acc_norm"] == pytest.approx(accuracy(logprobs, answers, LIMIT, norm=True))


def test_jobspec_eval_prints_the_accuracy_and_the_report_shows_it(finished, tmp_path):
    run, _ = finished
    # Answers chosen from the model itself: right on the first half (its argmax), wrong on the second, so lm-eval's
    # accuracy must be exactly 0.5.
    logprobs = choice_logprobs(run / "model")
    best = [max(range(4), key=row.__getitem__) for row in logprobs]
    answers = best[:4] + [(b + 1) % 4 for b in best[4:]]
    task = write_task(tmp_path, "tiny_mc_half", answers)
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HUB_OFFLINE": "1"}
    argv = ["eval", str(run), "--tasks", str(task), "--limit", str(len(DOCS))]  # the spec's eval.limit is 6
    done = subprocess.run([sys.executable, "-m", "jobspec", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == EXIT_OK, done.stderr[-3000:]
    rows = {tuple(line.split()[:3]) for line in done.stdout.splitlines()}
    assert ("tiny_mc_half", "acc", "0.5000") in rows, done.stdout
    rec = records(run, "benchmark")[-1]
    assert rec["task"] == "tiny_mc_half" and rec["samples"] == len(DOCS) and rec["step"] == 4
    assert rec["metrics"]["eval/tiny_mc_half/acc"] == 0.5
    assert math.isclose(rec["metrics"]["eval/tiny_mc_half/acc_norm"], accuracy(logprobs, answers, len(DOCS), norm=True))

    code, out = cli("report", str(run), "--out", str(tmp_path / "report"))
    assert code == EXIT_OK, out
    page = (tmp_path / "report" / "report.md").read_text()
    assert "## Benchmarks (lm-evaluation-harness)" in page
    assert "| tiny_mc_half | acc | 0.5000 |" in page and "| tiny_mc | acc_norm |" in page


def test_trackers_get_the_benchmarks_under_eval_task_metric():
    from runner.output.tracking import scalars

    rec = {"kind": "benchmark", "step": 4, "task": "t", "metrics": {"eval/t/acc": 0.5, "eval/t/acc_stderr": 0.1}}
    assert scalars(rec) == {"eval/t/acc": 0.5, "eval/t/acc_stderr": 0.1}


def test_a_deadline_stops_the_benchmarks_and_records_what_was_not_run(finished):
    from jobspec.spec.models import EvalSpec
    from runner.output import benchmarks

    run, _ = finished
    items = benchmarks.entries(["tasks/tiny_mc.yaml"], run.parent)
    model, tokenizer = benchmarks.load_export(run / "model", torch.device("cpu"))
    lm = benchmarks.bounded_lm(model, tokenizer, 1, deadline=0.0)  # every forward pass checks the deadline
    with pytest.raises(benchmarks.Timeout):
        lm._model_call(torch.tensor([[1, 2, 3]]))
    written: list[dict] = []
    cfg = EvalSpec(benchmarks=["tasks/tiny_mc.yaml"]).model_copy(update={"timeout_seconds": 0})
    done = benchmarks.run(run / "model", items, cfg, device=torch.device("cpu"), step=4, write=written.append)
    assert done == [] and [w["event"] for w in written] == ["benchmark_timeout"]
    assert "tasks/tiny_mc.yaml" in written[0]["reason"]


# --- bad input: exit 2 naming the field and the file -----------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "no such file"),
        ("dataset_path: json\n", "not an lm-evaluation-harness task"),
        ("task: [unclosed\n", "not YAML"),
    ],
)
def test_a_task_file_that_is_missing_or_no_task_exits_2_naming_field_and_file(tmp_path, content, why):
    if content is not None:
        (tmp_path / "mine.yaml").write_text(content)
    spec = tiny_spec_dict(tmp_path / "run", eval={"benchmarks": ["arc_easy", "mine.yaml"]})
    spec_file = write_spec(tmp_path / "spec.yaml", spec)
    code, out = cli("validate", str(spec_file))
    assert code == EXIT_CONFIG, out
    assert "eval.benchmarks[1] mine.yaml" in out and str(tmp_path / "mine.yaml") in out and why in out, out


def test_a_task_file_with_lm_evals_function_tags_validates(tmp_path):
    (tmp_path / "t.yaml").write_text("task: t\nprocess_docs: !function utils.process_docs\n")
    spec_file = write_spec(tmp_path / "spec.yaml", tiny_spec_dict(tmp_path / "run", eval={"benchmarks": ["t.yaml"]}))
    code, out = cli("validate", str(spec_file))
    assert code == EXIT_OK, out


def test_benchmarks_without_an_export_are_refused(tmp_path):
    spec = tiny_spec_dict(tmp_path / "run", eval={"benchmarks": ["arc_easy"]}, output={"export": False})
    code, out = cli("validate", str(write_spec(tmp_path / "spec.yaml", spec)))
    assert code == EXIT_CONFIG and "eval.benchmarks" in out and "output.export" in out, out


def test_the_job_checks_its_tasks_before_training(tmp_path, monkeypatch):
    """A task lm-eval cannot build (its data file is missing) ends the worker with 2 before the first step."""
    task = write_task(tmp_path, "broken", [0] * len(DOCS))
    (tmp_path / "broken.jsonl").unlink()
    spec = tiny_spec_dict(tmp_path / "run", eval={"benchmarks": ["broken.yaml"]})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    code, status = worker_in_process(write_spec(tmp_path / "spec.yaml", spec), tmp_path / "status.json")
    assert code == EXIT_CONFIG and "eval.benchmarks[0] broken.yaml" in status["reason"], status
    assert not records(tmp_path / "run", "train") and task.exists()


def test_hub_tasks_offline_and_not_cached_or_unknown_exit_2_with_the_fix(finished, tmp_path):
    run, _ = finished
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("HF_DATASETS_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "jobspec", "eval", str(run), "--tasks", "arc_easy", "arc_esy"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    err = done.stderr
    assert "--tasks[0] arc_easy" in err and "hub cache" in err and str(tmp_path / "hf") in err, err[-2000:]
    assert "--tasks[1] arc_esy: lm-evaluation-harness knows no task" in err and "did you mean arc_easy" in err, err
    assert "Traceback" not in err
    assert "arc_e" not in json.dumps(records(run, "benchmark"))  # nothing was run, nothing written
