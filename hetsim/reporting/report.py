"""Reports: summary.json, trials.csv, report.md, a self-contained report.html and figures."""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from hetsim.reporting import measured
from hetsim.reporting.decision import decision_text, outside, rows_decision
from hetsim.serial import to_dict
from hetsim.types import Measurement, Prediction, TimelineEvent


@dataclass
class Row:
    rank: int
    label: str
    plan: object
    predicted: Prediction
    measured: Measurement | None
    ref_probe_s: float = 0.0
    """The profiles' host-speed probe (hetsim.profiling.hostspeed): a probed run's step is compared with the
    prediction at that host speed.  0: compare raw times (GPUs, unprobed profiles)."""
    timing_spread: float | None = None
    """The profiles' relative timing spread (hetsim.reporting.decision.profile_spread; None: unknown):
    the prediction's interval is derived from it."""


@dataclass
class ReportData:
    study: str
    model: str
    cluster: object  # hetsim.hardware.cluster.Cluster
    global_batch: int
    candidates: list[Row]
    baseline: Row | None
    trials: list[dict]
    timeline: list[TimelineEvent] = field(default_factory=list)
    timeline_label: str = ""
    notes: list[str] = field(default_factory=list)
    history: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_sample: int = 0
    """Tokens in one sample (sequence models): the table also shows tokens/s.  0: not a sequence model."""


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
            "steps_per_probe": m.steps_per_probe}


def err_pct(row: Row) -> float | None:
    m = row.measured
    if m is None or m.status != "ok" or not m.step_time_s:
        return None
    real = m.step_time_at(row.ref_probe_s)
    return 100.0 * (row.predicted.step_time_s - real) / real


def host_speed(row: Row) -> float | None:
    """How fast the host ran during the row's run relative to when its profiles were recorded
    (profile probe / run probe: 0.8 = 20% slower), None when not probed."""
    m = row.measured
    if m is None or not m.probe_s or not row.ref_probe_s:
        return None
    return row.ref_probe_s / m.probe_s


def mem_err_pct(row: Row) -> list[float] | None:
    m = row.measured
    if m is None or m.status != "ok" or not m.peak_mem_bytes:
        return None
    return [100.0 * (p - q) / q for p, q in zip(row.predicted.peak_mem_bytes, m.peak_mem_bytes)]


def oom_detail(row: Row) -> dict:
    """A plan predicted to fit that ran out of memory: where, and by how many bytes the prediction was short.

    The failing rank's measured peak is known when its accounting caught the overflow (emulated
    devices); otherwise (a real CUDA out-of-memory) only a lower bound is: the device's capacity.
    """
    m = row.measured
    p = row.predicted
    rank = m.failed_rank if m is not None and m.failed_rank is not None and m.failed_rank < len(p.peak_mem_bytes) else None
    devices = list(getattr(row.plan, "devices", range(len(p.peak_mem_bytes))))
    out = {"label": row.label, "plan": to_dict(row.plan), "rank": rank,
           "device": devices[rank] if rank is not None and rank < len(devices) else None,
           "predicted_bytes": p.peak_mem_bytes[rank] if rank is not None else None,
           "capacity_bytes": p.capacity_bytes[rank] if rank is not None and rank < len(p.capacity_bytes) else None,
           "measured_bytes": m.failed_peak_bytes if m is not None else None,
           "under_predicted_bytes": None, "at_least": False}
    if rank is not None:
        if out["measured_bytes"] is not None:
            out["under_predicted_bytes"] = out["measured_bytes"] - out["predicted_bytes"]
        elif out["capacity_bytes"] is not None:
            out["under_predicted_bytes"] = out["capacity_bytes"] - out["predicted_bytes"]
            out["at_least"] = True
    return out


def oom_text(d: dict) -> str:
    if d["rank"] is None:
        return f"{d['label']}: out of memory on an unknown rank (see its error below)"
    under = d["under_predicted_bytes"]
    amount = "?" if under is None else f"{'at least ' if d['at_least'] else ''}{under / 2**20:.1f} MiB ({under} bytes)"
    measured = ("unknown (at least the capacity)" if d["measured_bytes"] is None
                else f"{d['measured_bytes'] / 2**20:.1f} MiB")
    return (f"{d['label']}: rank {d['rank']} (device {d['device']}) predicted {d['predicted_bytes'] / 2**20:.1f} MiB "
            f"of {(d['capacity_bytes'] or 0) / 2**20:.1f} MiB, measured {measured}: under-predicted by {amount}")


