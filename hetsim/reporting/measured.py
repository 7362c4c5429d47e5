"""The measured timeline of a real run: each rank's timed steps as a Chrome trace (Perfetto) and a
figure, beside the simulated timeline of the report."""

from __future__ import annotations

import json
from pathlib import Path

from hetsim.types import Measurement

TRACE_NAME = "measured_timeline.trace.json"
FIGURE_NAME = "measured_timeline.png"


def has_timeline(m: Measurement | None) -> bool:
    return m is not None and m.status == "ok" and bool(m.step_starts_s) and len(m.step_starts_s) == len(m.step_durations_s)


def best_measured(rows: list, prefer_label: str = "") -> tuple[str, Measurement] | None:
    """(label, measurement) to draw: the plan labelled `prefer_label` (the simulated timeline's) when
    its run recorded a timeline, else the executed plan with the best throughput at the profiles'
    host speed (as best_plan.json is chosen); None when no run recorded one.  `rows` are report rows
    (`label`, `measured`, `plan`, `ref_probe_s`)."""
    timed = [r for r in rows if has_timeline(r.measured)]
    if not timed:
        return None
    preferred = [r for r in timed if prefer_label and r.label == prefer_label]
    best = preferred[0] if preferred else min(
        timed, key=lambda r: (r.measured.step_time_at(r.ref_probe_s) or float("inf")) / r.plan.global_batch)
    return best.label, best.measured


def chrome_trace(m: Measurement, label: str) -> dict:
    """One thread per rank, one complete event per timed step, times in microseconds."""
    events = [{"name": f"step {i}", "cat": "step", "ph": "X", "ts": start * 1e6, "dur": dur * 1e6, "pid": 0, "tid": rank}
              for rank, (starts, durs) in enumerate(zip(m.step_starts_s, m.step_durations_s))
              for i, (start, dur) in enumerate(zip(starts, durs))]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
               for rank in range(len(m.step_starts_s))]
    events.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"measured: {label}"}})
    return {"traceEvents": events}


def draw(m: Measurement, label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(m.step_starts_s)
    fig, ax = plt.subplots(figsize=(9, 0.6 * n + 1.2))
    for rank, (starts, durs) in enumerate(zip(m.step_starts_s, m.step_durations_s)):
        for i, (start, dur) in enumerate(zip(starts, durs)):
            ax.barh(rank, dur * 1e3, left=start * 1e3, color="tab:blue" if i % 2 == 0 else "tab:cyan",
                    edgecolor="k", lw=0.3)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.invert_yaxis()
    gaps = "; gaps: the untimed host-speed probe" if m.probe_s is not None else ""
    ax.set_xlabel(f"ms (measured, from the first timed step{gaps})")
    ax.set_title(f"Measured timeline (timed steps): {label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(rows: list, out: Path, prefer_label: str = "") -> dict[str, Path]:
    """Write the trace and the figure of one executed plan (best_measured) into `out`; the figures
    written (name -> path), empty when no run recorded a timeline."""
    found = best_measured(rows, prefer_label)
    if found is None:
        return {}
    label, m = found
    (out / TRACE_NAME).write_text(json.dumps(chrome_trace(m, label)))
    draw(m, label, out / FIGURE_NAME)
    return {"measured_timeline": out / FIGURE_NAME}
