"""runner.oom.faults: the JOBSPEC_FAULT_OOM rules and the forward pre-hook that raises a real OOM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobspec.errors import ConfigError
from runner.oom.detect import is_oom
from runner.oom.faults import ENV_VAR, FaultInjector, FaultRules, install_from_env, parse_rules, rules_from_env


def test_parse_every_rule_kind() -> None:
    rules = parse_rules(" mbs>2 , tier=fast,tier=zero2, step=7,step=9, rank=1")
    assert rules == FaultRules(2, frozenset({"fast", "zero2"}), frozenset({7, 9}), 1)


@pytest.mark.parametrize("text", [None, "", "   "])
def test_unset_means_no_rules(text: str | None) -> None:
    assert parse_rules(text) is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("mbs>", "cannot read rule 'mbs>'"),
        ("mbs<4", "cannot read rule"),
        ("tier=turbo", "unknown tier 'turbo'"),
        ("step=-1", "cannot read rule"),
        ("step=x", "needs a non-negative integer"),
        ("step=0", "counts from 1"),
        ("mbs>2,mbs>4", "mbs>N is given twice"),
        ("mbs>2,rank=0,rank=1", "rank=R is given twice"),
        ("rank=0", "rank=R, probes, backward, op=N or during=REGION alone injects nothing"),
        ("probes", "rank=R, probes, backward, op=N or during=REGION alone injects nothing"),
        ("mbs>2,,step=3", "cannot read rule ''"),
        ("oom=1", "cannot read rule 'oom=1'"),
    ],
)
def test_bad_rules_name_the_variable(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_rules(text)
    assert ENV_VAR in str(err.value) and needle in str(err.value)


def test_rules_from_env_reads_the_variable() -> None:
    assert rules_from_env({ENV_VAR: "mbs>4"}) == FaultRules(mbs_above=4)
    assert rules_from_env({}) is None


def _reason(rules: FaultRules, *, rank: int = 0, tier: str = "fast", step: int = 1, mbs: int = 1, fired=()) -> str:
    return rules.reason(rank=rank, tier=tier, step=step, micro_batch=mbs, fired=frozenset(fired))


def test_mbs_rule_fires_above_n_only() -> None:
    rules = FaultRules(mbs_above=2)
    assert [bool(_reason(rules, mbs=m)) for m in (1, 2, 3, 8)] == [False, False, True, True]


def test_tier_rule_fires_at_that_tier_every_step() -> None:
    rules = FaultRules(tiers=frozenset({"fast"}))
    assert all(_reason(rules, step=s) == "tier=fast" for s in range(5))
    assert not _reason(rules, tier="zero2_offload")


def test_step_rule_fires_once() -> None:
    rules = FaultRules(steps=frozenset({3}))
    assert _reason(rules, step=3) == "step=3"
    assert not _reason(rules, step=3, fired={3})
    assert not _reason(rules, step=4)


def test_rank_rule_limits_every_rule() -> None:
    rules = FaultRules(mbs_above=1, tiers=frozenset({"fast"}), rank=1)
    assert not _reason(rules, rank=0, mbs=8)
    assert _reason(rules, rank=1, mbs=8)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 16))


def test_injector_raises_a_real_oom_in_forward() -> None:
    model = _model()
    injector = FaultInjector(FaultRules(mbs_above=2), rank=0, tier="fast")
    injector.install(model)
    model(torch.zeros(2, 5, dtype=torch.long))  # 2 samples: fine
    with pytest.raises(torch.OutOfMemoryError) as err:
        model(torch.zeros(4, 5, dtype=torch.long))
    assert is_oom(err.value) and "micro-batch 4" in str(err.value) and ENV_VAR in str(err.value)
    injector.remove()
    model(torch.zeros(4, 5, dtype=torch.long))
    assert injector.injected == 1


def test_backward_rule_fires_mid_backward_after_the_upper_layers_gradients() -> None:
    """`backward`: the forward completes; the OOM comes when the gradient reaches the middle layer's output,
    so the layers above it already have gradients and it and the layers below do not."""
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    model = Stack()
    injector = FaultInjector(parse_rules("mbs>2,backward"), rank=0, tier="fast")
    injector.install(model)
    model(torch.ones(2, 4)).sum().backward()  # 2 samples: no fault
    model.zero_grad(set_to_none=True)
    out = model(torch.ones(3, 4))  # the forward of 3 samples runs through
    with torch.no_grad():
        model(torch.ones(3, 4))  # an evaluation forward plants nothing
    with pytest.raises(torch.OutOfMemoryError) as err:
        out.sum().backward()
    assert "micro-batch 3" in str(err.value) and injector.injected == 1
    assert [layer.weight.grad is not None for layer in layers] == [False, False, False, True]  # above layer 2
    injector.remove()
    model.zero_grad(set_to_none=True)
    model(torch.ones(3, 4)).sum().backward()
    assert injector.injected == 1


def test_injector_reads_the_batch_from_keyword_input_ids() -> None:
    class KwModel(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            return input_ids.float().sum()

    model = KwModel()
    FaultInjector(FaultRules(mbs_above=1), rank=0, tier="fast").install(model)
    with pytest.raises(torch.OutOfMemoryError):
        model(input_ids=torch.zeros(3, 4), labels=None)


def test_step_once_survives_a_restart(tmp_path: Path) -> None:
    rules = FaultRules(steps=frozenset({2}))
    first = FaultInjector(rules, rank=0, tier="fast", run_dir=tmp_path, step=2)
    with pytest.raises(torch.OutOfMemoryError):
        first.check(4)
    first.check(2)  # the retried step, same process: no second error
    restarted = FaultInjector(rules, rank=0, tier="fast", run_dir=tmp_path, step=2)  # a new process
    restarted.check(4)
    other_rank = FaultInjector(rules, rank=1, tier="fast", run_dir=tmp_path, step=2)  # its own record
    with pytest.raises(torch.OutOfMemoryError):
        other_rank.check(4)


def test_unreadable_fired_file_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "fault_oom_fired.rank0.json").write_text("{not json")
    injector = FaultInjector(FaultRules(steps=frozenset({1})), rank=0, tier="fast", run_dir=tmp_path, step=1)
    with pytest.raises(torch.OutOfMemoryError):
        injector.check(1)


def test_install_from_env(tmp_path: Path) -> None:
    model = _model()
    assert install_from_env(model, rank=0, tier="fast", run_dir=tmp_path, env={}) is None
    other = install_from_env(model, rank=0, tier="fast", run_dir=tmp_path, env={ENV_VAR: "mbs>1,rank=1"})
    assert other is not None
    model(torch.zeros(4, 3, dtype=torch.long))  # rank 0 is not targeted: no hook, no error
    mine = install_from_env(model, rank=1, tier="fast", run_dir=tmp_path, env={ENV_VAR: "mbs>1,rank=1"})
    assert mine is not None
    with pytest.raises(torch.OutOfMemoryError):
        model(torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ConfigError, match=ENV_VAR):
        install_from_env(model, rank=0, tier="fast", run_dir=tmp_path, env={ENV_VAR: "mbs=1"})


def test_probes_extends_the_rules_to_the_planner() -> None:
    assert parse_rules("mbs>20, probes") == FaultRules(20, probes=True)


@pytest.mark.parametrize(("limit", "expected"), [(20, 16), (127, 64), (1, 1), (128, 128)])
def test_the_planner_probe_search_runs_on_cpu_with_injected_faults(tmp_path, monkeypatch, limit, expected) -> None:
    """The GPU planning path end to end on CPU: the memory model says 128 fits; probes find the real maximum."""
    from jobspec.contract import EXIT_OK
    from tests.runner.train_helpers import records, tiny_spec, train_in_process

    monkeypatch.setenv(ENV_VAR, f"mbs>{limit},probes")
    spec = tiny_spec(tmp_path / "run", training={"global_batch": 128, "steps": 3})
    code, worker = train_in_process(spec)
    assert code == EXIT_OK and worker.plan.micro_batch == expected
    plan = records(tmp_path / "run", "plan")[0]
    assert plan["micro_batch"] == expected and 1 <= plan["probes"] <= 7 + 3  # log2(128) + 3
    assert worker.guard.injector is not None and worker.guard.injector.injected == 0  # training ran clean
