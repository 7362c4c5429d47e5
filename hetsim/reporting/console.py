"""The report step: write a study's report folder, then print its table, accuracy and notes."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hetsim.reporting import report
from hetsim.serial import to_dict


def report_step(data: report.ReportData, out: Path, console: Console) -> Path:
    """Write OUT/reports/STUDY/ and print what a person reads first: the top plans against the
    baseline, the accuracy of this run, every out-of-memory that was predicted to fit, the notes,
    the best plan and where the report is.  Returns the report's folder."""
    folder = report.write(data, out)
    console.print(table(data))
    summary = report.summary(data)
    console.print(escape(report.accuracy_line(summary)))
    for line in report.oom_lines(summary):
        console.print(f"[red]out of memory although predicted to fit:[/] {escape(line)}", highlight=False)
    for n in data.notes:
        console.print(f"[yellow]note:[/] {escape(n)}")
    if data.candidates:
        best = data.candidates[0]
        console.print(escape(f"best plan: {best.label}\n  plan JSON: {to_dict(best.plan)}"))
    console.print(escape(f"report: {folder}/report.md (also report.html, summary.json, trials.csv)"), soft_wrap=True)
    return folder


def table(data: report.ReportData) -> Table:
    """The top plans and the baseline as a console table (the report's own table, same columns)."""
    t = Table(title="top plans" + (" (EMULATED cluster)" if data.cluster.emulated else ""))
    for h in report.header(data):
        t.add_column(h)
    for row in report.table_rows(data):
        t.add_row(*(escape(c) for c in row))
    return t
