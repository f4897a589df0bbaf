"""The report's page (report.md, report.html) and plots, from a `Run` (run.py)."""

from __future__ import annotations

import html
import io
import logging
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec import install_hint, shared_dir
from jobspec.contract import METRICS_FILE, TIER_STATE_FILE
from jobspec.errors import ConfigError
from jobspec.report.metrics import Record, lines
from jobspec.report.run import Run, load_run
from jobspec.report.summary import PEAK

log = logging.getLogger(__name__)
GiB = 1024**3
INSTALL_HINT = install_hint("report")
# StepResult.tokens (runner/train/step.py): input tokens of the global step over all ranks, padding excluded,
# divided by the wall time between two log records (which includes eval and checkpoint time).
TOKENS_LABEL = "input tokens/s (all ranks, padding excluded)"
MAX_SHRINK_ROWS = 10  # the page stays one page
MAX_HISTORY_ROWS = 50  # starts and tier changes listed; a crash-looping run has thousands
MAX_MARKERS = 50  # per kind (shrinks, tier changes) drawn on a plot
CSS = "body{font-family:sans-serif;max-width:60em}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"


@dataclass
class Report:
    files: list[Path]  # what was written, report.md first
    notes: list[str]  # plots skipped, lines ignored
    plots_missing: bool  # matplotlib is not installed


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --- plots ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    label: str
    points: list[tuple[int, float]]
    style: str = "-"


@dataclass(frozen=True)
class Chart:
    file: str
    title: str
    ylabel: str
    field: str  # the metrics.jsonl field of the first series: without values the chart is skipped
    series: list[Series]
    from_zero: bool = True  # y axis starts at 0 (not for the loss: its fall is the point)


@dataclass(frozen=True)
class Marker:
    step: int
    label: str
    kind: str  # "OOM shrink" | "tier change": the legend entry and the colour


MARKER_STYLE = {"OOM shrink": ("tab:purple", "--"), "tier change": ("tab:red", "-")}  # not C0/C1: the series


def charts(run: Run) -> list[Chart]:
    train, evals = run.train_series, run.eval_series
    return [
        Chart("loss.png", "Loss", "loss per target token", "loss",
              [Series("train", train.points("loss")), Series("eval", evals.points("eval_loss"), "o-")],
              from_zero=False),
        Chart("lr.png", "Learning rate", "learning rate", "lr", [Series("lr", train.points("lr"))]),
        Chart("tokens_per_s.png", "Throughput", TOKENS_LABEL, "tokens_per_s",
              [Series("tokens/s", train.points("tokens_per_s"))]),
        Chart("memory.png", "Memory (GPU allocator peak; process RSS on CPU)", "GiB", "mem_used_bytes",
              [Series("used (peak since the previous record)", train.points("mem_used_bytes", 1 / GiB)),
               Series("total", train.points("mem_total_bytes", 1 / GiB), "--")]),
        *_objective_charts(run),
    ]  # fmt: skip


def _objective_charts(run: Run) -> list[Chart]:
    """A preference objective's rewards and accuracy (TRL's names), a mixture of experts' router loss: only for the
    runs that log them (an SFT run's report does not list them as skipped)."""
    train, out = run.train_series, []
    if train.points("rewards/margins"):
        out += [
            Chart("rewards.png", "Preference rewards (TRL's rewards/*)", "reward (beta x log-ratio)", "rewards/margins",
                  [Series("margins", train.points("rewards/margins")), Series("chosen", train.points("rewards/chosen")),
                   Series("rejected", train.points("rewards/rejected"), "--")], from_zero=False),
        ]  # fmt: skip
    if train.points("rewards/accuracies"):  # not KTO's: its records are unpaired
        out.append(Chart("accuracies.png", "Preference accuracy (rewards/accuracies)", "chosen preferred",
                         "rewards/accuracies", [Series("accuracy", train.points("rewards/accuracies"))]))  # fmt: skip
    if train.points("reward"):  # GRPO: the summed reward of the step's completions, and how long they were
        out.append(Chart("reward.png", "GRPO reward (TRL's reward and reward_std)", "summed reward", "reward",
                         [Series("reward", train.points("reward")), Series("reward_std", train.points("reward_std"),
                                                                           "--")], from_zero=False))  # fmt: skip
        out.append(Chart("completions.png", "GRPO completion length (completions/mean_length)", "tokens",
                         "completions/mean_length", [Series("mean", train.points("completions/mean_length"))]))
    if train.points("router_aux_loss"):
        out.append(Chart("router.png", "Router load-balancing loss", "aux loss (unweighted)", "router_aux_loss",
                         [Series("router_aux_loss", train.points("router_aux_loss"))], from_zero=False))  # fmt: skip
    return out


