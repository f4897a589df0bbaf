"""The suite's record as Markdown, and several part records merged into one.

Every section is always written, in the same order, whatever ran: a part not run in this call says so,
and a figure that needs a GPU reads "n/a (CPU)" in a CPU record (its JSON value is null).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.gpu.calibrate import text as calibration_text

PARTS: dict[str, tuple[str, ...]] = {  # in the order one call runs them (common.PART_ORDER)
    "tests": ("gpu_tests",),
    "recovery": ("recovery", "oom_anywhere"),
    "userpath": ("userpath",),
    "memory": ("sizing", "memory_model", "calibration"),
    "throughput": ("sides", "throughput", "tiers", "soak"),
}
SECTION_KEYS = tuple(k for ks in PARTS.values() for k in ks)
KEYS = ("schema", "environment", "config", "parts", "seconds", "status", *SECTION_KEYS)
SECTIONS = {
    "gpu_tests": "## GPU test tier (pytest -m gpu)",
    "recovery": "## OOM recovery",
    "oom_anywhere": "## OOM anywhere: sampled sweep",
    "userpath": "## The user path under a real OOM: jobspec run, memory taken from outside",
    "sizing": "## Sizing: formula, verified, exhaustive",
    "memory_model": "## Memory: formula vs trace vs measured peak",
    "calibration": "## Calibration",
    "sides": "## Throughput: runner, plain loop and HF Trainer (issue 42's rows)",
    "throughput": "## Throughput: runner vs plain loop",
    "tiers": "## Tier speed",
    "soak": "## VRAM soak",
}
GIB = 1024**3


class Fmt:
    def __init__(self, cpu: bool):
        self.na = "n/a (CPU)" if cpu else "n/a"

    def __call__(self, v: Any, spec: str = "") -> str:
        if v is None:
            return self.na
        if spec == "gib":
            return f"{v / GIB:.2f}"
        if spec == "pct":
            return f"{v:+.1%}"
        return format(v, spec) if spec else str(v)


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _tests(s: dict[str, Any], f: Fmt) -> list[str]:
    lines = [
        f"`{s['command']}`: exit {s['exit_code']}, {s.get('passed', 0)} passed, {s.get('failed', 0)} failed, "
        f"{s.get('error', 0)} errors, {s.get('skipped', 0)} skipped in {s['wall_s']} s.",
        "",
    ]
    if s.get("interrupted"):
        lines += [f"Interrupted {s['interrupted']}: the tests not listed below did not run.", ""]
    rows = [[c["test"], c["outcome"], str(c["seconds"]), c["message"] or "-"] for c in s.get("cases", [])]
    return lines + table(["test", "outcome", "s", "message"], rows)


def _oom_anywhere(s: dict[str, Any], f: Fmt) -> list[str]:
    return [
        f"{f(s.get('recovered'))} of {f(s.get('points'))} points recovered ({s['points_asked']} asked, seed "
        f"{s['seed']}) in {s['wall_s']} s of its {s['budget_s']} s budget.",
        "",
        s.get("matrix_md") or "(no matrix)",
    ]


def _recovery(rs: list[dict[str, Any]], f: Fmt) -> list[str]:
    rows = []
    for r in rs:
        last = r["runs"][-1]
        path = ", ".join(last.get("shrinks") or []) or "-"
        tiers = "; ".join(f"{t['from']} -> {t['to']} in {t['seconds']} s" for t in last.get("tier_changes") or [])
        tiers = tiers or last.get("tier_path") or (f"skipped: {last['skipped']}" if "skipped" in last else "-")
        rows.append(
            [
                r["scenario"],
                str(r["rounds"]),
                {True: "yes", False: "NO"}.get(r["ok"], "-"),
                f(r.get("median_recovery_s")),
                f(r.get("median_step_s_before") or r.get("median_step_s")),
                str(r["steps_lost"]),
                {True: "yes", False: "NO"}.get(r["same_samples"], "-"),
                path,
                tiers,
                f(r.get("median_wall_s")),
                f(r.get("median_cpu_s")),
            ]
        )
    notes = sorted({run.get("squeeze", "") for r in rs for run in r["runs"] if run.get("squeeze")})
    errors = [
        f"{run['scenario']} round {run['round']}: {run['error']}" for r in rs for run in r["runs"] if "error" in run
    ]
    head = [
        "scenario",
        "rounds",
        "ok",
        "OOM -> next step s (median)",
        "usual step s",
        "steps lost",
        "same samples",
        "micro-batch shrinks",
        "tier",
        "wall s",
        "CPU s",
    ]
    parts = []  # where each recovery's time went (the runner's oom_recovered and tier_change events)
    for r in rs:
        for run in r["runs"]:
            for e in [*(run.get("recovered") or []), *(run.get("tier_changes") or [])]:
                split = ", ".join(f"{k.removesuffix('_s')} {v}" for k, v in e.items() if k.endswith("_s"))
                if split:
                    parts.append(f"- {run['scenario']} round {run['round']}: {split} s")
    return (table(head, rows) + [""] + [f"- squeeze: {n}" for n in notes] + [f"- {e}" for e in errors]
            + (["", *parts] if parts else []))  # fmt: skip


def _sizing(rs: list[dict[str, Any]], f: Fmt) -> list[str]:
    rows = [
        [
            r["preset"],
            r["tier"],
            r.get("status", "ok")[:60],
            f(r.get("model_micro_batch")),
            f(r.get("verified_micro_batch")),
            f(r.get("verify_probes")),
            f(r.get("probe_bound")),
            f(r.get("verify_s")),
            f(r.get("exhaustive_micro_batch")),
            f(r.get("exhaustive_probes")),
            f(r.get("exhaustive_s")),
            f(r.get("verified_over_exhaustive")),
        ]
        for r in rs
    ]
    head = [
        "preset",
        "tier",
        "status",
        "model",
        "verified",
        "probes",
        "bound",
        "verify s",
        "exhaustive",
        "exh. probes",
        "exh. s",
        "verified/exh.",
    ]
    return table(head, rows)


def _memory(ms: list[dict[str, Any]], f: Fmt) -> list[str]:
    rows, errors = [], []
    for m in ms:
        p, x, t = m["predicted"], m["measured"], m.get("trace") or {}
        rows.append(
            [
                m["preset"],
                m["tier"],
                str(m["micro_batch"]),
                f(p["states"] + p["activations"] + p["logits"], "gib"),
                f(t.get("peak"), "gib") if "error" not in t else "failed",
                f(x.get("peak_allocated"), "gib"),
                f(m.get("formula_over_trace"), ".3f"),
                f(m.get("error_allocated"), "pct"),
                f(m.get("error_trace_allocated"), "pct"),
                f(p["total"], "gib"),
                f(x.get("peak_reserved"), "gib"),
                f(x.get("device_peak"), "gib"),
                f(m.get("error_device"), "pct"),
                x.get("oom") or "-",
            ]
        )
        if "error" in t:
            errors.append(f"- trace of {m['preset']} {m['tier']}: {t['error']}")
    head = [
        "preset",
        "tier",
        "mbs",
        "formula GiB",
        "trace GiB",
        "peak allocated",
        "formula / trace",
        "allocated vs formula",
        "allocated vs trace",
        "formula + overhead",
        "peak reserved",
        "device peak",
        "device vs formula + overhead",
        "OOM",
    ]
    return [
        *table(head, rows),
        *(["", *errors] if errors else []),
        "",
        "formula: jobspec/plan/memory.py's states + activations + logits (no overhead); trace: the runner's step on "
        "FakeTensors at the same micro-batch (runner/train/trace.py); peak allocated: "
        "`torch.cuda.max_memory_allocated` over three real optimizer steps. vs = measured / predicted - 1. "
        "Device = peak reserved + memory outside the caching allocator (CUDA context), against the formula with "
        "its 1 GiB + 5 % overhead.",
    ]


def _throughput(t: dict[str, Any], f: Fmt) -> list[str]:
    head = ["side", "median tokens/s", "wall s/step", "CPU s/step", "MFU"]
    rows = [
        [
            side,
            f(t[side]["median_tokens_per_s"], ",.0f"),
            f(t[side]["median_wall_s_per_step"]),
            f(t[side]["median_cpu_s_per_step"]),
            f(t[side]["mfu"], ".1%"),
        ]
        for side in ("runner", "plain")
    ]
    return [
        f"{t['preset']}, seq {t['seq_len']}, {t['precision']}, micro-batch {t['micro_batch']} x {t['grad_accum']}, "
        f"{t['rounds']} paired rounds of {t['steps_per_round']} steps (first side alternating).",
        "",
        *table(head, rows),
        "",
        f"runner / plain: {f(t['ratio_of_medians'])} (ratio of medians), "
        f"{f(t['median_paired_ratio'])} (median of per-round ratios).",
    ]


def _sides(s: dict[str, Any], f: Fmt) -> list[str]:
    """bench/throughput.py's runner / plain / HF Trainer table, a row per row that ran, a line per row that did not."""
    from bench.throughput import table

    done = [r for r in s["rows"] if "status" not in r]
    lines = [f"Within {s['budget_s']} s of the part's budget; rounds interleaved, the first side alternating; MFU = "
             "tokens/s x FLOPs/token / dense bf16 peak.", ""]  # fmt: skip
    for r in done:
        lines.append(f"- {r['row']}: {r['rounds']} measured rounds of {r['steps_per_round']} steps, {r['seconds']} s; "
                     f"FLOPs/token {r['flops_formula']}; Trainer: {r['trainer_collator']}, {r['trainer_attention']}; "
                     f"loss {r['loss_kernel']}, compile {r['compile']}, blocks {r['block_kernels']}")  # fmt: skip
    lines += [f"- {r['row']}: {r['status']}" for r in s["rows"] if "status" in r]
    return [*lines, *(["", table(done)] if done else [])]