def accuracy(rows: list[Row]) -> dict:
    errs = [abs(e) for e in (err_pct(r) for r in rows) if e is not None]
    merrs = [abs(x) for r in rows for x in (mem_err_pct(r) or [])]
    executed = [r for r in rows if r.measured is not None]
    oom_fit = [r for r in executed if r.measured.status == "oom" and r.predicted.feasible]
    return {
        "executed": len(executed),
        "executed_ok": len(errs),
        "step_time_mape": sum(errs) / len(errs) / 100 if errs else None,
        "step_time_max_err": max(errs) / 100 if errs else None,
        "peak_mem_mape": sum(merrs) / len(merrs) / 100 if merrs else None,
        "oom_predicted_to_fit": len(oom_fit),
        "oom_predicted_to_fit_plans": [oom_detail(r) for r in oom_fit],
        **rows_decision(rows),
    }


def summary(data: ReportData) -> dict:
    c = data.cluster
    rows = data.candidates + ([data.baseline] if data.baseline else [])
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
        "accuracy": accuracy(rows),
        "candidates": [{"rank": r.rank, "label": r.label, "plan": to_dict(r.plan), "predicted": _pred_json(r.predicted),
                        "measured": _meas_json(r.measured)} for r in data.candidates],
        "baselines": ({"uniform_ddp": {"label": data.baseline.label, "plan": to_dict(data.baseline.plan),
                                       "predicted": _pred_json(data.baseline.predicted),
                                       "measured": _meas_json(data.baseline.measured)}} if data.baseline else {}),
        "notes": data.notes,
    }


def speedup(row: Row, base: Row | None) -> float | None:
    if base is None or base.measured is None or base.measured.status != "ok" or row.measured is None or row.measured.status != "ok":
        return None
    return row.measured.samples_per_s / base.measured.samples_per_s


def _fmt(v, spec=".1f", none="-"):
    return none if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def table_rows(data: ReportData) -> list[list[str]]:
    out = []
    rows = data.candidates + ([data.baseline] if data.baseline else [])
    for r in rows:
        m = r.measured
        sp = speedup(r, data.baseline)
        hs = host_speed(r)
        out.append([
            "base" if r is data.baseline else str(r.rank),
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
        ])
    return out


HEADER = ["#", "plan", "pred samples/s", "meas samples/s", "step err %", "in interval", "host speed", "speedup", "pred MiB", "meas MiB"]
TOKEN_HEADER = ["pred tokens/s", "meas tokens/s"]


def header(data: ReportData) -> list[str]:
    """The table's columns: tokens/s beside samples/s for sequence models."""
    return HEADER[:4] + TOKEN_HEADER + HEADER[4:] if data.tokens_per_sample else list(HEADER)


def _token_cells(data: ReportData, r: Row) -> list[str]:
    if not data.tokens_per_sample:
        return []
    m = r.measured
    meas = _fmt(m.samples_per_s * data.tokens_per_sample, ".0f") if m and m.status == "ok" else "-"
    return [_fmt(r.predicted.samples_per_s * data.tokens_per_sample, ".0f"), meas]
HOST_SPEED_NOTE = ("host speed: how fast this machine ran during the run relative to when its profiles were "
                   "recorded, from a fixed probe timed before every step (hetsim.profiling.hostspeed); \"step err %\" "
                   "compares the prediction with the measured step at the profiles' host speed, \"meas "
                   "samples/s\" is the raw throughput.")


# ----------------------------------------------------------------------------- figures


