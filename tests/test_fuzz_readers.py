"""The readers of untrusted files hold under bench/fuzz_readers.py mutations: every case returns or is refused with
the project's own error (exit 2), none raises anything else or hangs. Fixed seeds here (a failure replays with
`python -m bench.fuzz_readers --seed S --targets T`); the bench itself draws fresh ones."""

from __future__ import annotations

import pytest

from bench.fuzz_readers import TARGETS, fuzz


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_readers_hold_under_fuzzing(target, tmp_path):
    tally = fuzz(target, seconds=2.0, seed=20261125, case_seconds=10.0, out=tmp_path)
    assert tally.cases > 20, tally  # the target runs at all
    assert not tally.failures, f"{target}: {len(tally.failures)} of {tally.cases} cases failed: {tally.failures[:5]}"
