"""Test matrices too large to run whole by default: half of the combinations, chosen so that pairs stay covered.

`half_fraction(factors, ids)` gives every combination of the factors as pytest params; a combination whose value
indices sum to an even number runs by default, the others carry the `sweep` mark (`pytest -m sweep` runs them).
With three factors or more, every pair of values of two factors is still tested by default (the others' indices
take both parities); with two, each value of each factor still is. The ids are the factors' ids joined by "-".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest


def half_fraction(factors: Sequence[Sequence[Any]], ids: Sequence[Callable[[Any], str] | None] = ()) -> list[Any]:
    """Every combination of `factors` (a pytest param each); the odd half marked `sweep`. `ids[i]`: how factor i's
    values are named (default: `str`)."""
    names = [ids[i] if i < len(ids) and ids[i] else str for i in range(len(factors))]
    out = []
    for combo in itertools.product(*(list(enumerate(f)) for f in factors)):
        values = [v for _, v in combo]
        odd = sum(i for i, _ in combo) % 2
        out.append(pytest.param(*values, id="-".join(n(v) for n, v in zip(names, values, strict=True)),
                                marks=[pytest.mark.sweep] if odd else []))  # fmt: skip
    return out