def _tiers(ts: list[dict[str, Any]], f: Fmt) -> list[str]:
    rows = [
        [
            t["tier"],
            f(t["micro_batch"]),
            f(t["tokens_per_s"], ",.0f"),
            f(t["median_wall_s_per_step"]),
            f(t["median_cpu_s_per_step"]),
            f(t["ratio_to_fast"]),
            f(t["mfu"], ".1%"),
            "; ".join(r["error"] for r in t["runs"] if "error" in r)[:120] or "-",
        ]
        for t in ts
    ]
    return table(["tier", "micro-batch", "tokens/s", "wall s/step", "CPU s/step", "/ fast", "MFU", "errors"], rows)


def _soak(s: dict[str, Any], f: Fmt) -> list[str]:
    return [
        f"{s['preset']} {s['tier']}, micro-batch {s['micro_batch']} x {s['grad_accum']}: {s['steps']} of "
        f"{s['steps_asked']} steps in {s['wall_s']} s wall, {s['cpu_s']} s CPU; {f(s['tokens_per_s'], ',.0f')} "
        f"tokens/s, MFU {f(s['mfu'], '.1%')}.",
        f"- OOMs: {s['runner_shrinks']} runner shrinks, {f(s['allocator_ooms'])} allocator OOMs",
        f"- peak VRAM: {f(s['vram_pct_device'])} % of the device (reserved + outside the allocator), "
        f"{f(s['vram_pct_allocated'])} % allocated; peak allocated {f(s['peak_allocated'], 'gib')} GiB, "
        f"reserved {f(s['peak_reserved'], 'gib')} GiB of {f(s['device_total'], 'gib')} GiB",
    ]