def _figures(data: ReportData, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: dict[str, Path] = {}
    rows = [r for r in data.candidates + ([data.baseline] if data.baseline else [])]
    ok = [r for r in rows if r.measured is not None and r.measured.status == "ok"]
    # Predicted vs measured throughput.
    fig, ax = plt.subplots(figsize=(5, 5))
    if ok:
        xs = [r.measured.samples_per_s for r in ok]
        ys = [r.predicted.samples_per_s for r in ok]
        for r, x, y in zip(ok, xs, ys):
            ax.scatter([x], [y], color="tab:red" if r is data.baseline else "tab:blue")
            ax.annotate("base" if r is data.baseline else str(r.rank), (x, y), textcoords="offset points", xytext=(4, 4))
        lo, hi = 0.0, max(xs + ys) * 1.15
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.legend()
    ax.set_xlabel("measured samples/s")
    ax.set_ylabel("predicted samples/s")
    ax.set_title("Predicted vs measured throughput" + (" (EMULATED)" if data.cluster.emulated else ""))
    figs["throughput"] = out / "predicted_vs_measured.png"
    fig.tight_layout()
    fig.savefig(figs["throughput"], dpi=110)
    plt.close(fig)

    # Memory per device: stacked predicted beside measured, capacity line.
    mem_rows = [r for r in rows if r.predicted.memory][:4]
    if mem_rows:
        fig, axes = plt.subplots(1, len(mem_rows), figsize=(4 * len(mem_rows), 4), squeeze=False)
        cats = [("params_bytes", "params"), ("grads_bytes", "grads"), ("optim_bytes", "optimizer"),
                ("activations_bytes", "activations"), ("other_bytes", "other")]
        colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#999999"]
        for ax, r in zip(axes[0], mem_rows):
            devs = list(getattr(r.plan, "devices", range(len(r.predicted.memory))))
            for i in range(len(devs)):
                for col, (series, xoff) in enumerate(((r.predicted.memory, -0.2), (r.measured.memory if r.measured and r.measured.memory else None, 0.2))):
                    if series is None:
                        continue
                    bottom = 0.0
                    for (attr, name), color in zip(cats, colors):
                        v = getattr(series[i], attr) / 2**20
                        ax.bar(i + xoff, v, 0.38, bottom=bottom, color=color, alpha=1.0 if col == 0 else 0.6,
                               label=name if (i == 0 and col == 0) else None, edgecolor="k", lw=0.3)
                        bottom += v
                cap = r.predicted.capacity_bytes[i] / 2**20
                ax.hlines(cap, i - 0.45, i + 0.45, colors="k", linestyles="--")
            ax.set_xticks(range(len(devs)), [f"dev{d}\npred | meas" for d in devs])
            ax.set_ylabel("MiB")
            ax.set_title(("base" if r is data.baseline else f"#{r.rank}") + " memory vs capacity (--)", fontsize=9)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        figs["memory"] = out / "memory.png"
        fig.savefig(figs["memory"], dpi=100)
        plt.close(fig)

    if data.timeline:
        resources = sorted({e.resource for e in data.timeline})
        colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:olive", "opt": "tab:green", "allreduce": "tab:red",
                  "send": "tab:purple", "recv": "tab:purple", "recompute": "tab:cyan"}
        fig, ax = plt.subplots(figsize=(9, 0.6 * len(resources) + 1.2))
        for e in data.timeline:
            y = resources.index(e.resource)
            ax.barh(y, (e.end_s - e.start_s) * 1e3, left=e.start_s * 1e3, color=colors.get(e.kind, "grey"), edgecolor="k", lw=0.2)
        ax.set_yticks(range(len(resources)), resources)
        ax.set_xlabel("ms (simulated)")
        ax.set_title(f"Simulated timeline: {data.timeline_label}", fontsize=9)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        ax.legend(handles, list(colors), fontsize=7, ncol=4, loc="upper right")
        fig.tight_layout()
        figs["timeline"] = out / "timeline.png"
        fig.savefig(figs["timeline"], dpi=100)
        plt.close(fig)

    if data.history:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [n for n, _ in data.history]
        ys = [v for _, v in data.history]
        best, cur = [], 0.0
        for v in ys:
            cur = max(cur, v)
            best.append(cur)
        ax.scatter(xs, ys, s=8, alpha=0.5, label="trial (feasible)")
        ax.plot(xs, best, "r-", label="best so far")
        ax.set_xlabel("trial")
        ax.set_ylabel("predicted samples/s")
        ax.set_title("Optimisation history")
        ax.legend()
        fig.tight_layout()
        figs["history"] = out / "history.png"
        fig.savefig(figs["history"], dpi=100)
        plt.close(fig)
    return figs


def write_chrome_trace(events: list[TimelineEvent], path: Path) -> None:
    """The simulated timeline as a Chrome trace (open in Perfetto)."""
    resources = sorted({e.resource for e in events})
    trace = [{"name": e.label, "cat": e.kind, "ph": "X", "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
              "pid": 0, "tid": resources.index(e.resource)} for e in events]
    trace += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": r}} for i, r in enumerate(resources)]
    path.write_text(json.dumps({"traceEvents": trace}))


# ----------------------------------------------------------------------------- writers


def folder_name(study: str) -> str:
    """The study's folder under reports/: the name itself, unless it could leave that folder."""
    name = "".join("_" if c in "/\\" or ord(c) < 32 or ord(c) == 127 else c for c in study)
    return "_" if name in ("", ".", "..") else name