def markers(run: Run) -> list[Marker]:
    """The first MAX_MARKERS shrinks and tier changes: more lines than that hide the series."""
    shrinks = [
        Marker(e["step"], f"mbs {e.get('from_micro_batch')}→{e.get('to_micro_batch')}", "OOM shrink")
        for e in run.shrinks[:MAX_MARKERS]
        if "step" in e
    ]
    tiers = [Marker(step, f"→ {new}", "tier change") for step, _, new in run.tier_changes()[:MAX_MARKERS]]
    return shrinks + tiers


def _load_matplotlib() -> tuple[Any, Any] | None:
    """(Figure, FigureCanvasAgg), or None when matplotlib is not installed. No pyplot: no global state."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def draw(chart: Chart, marks: list[Marker], path: Path, mpl: tuple[Any, Any], *, follow_dir: bool = True) -> None:
    figure_cls, canvas_cls = mpl
    fig = figure_cls(figsize=(8, 4), dpi=100, layout="constrained")
    canvas_cls(fig)  # the Agg canvas: renders to PNG without a display
    ax = fig.add_subplot()
    for s in chart.series:
        if s.points:
            steps, values = zip(*s.points, strict=True)
            ax.plot(steps, values, s.style, label=s.label, markersize=3)
    labelled: set[str] = set()
    for m in marks:
        color, style = MARKER_STYLE[m.kind]
        ax.axvline(m.step, color=color, linestyle=style, linewidth=1,
                   label=None if m.kind in labelled else m.kind)  # fmt: skip
        labelled.add(m.kind)
        ax.annotate(m.label, (m.step, 1), xycoords=ax.get_xaxis_transform(), xytext=(-4, -3),
                    textcoords="offset points", rotation=90, rotation_mode="anchor", ha="right", va="bottom",
                    fontsize=7, color=color)  # fmt: skip
    if chart.from_zero:
        ax.set_ylim(bottom=0)
    ax.set(title=chart.title, xlabel="optimizer step", ylabel=chart.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    image = io.BytesIO()
    fig.savefig(image, format=path.suffix.lstrip(".") or "png")
    # a run directory is shared: never through a link (nor through a linked report directory nobody chose)
    shared_dir.write_atomic(path, image.getvalue(), fsync=False, follow_dir=follow_dir)


# --- the page ---------------------------------------------------------------------------------------


class Page:
    """One page written as Markdown and as HTML from the same calls."""

    def __init__(self, title: str):
        self.title = title
        self.md = [f"# {title}", ""]
        self.html = [f"<h1>{html.escape(title)}</h1>"]

    def heading(self, text: str) -> None:
        self.md += [f"## {text}", ""]
        self.html.append(f"<h2>{html.escape(text)}</h2>")

    def para(self, text: str) -> None:
        self.md += [text, ""]
        self.html.append(f"<p>{html.escape(text)}</p>")

    def bullets(self, items: Iterable[str]) -> None:
        items = list(items)
        self.md += [*(f"- {i}" for i in items), ""]
        self.html.append("<ul>" + "".join(f"<li>{html.escape(i)}</li>" for i in items) + "</ul>")

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        def md_row(cells: list[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

        self.md += [md_row(header), md_row(["---"] * len(header)), *map(md_row, rows), ""]
        head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        self.html.append(f"<table><tr>{head}</tr>{body}</table>")

    def image(self, alt: str, src: str) -> None:
        self.md += [f"![{alt}]({src})", ""]
        self.html.append(f'<p><img src="{html.escape(src)}" alt="{html.escape(alt)}"></p>')

    def markdown(self) -> str:
        return "\n".join(self.md).rstrip() + "\n"

    def to_html(self) -> str:
        return (
            f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(self.title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(self.html) + "\n</body></html>\n"
        )


def plan_text(p: Record) -> str:
    ckpt = {True: "on", False: "off"}.get(p.get("checkpointing"), "?")
    return (
        f"tier {p.get('tier')}, micro-batch {p.get('micro_batch')} x {p.get('grad_accum')} accumulation x "
        f"{p.get('world_size')} ranks = global batch {p.get('global_batch')}, {p.get('precision', '?')}, "
        f"activation checkpointing {ckpt}"
    )


def summary_rows(run: Run) -> list[list[str]]:
    last = run.train[-1] if run.train else {}
    plan = run.last_plan or last
    rows = [["Plan (latest start)", plan_text(plan) if plan else "no plan record"]]
    if last and (last.get("micro_batch"), last.get("grad_accum")) != (plan.get("micro_batch"), plan.get("grad_accum")):
        rows.append(["Micro-batch now", f"{last.get('micro_batch')} x {last.get('grad_accum')} (after OOM shrinks)"])
    total = plan.get("total_steps", last.get("total_steps"))
    done = last.get("step", plan.get("step", 0))
    state = "finished" if done == total else "all tiers ran out of memory" if run.exhausted else "not finished"
    rows.append(["Steps (last logged / total)", f"{done} / {total} ({state})"])
    if _is_number(last.get("loss")):
        rows.append(["Final train loss", f"{last['loss']:.4f} (step {last['step']})"])
    if _is_number(last.get("rewards/accuracies")):  # a preference objective (DPO, SimPO, ORPO): TRL's names
        rows.append(["Preference (last step)", f"rewards/accuracies {last['rewards/accuracies']:.3f}, "
                     f"rewards/margins {last.get('rewards/margins', float('nan')):.4f} (step {last['step']})"])
    if _is_number(last.get("reward")):  # GRPO: TRL's names
        each = ", ".join(f"{k[len('rewards/'):-len('/mean')]} {v:.3f}" for k, v in last.items()
                         if k.startswith("rewards/") and k.endswith("/mean") and _is_number(v))  # fmt: skip
        rows.append(["Reward (last step)", f"{last['reward']:.3f} (std {last.get('reward_std', float('nan')):.3f})"
                     f"{f'; {each}' if each else ''}; completions {last.get('completions/mean_length', 0):.0f} tokens, "
                     f"{last.get('completions/clipped_ratio', 0):.0%} cut at the limit (step {last['step']})"])
    if _is_number(last.get("router_aux_loss")):
        rows.append(["Router load-balancing loss (last step)", f"{last['router_aux_loss']:.4f}"])
    rows.append(["Eval loss", _eval_text(run)])
    rows.append(["Median throughput", _throughput_text(run)])
    rows.append(["Peak memory", _memory_text(run)])
    rows.append(["OOM shrinks (in process)", str(run.shrink_count)])
    rows.append(["Tier changes", str(run.change_count)])
    wall = run.last_time - run.first_time if run.first_time is not None and run.last_time is not None else None
    rows.append(["Wall time (first to last record)", _duration(wall) if wall is not None else "unknown"])
    return rows


def _eval_text(run: Run) -> str:
    bests = [b.best for b in run.eval_series.buckets if b.best is not None]
    if not bests:
        return "no eval records"
    best = min(reversed(bests), key=lambda r: r["eval_loss"])  # the later of equals, as a bucket keeps it
    final = next((r for r in reversed(run.evals) if "eval_loss" in r), bests[-1])
    return f"best {best['eval_loss']:.4f} (step {best['step']}), final {final['eval_loss']:.4f} (step {final['step']})"


def _throughput_text(run: Run) -> str:
    series = run.train_series
    values = [v for _, v in series.points("tokens_per_s")]
    if not values:
        return "unknown"
    count = sum(b.counts.get("tokens_per_s", 0) for b in series.buckets)
    sampled = f", from the means of {len(values):,} runs of up to {series.stride} steps" if series.stride > 1 else ""
    return (
        f"{statistics.median(values):,.0f} {TOKENS_LABEL}; median of {count:,} log intervals{sampled} "
        "(wall time, evals and checkpoints included)"
    )


def _memory_text(run: Run) -> str:
    used = [b.peak for b in run.train_series.buckets if b.peak is not None]
    if not used:
        return "unknown"
    peak = max(used, key=lambda r: r[PEAK])
    total = peak.get("mem_total_bytes")
    of = f" of {total / GiB:.1f} GiB ({peak['mem_used_bytes'] / total:.0%})" if _is_number(total) and total else ""
    return f"{peak['mem_used_bytes'] / GiB:.2f} GiB{of} at step {peak['step']} (GPU allocator peak; process RSS on CPU)"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{seconds:.1f} s"


def history_rows(run: Run) -> list[list[str]]:
    rows, previous = [], None
    for p in run.plans:
        tier = str(p.get("tier"))
        if previous is None:
            event, why = "resume" if p.get("resumed") else "start", ""
        elif tier != previous:
            event = f"tier change {previous} -> {tier}"
            why = run.tier_failures.get(previous, f"not in {TIER_STATE_FILE} (the spec may have changed)")
        else:
            event, why = "resume" if p.get("resumed") else "restart", ""
        mbs = f"{p.get('micro_batch')} x {p.get('grad_accum')} x {p.get('world_size')}"
        rows.append([str(p.get("step")), event, tier, mbs, why])
        previous = tier
    return rows[:MAX_HISTORY_ROWS]


def shrink_rows(run: Run) -> list[list[str]]:
    return [
        [str(e.get("step")), str(e.get("tier")), f"{e.get('from_micro_batch')} -> {e.get('to_micro_batch')}",
         f"{e.get('from_grad_accum')} -> {e.get('to_grad_accum')}", str(e.get("reason", ""))]
        for e in run.shrinks[:MAX_SHRINK_ROWS]
    ]  # fmt: skip


def benchmark_rows(run: Run) -> list[list[str]]:
    """One row a task and metric (`eval/<task>/<metric>`), its stderr beside it, from the task's latest record."""
    rows = []
    for task, rec in run.benchmarks.items():
        prefix, values = f"eval/{task}/", rec["metrics"]
        for name, value in values.items():
            metric = name.removeprefix(prefix)
            if "_stderr" in metric:
                continue
            err = values.get(f"{name}_stderr")
            rows.append([task, metric, f"{value:.4f}", f"{err:.4f}" if _is_number(err) else "",
                         str(rec.get("step", "")), str(rec.get("samples", ""))])  # fmt: skip
    return rows


