"""The report's figures (matplotlib, written as PNG): throughput, memory per device, simulated timeline, search history."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from hetsim.model.simulator import TaskKind  # noqa: E402
from hetsim.reporting.rows import ReportData, Row  # noqa: E402

MIB = 2**20
MEMORY_CATEGORIES = [("params_bytes", "params", "#4c72b0"), ("grads_bytes", "grads", "#55a868"),
                     ("optim_bytes", "optimizer", "#c44e52"), ("activations_bytes", "activations", "#8172b2"),
                     ("other_bytes", "other", "#999999")]
KIND_COLORS = {TaskKind.FORWARD: "tab:blue", TaskKind.BACKWARD: "tab:orange", TaskKind.WEIGHT_GRAD: "tab:olive",
               TaskKind.OPTIMIZER: "tab:green", TaskKind.ALLREDUCE: "tab:red", TaskKind.ALLGATHER: "tab:pink",
               TaskKind.REDUCESCATTER: "tab:brown", TaskKind.SYNC: "tab:gray", TaskKind.P2P: "tab:purple",
               TaskKind.COMM_CPU: "tab:cyan"}


def write_figures(data: ReportData, out: Path) -> dict[str, Path]:
    """Every figure the data allows, by name ('throughput', 'memory', 'timeline', 'history')."""
    figs = {"throughput": _throughput(data, out / "predicted_vs_measured.png")}
    if any(r.predicted.memory for r in data.rows()):
        figs["memory"] = _memory(data, out / "memory.png")
    if data.timeline:
        figs["timeline"] = _timeline(data, out / "timeline.png")
    if data.history:
        figs["history"] = _history(data, out / "history.png")
    return figs


def _save(fig, path: Path, dpi: int = 100) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _throughput(data: ReportData, path: Path) -> Path:
    """Predicted against measured samples/s of every plan that ran, with the y = x line."""
    ok = [r for r in data.rows() if r.measured is not None and r.measured.status == "ok"]
    fig, ax = plt.subplots(figsize=(5, 5))
    if ok:
        xs = [r.measured.samples_per_s for r in ok]
        ys = [r.predicted.samples_per_s for r in ok]
        for r, x, y in zip(ok, xs, ys):
            ax.scatter([x], [y], color="tab:red" if r is data.baseline else "tab:blue")
            ax.annotate(data.tag(r), (x, y), textcoords="offset points", xytext=(4, 4))
        lo, hi = 0.0, max(xs + ys) * 1.15
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.legend()
    ax.set_xlabel("measured samples/s")
    ax.set_ylabel("predicted samples/s")
    ax.set_title("Predicted vs measured throughput" + (" (EMULATED)" if data.cluster.emulated else ""))
    return _save(fig, path, dpi=110)


def _memory_bars(ax, row: Row, i: int) -> None:
    """Device i of the row: predicted (left, solid) and measured (right, faded) stacked categories."""
    measured = row.measured.memory if row.measured and row.measured.memory else None
    for col, (series, xoff) in enumerate(((row.predicted.memory, -0.2), (measured, 0.2))):
        if series is None:
            continue
        bottom = 0.0
        for attr, name, color in MEMORY_CATEGORIES:
            v = getattr(series[i], attr) / MIB
            ax.bar(i + xoff, v, 0.38, bottom=bottom, color=color, alpha=1.0 if col == 0 else 0.6,
                   label=name if (i == 0 and col == 0) else None, edgecolor="k", lw=0.3)
            bottom += v
    cap = row.predicted.capacity_bytes[i] / MIB
    ax.hlines(cap, i - 0.45, i + 0.45, colors="k", linestyles="--")


def _memory(data: ReportData, path: Path) -> Path:
    """Memory per device of the first four plans: stacked predicted beside measured, capacity line."""
    rows = [r for r in data.rows() if r.predicted.memory][:4]
    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 4), squeeze=False)
    for ax, r in zip(axes[0], rows):
        devs = list(getattr(r.plan, "devices", range(len(r.predicted.memory))))
        for i in range(len(devs)):
            _memory_bars(ax, r, i)
        ax.set_xticks(range(len(devs)), [f"dev{d}\npred | meas" for d in devs])
        ax.set_ylabel("MiB")
        ax.set_title(("base" if r is data.baseline else f"#{r.place}") + " memory vs capacity (--)", fontsize=9)
    axes[0][0].legend(fontsize=7)
    return _save(fig, path)


def _timeline(data: ReportData, path: Path) -> Path:
    """The simulated step of the best plan: one bar per task, one lane per resource."""
    resources = sorted({e.resource for e in data.timeline})
    kinds = [k for k in KIND_COLORS if any(e.kind == k for e in data.timeline)]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(resources) + 1.2))
    for e in data.timeline:
        ax.barh(resources.index(e.resource), (e.end_s - e.start_s) * 1e3, left=e.start_s * 1e3,
                color=KIND_COLORS.get(e.kind, "grey"), edgecolor="k", lw=0.2)
    ax.set_yticks(range(len(resources)), resources)
    ax.set_xlabel("ms (simulated)")
    ax.set_title(f"Simulated timeline: {data.timeline_label}", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS[k]) for k in kinds]
    ax.legend(handles, kinds, fontsize=7, ncol=4, loc="upper right")
    return _save(fig, path)


def _history(data: ReportData, path: Path) -> Path:
    """Predicted throughput of every feasible trial, and the best so far."""
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
    return _save(fig, path)
