"""Several processes: gloo ranks on CPU agree on the plan, split every step exactly, shard with FSDP2;
the supervisor maps worker exits to the contract's codes."""

from __future__ import annotations

import json
import signal

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_OOM_RETRY_TIER, EXIT_PREEMPTED
from runner.data.dataset import DataOrder, load_data
from runner.data.tokenizer import ByteTokenizer
from runner.process.supervisor import combine
from tests.runner.train_helpers import records, run_supervisor, tiny_spec, tiny_spec_dict, train_in_process, write_spec

SECTIONS = {"training": {"micro_batch": 2, "steps": 4}, "checkpoints": {"every_steps": 2}}  # per rank: 2 x 2


def two_ranks(tmp_path, tier: str):
    run = tmp_path / tier
    spec = tiny_spec_dict(run, memory={"tier": tier}, **SECTIONS)
    result = run_supervisor(
        [str(write_spec(tmp_path / f"{tier}.yaml", spec)), "--nproc", "2"], JOBSPEC_RECORD_SAMPLES="1"
    )
    assert result.returncode == EXIT_OK, result.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The same job in one process (accumulation 4 instead of 2 x 2 ranks): the losses to match."""
    run = tmp_path_factory.mktemp("one") / "run"
    code, _ = train_in_process(tiny_spec(run, **SECTIONS))
    assert code == EXIT_OK
    return {r["step"]: r["loss"] for r in records(run)}


def test_two_cpu_ranks_agree_on_the_plan_and_split_each_step_exactly(tmp_path, one_rank):
    run = two_ranks(tmp_path, "fast")
    plan = records(run, "plan")[0]
    assert (plan["world_size"], plan["micro_batch"], plan["grad_accum"], plan["global_batch"]) == (2, 2, 2, 8)
    order = DataOrder(len(load_data(tiny_spec(run), ByteTokenizer()).train), 8, 42)
    seen = [[json.loads(line) for line in (run / f"samples-rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [len(s) for s in seen] == [4, 4]
    for r0, r1 in zip(*seen, strict=True):
        assert r0["step"] == r1["step"]
        assert (r0["micro_batch"], r0["grad_accum"]) == (r1["micro_batch"], r1["grad_accum"]) == (2, 2)
        assert r0["ids"] + r1["ids"] == order.step_samples(r0["step"] - 1)  # global batch exact, none repeated
    losses = {r["step"]: r["loss"] for r in records(run)}
    assert losses == pytest.approx(one_rank, rel=1e-5)  # token-weighted mean over ranks == one process
    ckpt = run / "step-4"
    assert {p.name for p in ckpt.glob("rng-*.pt")} == {"rng-0.pt", "rng-1.pt"} and (ckpt / "DONE").is_file()


def test_fsdp2_full_shard_on_two_cpu_ranks_matches_and_resumes_unsharded(tmp_path, one_rank):
    run = two_ranks(tmp_path, "zero3")
    assert records(run, "plan")[0]["tier"] == "zero3"
    assert {r["step"]: r["loss"] for r in records(run)} == pytest.approx(one_rank, rel=1e-5)
    # The sharded checkpoint loads into one unsharded process (DCP reshards), which trains on.
    code, _ = train_in_process(tiny_spec(run, training={"micro_batch": 2, "steps": 6}, memory={"tier": "fast"}))
    assert code == EXIT_OK
    assert records(run, "plan")[-1]["step"] == 4 and records(run)[-1]["step"] == 6


def test_combine_maps_worker_exits_to_the_contract():
    assert combine([0, 0]) == (EXIT_OK, "done")
    assert combine([EXIT_PREEMPTED, -signal.SIGTERM])[0] == EXIT_PREEMPTED
    assert combine([EXIT_OOM_RETRY_TIER, EXIT_OOM_RETRY_TIER])[0] == EXIT_OOM_RETRY_TIER
    assert combine([EXIT_PREEMPTED, EXIT_CONFIG])[0] == EXIT_CONFIG
    code, reason = combine([0, 7])
    assert code == EXIT_FAILED and "worker 1 failed with exit code 7" in reason
    code, reason = combine([-signal.SIGKILL, 0])
    assert code == EXIT_FAILED and "likely the host ran out of memory" in reason
    assert combine([-signal.SIGKILL, 1], killed={0})[0] == EXIT_FAILED  # our own kill after rank 1 failed


def test_a_global_batch_that_does_not_split_over_nproc_exits_2(tmp_path):
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", training={"global_batch": 9}))
    result = run_supervisor([str(spec), "--nproc", "2"])
    assert result.returncode == EXIT_CONFIG and "does not split over 2 processes" in result.stderr
    assert "Traceback" not in result.stderr