def build_page(run: Run, plots: list[Chart], notes: list[str]) -> Page:
    page = Page(f"Run report: {run.path.resolve().name}")
    skipped = f"; {lines(run.skipped.count)} ignored (see Notes)" if run.skipped.count else ""
    page.para(f"From {run.path / METRICS_FILE}: {run.train_series.count:,} train, {run.eval_series.count:,} eval "
              f"records{skipped}.")  # fmt: skip
    page.table(["Summary", ""], summary_rows(run))
    page.heading("Tier history")
    page.table(["step", "event", "tier", "micro-batch x accumulation x ranks", "why"], history_rows(run))
    if run.plan_count > MAX_HISTORY_ROWS:
        page.para(f"... and {run.plan_count - MAX_HISTORY_ROWS:,} more starts (see {METRICS_FILE}).")
    if run.exhausted:
        page.para(f"{TIER_STATE_FILE}: the last tier ran out of memory too; the ladder has nothing left to try.")
    if run.shrinks:
        page.heading("OOM shrinks")
        page.table(["step", "tier", "micro-batch", "accumulation", "reason"], shrink_rows(run))
        if run.shrink_count > MAX_SHRINK_ROWS:
            page.para(f"... and {run.shrink_count - MAX_SHRINK_ROWS:,} more (see {METRICS_FILE}).")
    if run.benchmarks:
        page.heading("Benchmarks (lm-evaluation-harness)")
        page.table(["task", "metric", "value", "stderr", "step", "samples"], benchmark_rows(run))
    if plots:
        page.heading("Plots")
        for chart in plots:
            page.image(chart.title, chart.file)
    if notes:
        page.heading("Notes")
        page.bullets(notes)
    return page


