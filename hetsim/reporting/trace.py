"""The simulated timeline as a Chrome trace (open it in Perfetto or chrome://tracing)."""

from __future__ import annotations

import json
from pathlib import Path

from hetsim.types import TimelineEvent


def write_chrome_trace(events: list[TimelineEvent], path: Path) -> None:
    """One complete event per task, one thread per resource, times in microseconds."""
    resources = sorted({e.resource for e in events})
    trace = [{"name": e.label, "cat": e.kind, "ph": "X", "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
              "pid": 0, "tid": resources.index(e.resource)} for e in events]
    trace += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": r}} for i, r in enumerate(resources)]
    path.write_text(json.dumps({"traceEvents": trace}))
