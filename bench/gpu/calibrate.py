"""Suggested memory-model constants from a suite record's measured peaks (`python -m bench.gpu --calibrate R.json`).

Prints what `jobspec/plan/memory.py` would need to match the measurements; it changes nothing. Three fits:

1. per-sample bytes: each sizing run's passing probe steps give (micro-batch, peak allocated); a straight
   line through them gives the measured bytes per sample (slope). Across presets, whose activation/logit
   ratios differ, least squares solves slope = a*activations(1) + b*logits(1) for the model's per-sample
   terms: the activation term x a (tiers without checkpointing), x a_ckpt (with), the logits term x b
   (factors for activations.ACT_BYTES and the loss's terms). With one preset (or collinear terms) a single
   factor scales both.
2. fixed bytes: the line's intercept against the model's states (weights, grads, optimizer), as a check.
3. overhead: device peak - peak allocated = F + p * peak allocated over the memory runs (least squares):
   OVERHEAD_FIXED' = F, OVERHEAD_PERCENT' = 100 p (one run: its context, and reserved/allocated - 1).

Then every memory run is predicted again with the suggested constants and its error shown beside today's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jobspec.plan import memory


def _line(probes: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(slope, intercept) of peak allocated over micro-batch through the passing probes (two distinct sizes), the
    runner's own verification probes left out: its first passing one runs before Adam's moments exist."""
    pts = {
        p["micro_batch"]: p["peak_allocated"]
        for p in probes
        if p.get("ok") and p.get("peak_allocated") and p.get("purpose") != "verify"
    }
    if len(pts) < 2:
        return None
    x, y = np.array(list(pts), dtype=float), np.array(list(pts.values()), dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(intercept)


def _solve(rows: list[tuple[float, float, float]]) -> tuple[float, float, str]:
    """(a, b, how) with slope ~ a*act + b*logits over rows (act, logits, slope)."""
    a_mat = np.array([[r[0], r[1]] for r in rows])
    y = np.array([r[2] for r in rows])
    if len(rows) >= 2 and np.linalg.matrix_rank(a_mat / np.abs(a_mat).max(axis=0)) == 2:
        (a, b), *_ = np.linalg.lstsq(a_mat, y, rcond=None)
        return float(a), float(b), f"least squares over {len(rows)} presets"
    scale = float(np.median([r[2] / (r[0] + r[1]) for r in rows]))
    return scale, scale, f"one factor from {len(rows)} run(s): activations and logits not separable"


def _overhead(mems: list[dict[str, Any]]) -> tuple[float, float, str]:
    alloc = np.array([m["measured"]["peak_allocated"] for m in mems], dtype=float)
    over = np.array([m["measured"]["device_peak"] - m["measured"]["peak_allocated"] for m in mems], dtype=float)
    if len(mems) >= 2 and np.ptp(alloc) > 0:
        pct, fixed = np.polyfit(alloc, over, 1)
        return float(fixed), float(pct), f"least squares over {len(mems)} runs"
    m = mems[0]["measured"]
    return float(m["context"]), float(m["peak_reserved"] / m["peak_allocated"] - 1), "one run"


def calibrate(record: dict[str, Any]) -> dict[str, Any]:
    """Suggested constants and the errors they would give; status says why when nothing can be fitted."""
    current = {
        "activations x": 1.0,
        "activations (checkpointing) x": 1.0,
        "logits x": 1.0,
        "OVERHEAD_FIXED": memory.OVERHEAD_FIXED,
        "OVERHEAD_PERCENT": memory.OVERHEAD_PERCENT,
    }
    mems = {(m["preset"], m["tier"]): m for m in record.get("memory_model") or []}
    measured = [m for m in mems.values() if m["measured"].get("peak_allocated") and not m["measured"].get("oom")]
    if not measured:
        return {"status": "no GPU measurements: nothing to calibrate", "current": current, "suggested": None}
    rows: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    fixed_ratio: list[float] = []
    for entry in record.get("sizing") or []:
        mem, line = mems.get((entry["preset"], entry["tier"])), _line(entry.get("probes") or [])
        if mem is None or line is None:
            continue
        p = mem["predicted"]
        rows[bool(p["checkpointing"])].append((p["per_sample_activations"], p["per_sample_logits"], line[0]))
        fixed_ratio.append(line[1] / p["states"])
    fits: dict[str, Any] = {}
    factors: dict[bool, tuple[float, float]] = {}
    for is_ckpt, rs in rows.items():
        if rs:
            a, b, how = _solve(rs)
            factors[is_ckpt] = (a, b)
            fits["checkpointing" if is_ckpt else "no checkpointing"] = {"activations": a, "logits": b, "how": how}
    if not factors:
        return {
            "status": "too few passing probe steps per run to fit bytes per sample",
            "current": current,
            "suggested": None,
        }
    f_fixed, f_pct, how = _overhead(measured)
    fits["overhead"] = {"fixed": f_fixed, "percent": 100 * f_pct, "how": how}
    plain, ckpt = factors.get(False) or factors[True], factors.get(True) or factors[False]
    suggested = {
        "activations x": round(plain[0], 3),
        "activations (checkpointing) x": round(ckpt[0], 3),
        "logits x": round(plain[1], 3),
        "OVERHEAD_FIXED": round(f_fixed),
        "OVERHEAD_PERCENT": round(100 * f_pct, 2),
    }
    errors = []
    for m in measured:
        p, ms = m["predicted"], m["measured"]
        a, b = ckpt if p["checkpointing"] else plain
        body = p["states"] + a * p["activations"] + b * p["logits"]
        new = body + f_fixed + f_pct * body
        errors.append(
            {
                "preset": m["preset"],
                "tier": m["tier"],
                "micro_batch": m["micro_batch"],
                "error_now": round(ms["device_peak"] / p["total"] - 1, 4),
                "error_suggested": round(ms["device_peak"] / new - 1, 4),
            }
        )
    worst = max(abs(e["error_suggested"]) for e in errors)
    return {
        "status": "ok",
        "current": current,
        "suggested": suggested,
        "fits": fits,
        "fixed_over_states": [round(x, 3) for x in fixed_ratio],
        "errors": errors,
        "worst_error_suggested": round(worst, 4),
    }


def text(cal: dict[str, Any]) -> str:
    """The calibration as lines to print (and for the report)."""
    if cal["status"] != "ok":
        return f"calibration: {cal['status']} (jobspec/plan/memory.py keeps {cal['current']})"
    lines = ["calibration (suggested factors and constants for jobspec/plan/memory.py; nothing is changed):"]
    for k, v in cal["suggested"].items():
        lines.append(f"  {k:30s} {cal['current'][k]!s:>12} -> {v}")
    for name, f in cal["fits"].items():
        lines.append(
            f"  fit {name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in f.items())
        )
    for e in cal["errors"]:
        lines.append(
            f"  {e['preset']} {e['tier']} mbs {e['micro_batch']}: error {e['error_now']:+.1%} now, "
            f"{e['error_suggested']:+.1%} with the suggested constants"
        )
    return "\n".join(lines)