# --- entry point ------------------------------------------------------------------------------------


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Report:
    """Write report.md, report.html and the PNG plots into `out` (default `<run_dir>/report`)."""
    run = load_run(run_dir)
    chosen = out is not None  # --out is the user's choice (a link there is theirs); RUN/report is in a shared place
    out_dir = Path(out) if chosen else Path(run_dir) / "report"
    try:
        shared_dir.directory(out_dir, follow=chosen)
    except OSError as err:  # shared_dir.Unsafe among them: a link or a file planted at RUN/report
        detail = err.detail if isinstance(err, shared_dir.Unsafe) else (err.strerror or str(err))
        raise ConfigError(f"{out_dir}: {detail}: the report is not written through it; remove it, or give --out "
                          "DIR") from None  # fmt: skip
    notes = run.skipped.notes(METRICS_FILE)
    mpl = _load_matplotlib()
    drawn: list[Chart] = []
    if mpl is None:
        notes.append(f"no plots: matplotlib is not installed ({INSTALL_HINT})")
    else:
        marks = markers(run)
        if max(run.shrink_count, run.change_count) > MAX_MARKERS:
            notes.append(f"the plots mark the first {MAX_MARKERS} OOM shrinks and tier changes of each kind")
        for chart in charts(run):
            if not chart.series[0].points:
                notes.append(f"{chart.file} skipped: {chart.field} is null in every record")
                continue
            draw(chart, marks, out_dir / chart.file, mpl, follow_dir=chosen)
            drawn.append(chart)
    page = build_page(run, drawn, notes)
    md, page_html = out_dir / "report.md", out_dir / "report.html"
    shared_dir.write_atomic(md, page.markdown().encode("utf-8"), fsync=False, follow_dir=chosen)
    shared_dir.write_atomic(page_html, page.to_html().encode("utf-8"), fsync=False, follow_dir=chosen)
    return Report([md, page_html, *(out_dir / c.file for c in drawn)], notes, plots_missing=mpl is None)
