"""`jobspec report RUN_DIR`: plots and a one-page summary of a run, from its metrics.jsonl. Read in this order:

    metrics.py   the metrics file as untrusted input: a regular file, bounded lines, typed records
    summary.py   bounded summaries of a long run: a series by step in at most MAX_POINTS points, samples
    run.py       a run directory (metrics.jsonl, tier_state.json) -> `Run`, read once, line by line
    page.py      the page (report.md, report.html) and the plots, from a `Run`

Pure Python: no torch, so the report runs wherever the submitter does. The plots need matplotlib
(`pip install 'jobspec-k8s[report]'`); without it the summary is still written and the plots are skipped.
`jobspec plan --from` (jobspec/plan/calibration.py) reads runs through metrics.py and summary.py too.
"""

from jobspec.report.page import INSTALL_HINT, TOKENS_LABEL, Report, write_report
from jobspec.report.run import Run, load_run

__all__ = ["INSTALL_HINT", "TOKENS_LABEL", "Report", "Run", "load_run", "write_report"]
