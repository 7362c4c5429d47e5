"""Reports: summary.json, trials.csv, runs.csv, report.md, a self-contained report.html, figures and a Chrome trace.

`write` is the entry; the parts live beside it: rows.py (what a report holds), metrics.py
(accuracy arithmetic), figures.py (matplotlib), render.py (the pandas table, Markdown and the
autoescaping HTML template), trace.py (the simulated timeline for Perfetto).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from hetsim.reporting import measured
from hetsim.reporting.decision import outside
from hetsim.reporting.figures import write_figures
from hetsim.reporting.metrics import accuracy, err_pct, host_speed, oom_detail, oom_text
from hetsim.reporting.render import (
    HEADER,
    HOST_SPEED_NOTE,
    accuracy_line,
    header,
    html,
    markdown,
    oom_lines,
    table_rows,
)
from hetsim.reporting.rows import ReportData, Row
from hetsim.reporting.trace import write_chrome_trace
from hetsim.serial import to_dict
from hetsim.types import Measurement, Prediction

__all__ = [
    "HEADER",
    "HOST_SPEED_NOTE",
    "ReportData",
    "Row",
    "accuracy_line",
    "err_pct",
    "folder_name",
    "header",
    "host_speed",
    "oom_detail",
    "oom_lines",
    "oom_text",
    "summary",
    "table_rows",
    "write",
]


def _pred_json(p: Prediction) -> dict:
    return {"step_time_s": p.step_time_s, "samples_per_s": p.samples_per_s, "peak_mem_bytes": list(p.peak_mem_bytes),
            "feasible": p.feasible, "violations": list(p.violations), "bubble_fraction": p.bubble_fraction,
            "memory": to_dict(p.memory)}


def _meas_json(m: Measurement | None) -> dict:
    if m is None:
        return {"status": "not_run", "step_time_s": None, "samples_per_s": None, "peak_mem_bytes": None, "error": None}
    return {"status": m.status, "step_time_s": m.step_time_s, "samples_per_s": m.samples_per_s,
            "peak_mem_bytes": list(m.peak_mem_bytes) if m.peak_mem_bytes else None, "error": m.error,
            "memory": to_dict(m.memory) if m.memory else None, "probe_s": m.probe_s,
            "steps_per_probe": m.steps_per_probe, "probe_elasticity": m.probe_elasticity,
            "runs_at_probe": list(m.runs_at_probe)}


def summary(data: ReportData) -> dict:
    """summary.json: the run's setting, its accuracy, every candidate and the baseline."""
    c = data.cluster
    return {
        "study": data.study,
        "model": data.model,
        "emulated": bool(c.emulated),
        "calibrated": bool(c.calibrated),
        "cluster": {"spec": c.spec, "source": c.source,
                    "devices": [{"name": d.name, "kind": d.kind, "memory_bytes": d.memory_bytes, "speed": d.speed}
                                for d in c.devices]},
        "global_batch": data.global_batch,
        "tokens_per_sample": data.tokens_per_sample,
        "accuracy": accuracy(data.rows()),
        "candidates": [{"place": r.place, "label": r.label, "plan": to_dict(r.plan), "predicted": _pred_json(r.predicted),
                        "measured": _meas_json(r.measured)} for r in data.candidates],
        "baselines": ({"uniform_ddp": {"label": data.baseline.label, "plan": to_dict(data.baseline.plan),
                                       "predicted": _pred_json(data.baseline.predicted),
                                       "measured": _meas_json(data.baseline.measured)}} if data.baseline else {}),
        "notes": data.notes,
    }


def runs_frame(data: ReportData) -> pd.DataFrame:
    """runs.csv: predicted against measured, one row per plan that was (or was to be) run."""
    runs = []
    for r in data.rows():
        m = r.measured
        runs.append({"place": data.tag(r), "plan": r.label,
                     "pred_step_time_s": r.predicted.step_time_s, "pred_samples_per_s": r.predicted.samples_per_s,
                     "status": m.status if m else "not_run", "meas_step_time_s": m.step_time_s if m else None,
                     "meas_step_time_at_profile_speed_s": m.step_time_at(r.ref_probe_s) if m else None,
                     "host_speed": host_speed(r), "outside_interval": outside(r),
                     "meas_samples_per_s": m.samples_per_s if m else None,
                     **({"pred_tokens_per_s": r.predicted.samples_per_s * data.tokens_per_sample,
                         "meas_tokens_per_s": m.samples_per_s * data.tokens_per_sample if m and m.samples_per_s else None}
                        if data.tokens_per_sample else {}),
                     "pred_peak_mem_bytes": list(r.predicted.peak_mem_bytes),
                     "meas_peak_mem_bytes": list(m.peak_mem_bytes) if m and m.peak_mem_bytes else None})
    return pd.DataFrame(runs)


def folder_name(study: str) -> str:
    """The study's folder under reports/: the name itself, unless it could leave that folder."""
    name = "".join("_" if c in "/\\" or ord(c) < 32 or ord(c) == 127 else c for c in study)
    return "_" if name in ("", ".", "..") else name


def write(data: ReportData, out_root: Path) -> Path:
    """Write every file of the report under out_root/reports/<study>/; returns that folder."""
    out = out_root / "reports" / folder_name(data.study)
    out.mkdir(parents=True, exist_ok=True)
    s = summary(data)
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    pd.DataFrame(data.trials).to_csv(out / "trials.csv", index=False)
    runs_frame(data).to_csv(out / "runs.csv", index=False)
    if data.timeline:
        write_chrome_trace(data.timeline, out / "timeline.trace.json")
    figs = write_figures(data, out)
    figs.update(measured.write(data.rows(), out, data.timeline_label))  # measured_timeline.png + .trace.json
    (out / "report.md").write_text(markdown(data, s, figs))
    (out / "report.html").write_text(html(data, s, figs))
    return out