def _userpath(u: dict[str, Any], f: Fmt) -> list[str]:
    if "failures" not in u:  # still running when the record was written, or cut off
        return [str(u.get("status") or u)]
    verdict = "ok: every requirement held" if u["ok"] else "FAILED: " + "; ".join(u["failures"])
    once = u["train_steps"] == list(range(1, u["steps"] + 1))
    rows = [
        ["preset", f"{u['preset']}, seq {u['seq']}, global batch {u['global_batch']}, {u['steps']} steps"],
        ["memory taken by", f"JOBSPEC_FAULT_OOM={u['faults']}" if u.get("faults") else
         f"a hog process (caching allocator in the run: {'on' if u.get('caching_allocator') else 'off'})"],
        ["squeezes", "; ".join(f"{q['squeeze']} at step {q.get('at_step')} +{q.get('delay_s')} s, cap "
                               f"{q.get('cap_gib')} GiB ({q.get('hog')})" for q in u.get("squeezes") or []) or "-"],
        ["exit code", f(u.get("exit_code"))],
        ["steps recorded", f"{len(u['train_steps'])} ({'each once' if once else u['train_steps']})"],
        ["shrinks", ", ".join(u["shrinks"]) or "-"],
        ["tier changes", ", ".join(f"{c['from_tier']} -> {c['to_tier']} in {c['seconds']} s"
                                   f"{' in process' if c.get('in_process') else ''}"
                                   for c in u["tier_changes"]) or "-"],
        ["phases started / ended", f"{u['phases']['started']} / {u['phases']['ended']}"],
        ["longest log silence in the recovery s: with no phase open / any",
         f"{f(u.get('longest_unexplained_silence_s'))} / {f(u.get('longest_log_silence_s'))}"],
        ["step-down s, the tier's give-up included (goal 10 on an H200)", f(u.get("step_down_total_s"))],
        ["OOM -> first step after the step-down s", f(u.get("oom_to_step_after_step_down_s"))],
        ["start-up to step 1 s (goal 15 on an H200)", f(u.get("startup_to_step1_s"))],
        ["wall s", f(u.get("wall_s"))],
    ]  # fmt: skip
    return [verdict, "", *table(["", ""], rows)]


