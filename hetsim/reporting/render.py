"""The report's pages: the plans table as a pandas DataFrame, rendered to Markdown and to HTML through an autoescaping template."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import jinja2
import pandas as pd
from markupsafe import Markup

from hetsim.reporting.decision import decision_text, outside
from hetsim.reporting.metrics import err_pct, host_speed, oom_text, speedup
from hetsim.reporting.rows import ReportData, Row

HEADER = ["#", "plan", "pred samples/s", "meas samples/s", "step err %", "in interval", "host speed", "speedup",
          "pred MiB", "meas MiB"]
TOKEN_HEADER = ["pred tokens/s", "meas tokens/s"]
HOST_SPEED_NOTE = ("host speed: how fast this machine ran during the run relative to when its profiles were "
                   "recorded, from a fixed probe timed before every step (hetsim.profiling.hostspeed); \"step err %\" "
                   "compares the prediction with the measured step at the profiles' host speed, \"meas "
                   "samples/s\" is the raw throughput.")
ERROR_TAIL_CHARS = 1500
_TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                                autoescape=True, keep_trailing_newline=True)


def _fmt(v, spec=".1f", none="-") -> str:
    return none if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _table_row(data: ReportData, r: Row) -> list[str]:
    m = r.measured
    sp = speedup(r, data.baseline)
    hs = host_speed(r)
    return [
        data.tag(r),
        r.label,
        _fmt(r.predicted.samples_per_s),
        _fmt(m.samples_per_s if m else None) if m and m.status == "ok" else (m.status if m else "not run"),
        *_token_cells(data, r),
        _fmt(err_pct(r), "+.1f"),
        {None: "-", False: "yes", True: "OUT"}[outside(r)],
        _fmt(hs, ".2f") + ("x" if hs else ""),
        _fmt(sp, ".2f") + ("x" if sp else ""),
        " / ".join(f"{b / 2**20:.0f}" for b in r.predicted.peak_mem_bytes),
        " / ".join(f"{b / 2**20:.0f}" for b in m.peak_mem_bytes) if m and m.peak_mem_bytes else "-",
    ]


def header(data: ReportData) -> list[str]:
    """The table's columns: tokens/s beside samples/s for sequence models."""
    return HEADER[:4] + TOKEN_HEADER + HEADER[4:] if data.tokens_per_sample else list(HEADER)


def _token_cells(data: ReportData, r: Row) -> list[str]:
    if not data.tokens_per_sample:
        return []
    m = r.measured
    meas = _fmt(m.samples_per_s * data.tokens_per_sample, ".0f") if m and m.status == "ok" else "-"
    return [_fmt(r.predicted.samples_per_s * data.tokens_per_sample, ".0f"), meas]


def table_rows(data: ReportData) -> list[list[str]]:
    """The plans table as text cells, one list per plan (the CLI prints these)."""
    return [_table_row(data, r) for r in data.rows()]


def table_frame(data: ReportData) -> pd.DataFrame:
    """The plans table as a DataFrame with the columns of `header(data)`."""
    return pd.DataFrame(table_rows(data), columns=header(data))


def banners(data: ReportData) -> list[str]:
    """What every page must say first about where its numbers come from (Markdown emphasis)."""
    c = data.cluster
    lines = []
    if c.emulated:
        lines.append("**EMULATED cluster**: every device is a CPU worker process; its speed is emulated by "
                     "throttling and its memory by accounting against a cap. Figures are not GPU figures.")
    if not c.calibrated:
        lines.append("**UNCALIBRATED**: catalog devices are scaled from public specifications; nothing was measured on them.")
    return lines


def accuracy_line(s: dict) -> str:
    """The report's first sentence: the accuracy of this run (from `summary`)."""
    a = s["accuracy"]
    oom = (f"out-of-memory among {a.get('executed', a['executed_ok'])} executed plans predicted to fit: "
           f"{a['oom_predicted_to_fit']}.")
    if not a.get("executed", 1):
        return f"Accuracy of this run: no plan was executed (predictions only: --no-execute or a catalog cluster); {oom}"
    if not a["executed_ok"]:
        return f"Accuracy of this run: no candidate was executed successfully; {oom}"
    return (f"Accuracy of this run: step-time MAPE {a['step_time_mape'] * 100:.1f}% (max {a['step_time_max_err'] * 100:.1f}%) "
            f"over {a['executed_ok']} executed plans; peak-memory MAPE "
            f"{(a['peak_mem_mape'] or 0) * 100:.1f}%; {decision_text(a)}; {oom}")


def oom_lines(s: dict) -> list[str]:
    """Every out-of-memory among plans predicted to fit, with the plan and the under-predicted bytes."""
    return [oom_text(d) for d in s["accuracy"].get("oom_predicted_to_fit_plans", [])]


def _failures(data: ReportData) -> list[tuple[Row, str]]:
    """(row, error tail) of every plan whose run did not end ok."""
    return [(r, (r.measured.error or "")[-ERROR_TAIL_CHARS:]) for r in data.rows()
            if r.measured is not None and r.measured.status != "ok"]


def markdown(data: ReportData, s: dict, figs: dict[str, Path]) -> str:
    """report.md: accuracy, out-of-memory surprises, provenance, the plans table, failures, notes, figures."""
    lines = [f"# hetsim report: {data.study}", "", accuracy_line(s), ""]
    oom = s["accuracy"].get("oom_predicted_to_fit_plans", [])
    if oom:
        lines += ["**Out of memory although predicted to fit:**", ""]
        lines += [f"- {t}; plan `{json.dumps(d['plan'])}`" for t, d in zip(oom_lines(s), oom)] + [""]
    lines += banners(data) + [""]
    tokens = f" ({data.global_batch * data.tokens_per_sample} tokens)" if data.tokens_per_sample else ""
    lines += [f"- model: `{data.model}`, global batch {data.global_batch}{tokens}", f"- cluster: {data.cluster.describe()}", ""]
    frame = table_frame(data).apply(lambda col: col.str.replace("|", "/", regex=False))
    lines += [frame.to_markdown(index=False, tablefmt="pipe", disable_numparse=True), ""]
    failed = dict((id(r), err) for r, err in _failures(data))
    for r in data.rows():
        if id(r) in failed:
            name = "baseline" if r is data.baseline else f"#{r.place}"
            lines += [f"**{name} {r.measured.status}**:", "```", failed[id(r)], "```"]
        if not r.predicted.feasible:
            lines += ["- predicted infeasible: " + "; ".join(r.predicted.violations)]
    if data.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in data.notes]
    lines += [""] + [f"![{k}]({p.name})" for k, p in figs.items()]
    return "\n".join(lines) + "\n"


def html(data: ReportData, s: dict, figs: dict[str, Path]) -> str:
    """report.html, self-contained (figures inline); every name is escaped by the template."""
    oom = s["accuracy"].get("oom_predicted_to_fit_plans", [])
    return _TEMPLATES.get_template("report.html.j2").render(
        study=data.study, accuracy=accuracy_line(s), model=data.model, global_batch=data.global_batch,
        cluster=data.cluster.describe(), banners=[b.replace("**", "") for b in banners(data)],
        ooms=[(t, json.dumps(d["plan"])) for t, d in zip(oom_lines(s), oom)],
        table=Markup(table_frame(data).to_html(index=False, escape=True, border=0)),  # escaped by pandas
        failures=[(r.label, r.measured.status, err) for r, err in _failures(data)], notes=data.notes,
        figures=[(k, base64.b64encode(p.read_bytes()).decode()) for k, p in figs.items()],
    )
