"""Resume honesty: a changed micro-batch is honoured; a change of job, model, data or global batch is refused."""

from __future__ import annotations

import logging

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.errors import ConfigError
from tests.runner.train_helpers import (
    records,
    run_supervisor,
    tiny_spec,
    tiny_spec_dict,
    train_in_process,
    write_jsonl,
    write_spec,
)


@pytest.fixture()
def half_run(tmp_path):
    """4 of 8 steps done at micro-batch 8 (a checkpoint at step 4), as if the pod had been replaced."""
    run = tmp_path / "run"
    code, _ = train_in_process(tiny_spec(run, training={"steps": 4, "micro_batch": 8}))
    assert code == EXIT_OK
    return run


def test_a_changed_micro_batch_is_honoured_on_resume_and_logged_with_both_numbers(half_run, caplog):
    caplog.set_level(logging.INFO, logger="jobspec.runner")
    code, _ = train_in_process(tiny_spec(half_run, training={"steps": 8, "micro_batch": 2}))
    assert code == EXIT_OK
    plans = records(half_run, "plan")
    assert [(p["step"], p["micro_batch"], p["grad_accum"]) for p in plans] == [(0, 8, 1), (4, 2, 4)]
    assert "micro-batch 8 -> 2: training.micro_batch changed since the checkpoint" in caplog.text
    assert [r["micro_batch"] for r in records(half_run) if r["step"] > 4] == [2] * 4


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"training": {"global_batch": 16}}, "training.global_batch"),
        ({"training": {"seed": 7}}, "training.seed"),
        ({"model": {"preset": "llama-tiny"}}, "model.preset"),
        ({"model": {"lora": {"rank": 4}}}, "model.lora"),
        ({"data": {"max_seq_len": 32}}, "data.max_seq_len"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_change_that_breaks_exact_resume_is_refused_naming_the_field(half_run, change, field):
    sections = {k: {**v, "steps": 8} if k == "training" else v for k, v in change.items()}
    sections.setdefault("training", {"steps": 8})
    with pytest.raises(ConfigError) as err:
        train_in_process(tiny_spec(half_run, **sections))
    text = str(err.value)
    assert field in text and "checkpoints.resume: force" in text and "start fresh" in text
    assert len(records(half_run, "plan")) == 1  # nothing was trained or logged


def test_another_jobs_checkpoint_is_refused_and_force_resumes_it(half_run, tmp_path):
    other = tiny_spec_dict(half_run, training={"steps": 8})
    other["name"] = "someone-else"
    result = run_supervisor([str(write_spec(tmp_path / "other.yaml", other))], timeout=300)
    assert result.returncode == EXIT_CONFIG and "name: checkpoint 'runner-test', spec now 'someone-else'" in (
        result.stderr
    )
    other["checkpoints"]["resume"] = "force"
    code, worker = train_in_process(tiny_spec(half_run, training={"steps": 8}, checkpoints={"resume": "force"}))
    assert code == EXIT_OK and worker.first_step == 4


def test_changed_data_content_is_refused(tmp_path):
    rows = [{"prompt": f"q{i}", "response": f"answer {i}"} for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run = tmp_path / "run"
    code, _ = train_in_process(tiny_spec(run, data={"path": str(data)}, training={"steps": 3}))
    assert code == EXIT_OK
    write_jsonl(data, [{**r, "response": r["response"] + "!"} for r in rows])  # same file, other content
    with pytest.raises(ConfigError, match=r"data \(token rows\)"):
        train_in_process(tiny_spec(run, data={"path": str(data)}, training={"steps": 4}))


def test_a_finished_run_rerun_trains_nothing_and_keeps_its_export(tmp_path, caplog):
    run = tmp_path / "run"
    assert train_in_process(tiny_spec(run, training={"steps": 4}))[0] == EXIT_OK
    before = (run / "model" / "model.safetensors").stat().st_mtime_ns
    caplog.set_level(logging.INFO, logger="jobspec.runner")
    code, worker = train_in_process(tiny_spec(run, training={"steps": 4}))
    assert code == EXIT_OK and worker.first_step == 4
    assert "already exported" in caplog.text
    assert (run / "model" / "model.safetensors").stat().st_mtime_ns == before


def test_a_change_of_the_sources_mix_is_refused_and_a_new_label_is_not():
    import yaml

    from jobspec.spec.loader import parse_spec
    from runner.checkpoint.lineage import check_resume, lineage

    def of(sources):
        spec = {"name": "x", "model": {"preset": "tiny"}, "training": {"global_batch": 8}, "data": {"sources": sources}}
        return lineage(parse_spec(yaml.safe_dump(spec), "spec.yaml"), [])

    saved = of([{"path": "a.jsonl", "weight": 3}, {"path": "b.jsonl"}])
    check_resume(saved, of([{"path": "a.jsonl", "weight": 3, "name": "chat"}, {"path": "b.jsonl"}]), where="c",
                 force=False)  # fmt: skip
    for changed in ([{"path": "a.jsonl", "weight": 2}, {"path": "b.jsonl"}], [{"path": "a.jsonl", "weight": 3}],
                    [{"path": "a.jsonl", "weight": 3}, {"path": "b.jsonl", "format": "messages"}]):  # fmt: skip
        with pytest.raises(ConfigError, match=r"data\.sources"):
            check_resume(saved, of(changed), where="c", force=False)


def test_turning_streaming_on_or_off_is_refused_and_other_runs_keep_their_lineage():
    import yaml

    from jobspec.spec.loader import parse_spec
    from runner.checkpoint.lineage import check_resume, lineage

    def of(**data):
        spec = {"name": "x", "model": {"preset": "tiny"}, "training": {"global_batch": 8, "steps": 4}, "data": data}
        return lineage(parse_spec(yaml.safe_dump(spec), "spec.yaml"), [])

    prepared, streamed = of(), of(streaming=True)
    assert not any("streaming" in k or "shuffle" in k for k in prepared)  # as a checkpoint of an older jobspec has it
    for saved, now in ((prepared, streamed), (streamed, prepared), (streamed, of(streaming=True, shuffle_buffer=8))):
        with pytest.raises(ConfigError, match=r"data\.(streaming|shuffle_buffer)"):
            check_resume(saved, now, where="c", force=False)
    check_resume(streamed, of(streaming=True), where="c", force=False)
