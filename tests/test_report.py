"""`jobspec report`: plots and summary from metrics.jsonl, bad run directories, no matplotlib, a real run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jobspec.cli import main
from jobspec.report import TOKENS_LABEL, load_run
from jobspec.report.page import write_report

np = pytest.importorskip("numpy")
mpimg = pytest.importorskip("matplotlib.image")

GiB = 1024**3
PLOTS = ("loss.png", "lr.png", "tokens_per_s.png", "memory.png")
FAST_FAILED = "out of memory at micro-batch 1 (CUDA out of memory. Tried to allocate 2.00 GiB)"
RED = (214 / 255, 39 / 255, 40 / 255)  # tab:red, the tier-change line
PURPLE = (148 / 255, 103 / 255, 189 / 255)  # tab:purple, the OOM-shrink line


def plan(step: int, tier: str, mbs: int, accum: int, *, resumed: bool, t: float) -> dict[str, Any]:
    return {
        "time": t, "kind": "plan", "step": step, "resumed": resumed, "total_steps": 40, "tier": tier,
        "micro_batch": mbs, "grad_accum": accum, "global_batch": 8, "world_size": 1,
        "checkpointing": tier != "fast", "precision": "bf16", "num_workers": 2, "pin_memory": True,
        "seq_len": 1024, "estimated_bytes": 7 * GiB, "budget_bytes": 22 * GiB, "reasons": ["tier fast fits"],
    }  # fmt: skip


def train(step: int, tier: str, mbs: int, accum: int, *, t: float, tok_s: float, mem_gib: float) -> dict[str, Any]:
    return {
        "time": t, "kind": "train", "step": step, "total_steps": 40, "loss": 6.0 / (1 + 0.2 * step),
        "lr": 3e-4 * min(1.0, step / 4), "grad_norm": 1.5, "tier": tier, "micro_batch": mbs,
        "grad_accum": accum, "world_size": 1, "global_batch": 8, "samples": 8 * step, "epoch": 0,
        "targets": 4000, "tokens_per_s": tok_s, "mem_used_bytes": int(mem_gib * GiB),
        "mem_total_bytes": 24 * GiB, "gpu_util": 97,
    }  # fmt: skip


def realistic_records() -> list[dict[str, Any]]:
    """Tier fast with a shrink 8 -> 4 at step 12, a tier failure at step 23 (checkpoint at 20), then a resume at
    zero2_offload from step 20 that redoes steps 21-22 and finishes at 40."""
    t0 = 1_700_000_000.0
    rows = [plan(0, "fast", 8, 1, resumed=False, t=t0)]
    for step in range(2, 23, 2):
        mbs, accum = (8, 1) if step < 12 else (4, 2)
        rows.append(train(step, "fast", mbs, accum, t=t0 + 10 * step, tok_s=50_000 + step, mem_gib=20 - (step > 12)))
        if step == 12:
            rows.insert(-1, {
                "time": t0 + 119, "kind": "event", "event": "oom_shrink", "step": 12, "tier": "fast",
                "from_micro_batch": 8, "to_micro_batch": 4, "from_grad_accum": 1, "to_grad_accum": 2,
                "oom_rank": 0, "reason": "CUDA out of memory", "oom_at": t0 + 118.5,
            })  # fmt: skip
        if step % 10 == 0:
            rows.append({"time": t0 + 10 * step + 1, "kind": "eval", "step": step, "eval_loss": 3.0 / step ** 0.5,
                         "eval_tokens": 9000})  # fmt: skip
    t1 = t0 + 400
    rows.append({"time": t1 - 5, "kind": "heartbeat", "note": "a kind this report does not know"})
    rows.append(plan(20, "zero2_offload", 4, 2, resumed=True, t=t1))
    for step in range(22, 41, 2):
        rows.append(train(step, "zero2_offload", 4, 2, t=t1 + 20 * step, tok_s=20_000 + step, mem_gib=9.5))
        if step % 10 == 0:
            rows.append({"time": t1 + 20 * step + 1, "kind": "eval", "step": step, "eval_loss": 3.0 / step ** 0.5,
                         "eval_tokens": 9000})  # fmt: skip
    return rows


def write_run(run_dir: Path, rows: list[dict[str, Any]], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return run_dir


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = write_run(tmp_path / "run", realistic_records(), tail='{"time": 1700001300.0, "kind": "tra')  # killed
    state = {"tier": "zero2_offload", "failed": [{"tier": "fast", "reason": FAST_FAILED, "at": 1_700_000_240.0}],
             "attempts": 1, "exhausted": False, "caps": {}, "version": 1}  # fmt: skip
    (path / "tier_state.json").write_text(json.dumps(state))
    return path


def pixels(path: Path) -> Any:
    return mpimg.imread(path)[..., :3]  # RGBA floats in [0, 1]


def has_colour(img: Any, rgb: tuple[float, float, float], tol: float = 0.08) -> bool:
    return bool(np.any(np.all(np.abs(img - np.array(rgb)) < tol, axis=-1)))


def assert_not_blank(path: Path) -> None:
    img = pixels(path)
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 20, f"{path.name} is (nearly) one colour"


def test_report_writes_plots_and_a_summary(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / name) for name in ("report.md", "report.html", *PLOTS)]
    for name in PLOTS:
        assert_not_blank(out / name)
    lr = pixels(out / "lr.png")  # one blue series: the red and purple lines are the markers
    assert has_colour(lr, RED) and has_colour(lr, PURPLE)

    md = (out / "report.md").read_text()
    rows = realistic_records()
    last = [r for r in rows if r["kind"] == "train"][-1]
    assert f"Final train loss | {last['loss']:.4f} (step 40)" in md
    assert "tier zero2_offload, micro-batch 4 x 2 accumulation x 1 ranks = global batch 8" in md
    assert "bf16, activation checkpointing on" in md
    assert "40 / 40 (finished)" in md
    assert "| 0 | start | fast | 8 x 1 x 1 |" in md
    assert f"| 20 | tier change fast -> zero2_offload | zero2_offload | 4 x 2 x 1 | {FAST_FAILED} |" in md
    assert "| 12 | fast | 8 -> 4 | 1 -> 2 | CUDA out of memory |" in md
    assert "OOM shrinks (in process) | 1 |" in md and "Tier changes | 1 |" in md
    evals = {r["step"]: r["eval_loss"] for r in rows if r["kind"] == "eval"}
    assert f"best {evals[40]:.4f} (step 40), final {evals[40]:.4f} (step 40)" in md
    # 10 intervals at fast (50,002..50,020; step 22 was redone) and 10 at zero2_offload (20,022..20,040).
    assert f"{(20_040 + 50_002) // 2:,} {TOKENS_LABEL}; median of 20 log intervals" in md
    assert "20.00 GiB of 24.0 GiB (83%) at step 2" in md
    assert "Wall time (first to last record) | 20 min 01 s |" in md  # the first plan to the eval at step 40
    assert f"line {len(rows) + 1} of metrics.jsonl is not a JSON record: ignored" in md  # the truncated one
    html = (out / "report.html").read_text()
    assert all(f'<img src="{name}"' in html for name in PLOTS) and "<table>" in html


def test_a_resumed_run_counts_each_step_once_the_later_record_wins(run_dir: Path):
    run = load_run(run_dir)
    assert [r["step"] for r in run.train] == list(range(2, 41, 2))
    assert next(r["tier"] for r in run.train if r["step"] == 22) == "zero2_offload"
    assert run.tier_changes() == [(20, "fast", "zero2_offload")] and run.tier_failures == {"fast": FAST_FAILED}
    assert run.unreadable == [len(realistic_records()) + 1] and len(run.shrinks) == 1


def test_default_out_dir_is_inside_the_run(run_dir: Path):
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report" / "report.md").is_file() and (run_dir / "report" / "loss.png").is_file()


def test_null_series_are_skipped_and_said_so(tmp_path: Path):
    rows = [r for r in realistic_records() if r["kind"] != "eval"]
    for r in rows:
        if r["kind"] == "train":
            r.update(mem_used_bytes=None, mem_total_bytes=None, gpu_util=None)
    out = tmp_path / "out"
    assert main(["report", str(write_run(tmp_path / "run", rows)), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert not (out / "memory.png").exists() and (out / "loss.png").exists()
    assert "memory.png skipped: mem_used_bytes is null in every record" in md
    assert "Eval loss | no eval records" in md and "Peak memory | unknown" in md


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing", "no such directory; expected a run directory"),
        (lambda d: d, "no metrics.jsonl, so not a run directory"),
        (lambda d: write_run(d / "run", []), "metrics.jsonl: no records"),
        (lambda d: (d / "file.txt", (d / "file.txt").write_text("x"))[0], "not a directory; expected a run directory"),
    ],
    ids=["missing", "no-metrics", "empty", "a-file"],
)
def test_not_a_run_directory_exits_2_naming_the_path(make, message, tmp_path, capsys):
    path = make(tmp_path)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}") and message in err and "Traceback" not in err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["report", "--help"])
    assert info.value.code == 0 and "jobspec report" in capsys.readouterr().out


def report_in_subprocess(run_dir: Path, out: Path, *, hide_matplotlib: bool) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        + ("sys.modules['matplotlib'] = None  # as if it were not installed\n" if hide_matplotlib else "")
        + "from jobspec.cli import main\n"
        f"rc = main(['report', {str(run_dir)!r}, '--out', {str(out)!r}])\n"
        "heavy = sorted(m for m in ('torch', 'accelerate', 'transformers', 'kubernetes') if m in sys.modules)\n"
        "print('result', rc, heavy)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_report_never_imports_torch(run_dir: Path, tmp_path: Path):
    result = report_in_subprocess(run_dir, tmp_path / "out", hide_matplotlib=False)
    assert result.stdout.splitlines()[-1] == "result 0 []"
    assert (tmp_path / "out" / "loss.png").is_file()


def test_without_matplotlib_the_summary_is_written_with_an_install_hint(run_dir: Path, tmp_path: Path):
    out = tmp_path / "out"
    result = report_in_subprocess(run_dir, out, hide_matplotlib=True)
    assert result.stdout.splitlines()[-1] == "result 0 []"
    output = (result.stdout + result.stderr).splitlines()
    hints = [line for line in output if "pip install 'jobspec-k8s[report]'" in line]
    assert len(hints) == 1, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.md"]
    md = (out / "report.md").read_text()
    assert "no plots: matplotlib is not installed" in md and "Tier history" in md and "Final train loss" in md


@pytest.mark.slow
def test_report_on_a_real_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A real tiny CPU run with a real injected OOM at step 3 (a shrink 8 -> 4), then the report on it (~6 s)."""
    from tests.runner.train_helpers import records, tiny_spec, train_in_process

    monkeypatch.setenv("JOBSPEC_FAULT_OOM", "step=3")
    run_dir = tmp_path / "run"
    spec = tiny_spec(run_dir, training={"micro_batch": 8, "steps": 8, "log_every": 2, "eval_every": 4})
    assert train_in_process(spec)[0] == 0
    assert main(["report", str(run_dir)]) == 0
    out = run_dir / "report"
    for name in ("loss.png", "lr.png", "tokens_per_s.png", "memory.png"):  # on CPU memory is the process RSS
        assert_not_blank(out / name)
    md = (out / "report.md").read_text()
    last = records(run_dir)[-1]
    assert f"Final train loss | {last['loss']:.4f} (step 8)" in md and "8 / 8 (finished)" in md
    assert "OOM shrinks (in process) | 1 |" in md and "| 3 | fast | 8 -> 4 | 1 -> 2 |" in md
    assert "tier fast, micro-batch 8 x 1 accumulation x 1 ranks = global batch 8, fp32" in md
    assert "Micro-batch now | 4 x 2 (after OOM shrinks)" in md
    evals = records(run_dir, "eval")
    assert [e["step"] for e in evals] == [4, 8] and f"final {evals[-1]['eval_loss']:.4f} (step 8)" in md


