"""Links planted at every name the runner writes (issue 32): a tiny run, prepared and streamed, is done once to learn
the names it writes (metrics, data cache entries, stamps, lock, stream index, checkpoints, the export), then again
in a fresh run directory where each of those names is a symbolic link (or a hard link) to a file outside the run.
Nothing outside moves: every outside file keeps its bytes and its mtime, and the run ends 0 or, for a file it must
append to and cannot, 2 naming it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jobspec.contract import EXIT_OK
from jobspec.errors import ConfigError
from tests.runner.train_helpers import tiny_spec, train_in_process, write_jsonl

ROWS = [{"prompt": f"q{i} hello there", "response": f"a{i} general kenobi"} for i in range(48)]


def _spec(run: Path, data: Path, streaming: bool):
    return tiny_spec(run, data={"path": str(data), "streaming": streaming}, training={"steps": 4},
                     checkpoints={"every_steps": 2})  # fmt: skip


def _written(run: Path) -> list[Path]:
    """Every regular file under `run`, relative to it."""
    return sorted(Path(dp, n).relative_to(run) for dp, _, names in os.walk(run) for n in names)


def _state(paths: list[Path]) -> dict[Path, tuple[bytes, int]]:
    return {p: (p.read_bytes(), os.stat(p).st_mtime_ns) for p in paths}


def _plant(run: Path, names: list[Path], outside: Path, hard: bool) -> list[Path]:
    """A link at each name under `run`, to a file of its own under `outside`; returns those files."""
    victims = []
    for i, name in enumerate(names):
        victim = outside / f"victim-{i}"
        victim.write_bytes(f"another job's {name}\n".encode() * 200)
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        if hard:
            os.link(victim, run / name)
        else:
            (run / name).symlink_to(victim)
        victims.append(victim)
    return victims


PAIRS = [{"prompt": f"q{i} hello", "chosen": f"a{i} kenobi", "rejected": f"no {i}"} for i in range(24)]


def _dpo(run: Path, data: Path, _streaming: bool):
    """A DPO run: its reference log-probs (and, under a key, their signature) are written beside the cache entry."""
    return tiny_spec(run, data={"path": str(data), "max_seq_len": 64}, checkpoints={"every_steps": 2},
                     training={"steps": 2, "warmup_steps": 0, "objective": "dpo", "global_batch": 4})  # fmt: skip


@pytest.mark.parametrize("streaming, dpo", [(False, False), (True, False), (False, True)],
                         ids=["prepared", "streamed", "dpo"])  # fmt: skip
def test_a_link_at_every_name_the_runner_writes_moves_nothing_outside(tmp_path, monkeypatch, streaming, dpo):
    if dpo:
        monkeypatch.setenv("JOBSPEC_CHECKPOINT_KEY", "k" * 64)
    data = write_jsonl(tmp_path / "d.jsonl", PAIRS if dpo else ROWS)
    spec = _dpo if dpo else _spec
    code, _ = train_in_process(spec(tmp_path / "learn", data, streaming))
    assert code == EXIT_OK
    # metrics.jsonl: the next test; DONE: a step with one is complete, and a forged complete step is damage (exit 2
    # when none is intact: tests/runner/checkpoint/test_untrusted.py), so it is planted without it (written last)
    names = [n for n in _written(tmp_path / "learn") if n.name not in ("metrics.jsonl", "DONE")]
    assert any(n.parts[0].startswith("step-") for n in names) and any(n.parts[0] == "model" for n in names)
    if dpo:
        assert {".npy", ".json"} <= {n.suffix for n in names if ".reference-" in n.name}, names
    elif streaming:
        assert any(n.parts[:2] == ("data-cache", "stream") for n in names), names
    else:
        assert any(n.name.endswith(".lock") for n in names) and any(n.name.endswith(".stamp") for n in names)
        assert any(n.name == "verified.stamp" for n in names), names
    names.append(Path("lease.json"))  # removed at the end of a run, so not in the listing
    outside = tmp_path / "outside"
    outside.mkdir()
    victims = _plant(tmp_path / "run", names, outside, hard=False)
    before = _state(victims)
    code, _ = train_in_process(spec(tmp_path / "run", data, streaming))
    assert code == EXIT_OK
    assert _state(victims) == before  # nothing written through a link, nothing truncated or appended
    assert sorted(os.listdir(outside)) == sorted(v.name for v in victims)  # nothing created outside either


def test_a_hard_link_at_an_appended_name_is_refused_and_a_directory_link_is_not_followed(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    victims = _plant(run, [Path("metrics.jsonl")], outside, hard=True)
    (outside / "cache").mkdir()
    (run / "data-cache").symlink_to(outside / "cache")  # the default cache directory, planted as a link
    before = _state(victims)
    with pytest.raises(ConfigError, match=r"metrics\.jsonl: has 2 hard links.*remove it"):
        train_in_process(_spec(run, data, streaming=False))
    assert _state(victims) == before and not any((outside / "cache").iterdir())
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victims[0])
    with pytest.raises(ConfigError, match=r"metrics\.jsonl: is a symbolic link"):
        train_in_process(_spec(run, data, streaming=False))
    (run / "metrics.jsonl").unlink()
    code, _ = train_in_process(_spec(run, data, streaming=False))  # the cache link: tokenized without a cache
    assert code == EXIT_OK and _state(victims) == before and not any((outside / "cache").iterdir())