def write(data: ReportData, out_root: Path) -> Path:
    import pandas as pd

    out = out_root / "reports" / folder_name(data.study)
    out.mkdir(parents=True, exist_ok=True)
    s = summary(data)
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    pd.DataFrame(data.trials).to_csv(out / "trials.csv", index=False)
    runs = []
    for r in data.candidates + ([data.baseline] if data.baseline else []):
        m = r.measured
        runs.append({"rank": "base" if r is data.baseline else r.rank, "plan": r.label,
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
    pd.DataFrame(runs).to_csv(out / "runs.csv", index=False)
    if data.timeline:
        write_chrome_trace(data.timeline, out / "timeline.trace.json")
    figs = _figures(data, out)
    figs.update(measured.write(data.candidates + ([data.baseline] if data.baseline else []), out,
                               data.timeline_label))  # measured_timeline.png + .trace.json
    (out / "report.md").write_text(_markdown(data, s, figs))
    (out / "report.html").write_text(_html(data, s, figs))
    return out


def _banner(data: ReportData) -> list[str]:
    c = data.cluster
    lines = []
    if c.emulated:
        lines.append("**EMULATED cluster**: every device is a CPU worker process; its speed is emulated by "
                     "throttling and its memory by accounting against a cap. Figures are not GPU figures.")
    if not c.calibrated:
        lines.append("**UNCALIBRATED**: catalog devices are scaled from public specifications; nothing was measured on them.")
    return lines


def _accuracy_line(s: dict) -> str:
    a = s["accuracy"]
    oom = (f"out-of-memory among {a.get('executed', a['executed_ok'])} executed plans predicted to fit: "
           f"{a['oom_predicted_to_fit']}.")
    if not a["executed_ok"]:
        return f"Accuracy of this run: no candidate was executed successfully; {oom}"
    return (f"Accuracy of this run: step-time MAPE {a['step_time_mape'] * 100:.1f}% (max {a['step_time_max_err'] * 100:.1f}%) "
            f"over {a['executed_ok']} executed plans; peak-memory MAPE "
            f"{(a['peak_mem_mape'] or 0) * 100:.1f}%; {decision_text(a)}; {oom}")


def _oom_lines(s: dict) -> list[str]:
    """Every out-of-memory among plans predicted to fit, with the plan and the under-predicted bytes."""
    return [oom_text(d) for d in s["accuracy"].get("oom_predicted_to_fit_plans", [])]


def _markdown(data: ReportData, s: dict, figs: dict[str, Path]) -> str:
    lines = [f"# hetsim report: {data.study}", ""]
    lines += [_accuracy_line(s), ""]
    oom = s["accuracy"].get("oom_predicted_to_fit_plans", [])
    if oom:
        lines += ["**Out of memory although predicted to fit:**", ""]
        lines += [f"- {t}; plan `{json.dumps(d['plan'])}`" for t, d in zip(_oom_lines(s), oom)] + [""]
    lines += _banner(data) + [""]
    lines += [f"- model: `{data.model}`, global batch {data.global_batch}"
              + (f" ({data.global_batch * data.tokens_per_sample} tokens)" if data.tokens_per_sample else ""), f"- cluster: {data.cluster.describe()}", ""]
    lines += ["| " + " | ".join(header(data)) + " |", "|" + "---|" * len(header(data))]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in table_rows(data)]
    lines.append("")
    for r in data.candidates + ([data.baseline] if data.baseline else []):
        m = r.measured
        if m is not None and m.status != "ok":
            lines += [f"**{'baseline' if r is data.baseline else '#' + str(r.rank)} {m.status}**:", "```", (m.error or "")[-1500:], "```"]
        if not r.predicted.feasible:
            lines += ["- predicted infeasible: " + "; ".join(r.predicted.violations)]
    if data.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in data.notes]
    lines += [""] + [f"![{k}]({p.name})" for k, p in figs.items()]
    return "\n".join(lines) + "\n"


def _html(data: ReportData, s: dict, figs: dict[str, Path]) -> str:
    e = html.escape
    parts = [f"<!doctype html><meta charset='utf-8'><title>hetsim {e(data.study)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}.warn{background:#fff3cd;padding:6px}</style>",
             f"<h1>hetsim report: {e(data.study)}</h1>", f"<p><b>{e(_accuracy_line(s))}</b></p>"]
    oom = s["accuracy"].get("oom_predicted_to_fit_plans", [])
    if oom:
        parts.append("<p class='warn'><b>Out of memory although predicted to fit:</b></p><ul>" + "".join(
            f"<li>{e(t)}<br><code>{e(json.dumps(d['plan']))}</code></li>" for t, d in zip(_oom_lines(s), oom)) + "</ul>")
    parts += [f"<p class='warn'>{e(b.replace('**', ''))}</p>" for b in _banner(data)]
    parts.append(f"<p>model <code>{e(data.model)}</code>, global batch {data.global_batch}<br>cluster: {e(data.cluster.describe())}</p>")
    parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header(data)) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in table_rows(data)]
    parts.append("</table>")
    for r in data.candidates + ([data.baseline] if data.baseline else []):
        m = r.measured
        if m is not None and m.status != "ok":
            parts.append(f"<p><b>{e(r.label)}: {e(m.status)}</b></p><pre>{e((m.error or '')[-1500:])}</pre>")
    if data.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in data.notes) + "</ul>")
    for k, p in figs.items():
        b64 = base64.b64encode(p.read_bytes()).decode()
        parts.append(f"<h2>{e(k)}</h2><img alt='{e(k)}' src='data:image/png;base64,{b64}'>")
    return "\n".join(parts) + "\n"