def test_links_planted_at_the_report_files_are_replaced_never_written_through(run_dir: Path, tmp_path: Path):
    """The run directory is shared (jobspec.shared_dir): a link at report.html, report.md or a plot's name is
    replaced by the file, its target keeps its bytes."""
    out = run_dir / "report"
    out.mkdir()
    victims = {}
    for name in ("report.html", "report.md", "loss.png"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text(f"another job's {name}\n")
        (out / name).symlink_to(victim)
        victims[victim] = victim.read_bytes()
    report = write_report(run_dir)
    assert all(v.read_bytes() == data for v, data in victims.items())
    assert not (out / "report.html").is_symlink() and (out / "report.html").read_text().startswith("<")
    assert out / "report.md" in report.files


def test_a_link_planted_at_the_report_directory_is_refused_and_its_target_untouched(run_dir: Path, tmp_path: Path,
                                                                                     capsys):  # fmt: skip
    """`RUN/report` as a link to another directory: the default report is not written into it (exit 2, the fix
    named), the other directory keeps its files; `--out` naming a link the user chose is still followed."""
    elsewhere = tmp_path / "another-run-report"
    elsewhere.mkdir()
    (elsewhere / "report.md").write_text("another run's report\n")
    (run_dir / "report").symlink_to(elsewhere, target_is_directory=True)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and "--out" in err and "Traceback" not in err, err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["report.md"]
    assert (elsewhere / "report.md").read_text() == "another run's report\n"
    chosen = tmp_path / "mine"
    chosen.symlink_to(elsewhere, target_is_directory=True)
    assert elsewhere / "report.md" not in write_report(run_dir, chosen).files  # written as chosen/report.md
    assert (elsewhere / "report.md").read_text().startswith("#")


def reported(run_dir: Path, *plots: str) -> str:
    """`jobspec report RUN_DIR`'s report.md, after checking that each of `plots` is drawn (where matplotlib is)."""
    assert main(["report", str(run_dir)]) == 0
    out = run_dir / "report"
    if importlib.util.find_spec("matplotlib") is not None:
        for name in plots:
            assert_not_blank(out / name)
    return (out / "report.md").read_text()


def test_a_dpo_run_reports_trls_rewards(tmp_path: Path):
    """A real tiny DPO run: the report's summary has its last rewards/accuracies and margins, the rewards and accuracy
    plots are drawn; an SFT run's report has neither and says nothing of them."""
    from tests.runner.train.test_dpo import dpo, text_pairs
    from tests.runner.train_helpers import records, train_in_process, write_jsonl

    data = write_jsonl(tmp_path / "p.jsonl", text_pairs(12))
    assert train_in_process(dpo(tmp_path, data, steps=4, eval_every=None))[0] == 0
    run_dir = tmp_path / "run"
    md = reported(run_dir, "rewards.png", "accuracies.png")
    last = records(run_dir)[-1]
    assert (f"Preference (last step) | rewards/accuracies {last['rewards/accuracies']:.3f}, "
            f"rewards/margins {last['rewards/margins']:.4f} (step 4)") in md  # fmt: skip
    assert "router" not in md and "rewards.png skipped" not in md


def test_a_grpo_run_reports_its_rewards_and_completion_lengths(tmp_path: Path):
    """A real tiny GRPO run: the summary has its last reward, each reward function's mean (their names come from the
    spec, `rewards/<name>/mean`) and its completion length; the reward and length plots are drawn; a reward key past
    its bounds refuses its record, as any other field does."""
    from jobspec.report.metrics import validate
    from tests.runner.train.test_grpo import _spec
    from tests.runner.train_helpers import records, train_in_process

    assert train_in_process(_spec(tmp_path, steps=3, log_every=1))[0] == 0
    run_dir = tmp_path / "run"
    md = reported(run_dir, "reward.png", "completions.png")
    last = records(run_dir)[-1]
    assert (f"Reward (last step) | {last['reward']:.3f} (std {last['reward_std']:.3f}); lowercase "
            f"{last['rewards/lowercase/mean']:.3f}; completions {last['completions/mean_length']:.0f} tokens") in md
    assert "Preference (last step)" not in md
    kept, _ = validate(last)
    assert kept is not None and kept["rewards/lowercase/mean"] == last["rewards/lowercase/mean"]
    assert validate({**last, "rewards/lowercase/mean": 1e31})[0] is None
    assert "rewards/" + "x" * 90 + "/mean" not in (validate({**last, "rewards/" + "x" * 90 + "/mean": 1.0})[0] or {})