RENDER: dict[str, Callable[[Any, Fmt], list[str]]] = {
    "gpu_tests": _tests,
    "recovery": _recovery,
    "oom_anywhere": _oom_anywhere,
    "userpath": _userpath,
    "sizing": _sizing,
    "memory_model": _memory,
    "calibration": lambda c, f: [calibration_text(c)],
    "sides": _sides,
    "throughput": _throughput,
    "tiers": _tiers,
    "soak": _soak,
}


def _status(record: dict[str, Any]) -> list[str]:
    status, seconds = record.get("status") or {}, record.get("seconds") or {}
    rows = [
        [part, (status.get(part) or {}).get("status", "-"), str(seconds.get(part, "-")),
         str((status.get(part) or {}).get("budget_s", "-"))]
        for part in record.get("parts") or []
    ]  # fmt: skip
    return table(["part", "status", "seconds", "budget s"], rows)


def markdown(record: dict[str, Any]) -> str:
    env, cfg = record["environment"], record.get("config") or {}
    f = Fmt(cpu=cfg.get("device") == "cpu")
    lines = [
        f"# jobspec GPU proof: {env['device'] or 'device not probed yet'}",
        "",
        f"{env['date']}, mode {env['mode']}, parts {', '.join(record['parts'])}.",
        "",
        *_status(record),
        "",
    ]
    lines += table(["", ""], [[k, f(v)] for k, v in env.items() if k != "argv"])
    lines += [
        "",
        "MFU = tokens/s x FLOPs/token / dense bf16 peak; FLOPs/token = 6N + 6*L*C*T (llm.c; N all "
        "parameters incl. embeddings, L layers, C hidden, T row length); tokens are input tokens, padding "
        "excluded. Medians throughout; CPU seconds are this process and its loader workers.",
    ]
    for key, title in SECTIONS.items():
        lines += ["", title, ""]
        part = next(p for p, ks in PARTS.items() if key in ks)
        value = record.get(key)
        if value is None:
            why = ((record.get("status") or {}).get(part) or {}).get("status")
            lines.append(f"Not run in this call (part `{part}`{': ' + why if why else ''}).")
        elif isinstance(value, dict) and "status" in value and len(value) == 1:
            lines.append(value["status"])
        else:
            try:
                lines += RENDER[key](value, f)
            except Exception as err:  # a shape this report does not know must not cost the record its report
                lines.append(f"(not rendered: {type(err).__name__}: {err}; the figures are in the JSON record)")
    return "\n".join(lines) + "\n"


def merge(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from several part records: each section from the last record that has it."""
    out = {k: None for k in KEYS}
    out.update(
        schema=records[-1]["schema"],
        environment=records[0]["environment"],
        config=records[0]["config"],
        parts=[],
        seconds={},
        status={},
    )
    for r in records:
        out["parts"] += [p for p in r["parts"] if p not in out["parts"]]
        out["seconds"].update(r.get("seconds") or {})
        out["status"].update(r.get("status") or {})
        out.update({k: r[k] for k in SECTION_KEYS if r.get(k) is not None})
    return out
