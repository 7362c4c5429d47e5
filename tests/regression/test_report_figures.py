"""The report built from recorded profiles carries what the issue asks of it.

No training: the plans are simulated from results/profiles/ and their "measurements" are the
predictions shifted by a known error, so the accuracy the report opens with is known too.
"""

from __future__ import annotations

import json
import re

import pytest
from hetsim.search import golden

from hetsim import strategies
from hetsim.reporting import report
from hetsim.types import Measurement

MEASURED_SLOWER = 1.05
"""Each synthetic measurement is 5 % slower than its prediction: step-time MAPE 1/1.05 - 1."""


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from hetsim.strategies.base import SearchContext

    case = golden.CASES[0]
    ctx: SearchContext = golden._context(case, golden.RESULTS)
    rows = []
    for name in ("ddp", "pipeline"):
        if name not in strategies.names():
            continue
        strat = strategies.get(name)
        plan = strat.examples(ctx)[0]
        pred, _, _ = strat.predict(plan, ctx.cost)
        meas = Measurement(status="ok", step_time_s=pred.step_time_s * MEASURED_SLOWER,
                           samples_per_s=pred.samples_per_s / MEASURED_SLOWER, peak_mem_bytes=pred.peak_mem_bytes,
                           memory=pred.memory, rank_median_step_s=(pred.step_time_s * MEASURED_SLOWER,))
        rows.append(report.Row(place=len(rows) + 1, label=strat.label(plan), plan=plan, predicted=pred, measured=meas))
    best = rows[0]
    _, sched, graph = strategies.get(best.plan.strategy).predict(best.plan, ctx.cost)
    data = report.ReportData(
        study="regression-report", model=case.model, cluster=ctx.cost.cluster, global_batch=case.global_batch,
        candidates=rows, baseline=None, trials=[{"number": i, "state": "COMPLETE"} for i in range(3)],
        timeline=sched.timeline(graph), timeline_label=best.label,
        history=[(0, rows[-1].predicted.samples_per_s), (1, best.predicted.samples_per_s), (2, 1.0)])
    folder = report.write(data, tmp_path_factory.mktemp("out"))
    return folder, data


def test_report_has_every_figure(written):
    folder, _ = written
    for name in ("predicted_vs_measured.png", "memory.png", "timeline.png", "history.png"):
        assert (folder / name).stat().st_size > 1000, f"{name} is missing or empty"
    page = (folder / "report.html").read_text()
    embedded = re.findall(r"<img alt='([^']+)' src='data:image/png;base64,", page)
    assert {"throughput", "memory", "timeline", "history"} <= set(embedded), embedded
    assert '"traceEvents"' in (folder / "timeline.trace.json").read_text()  # the timeline for Perfetto
    md = (folder / "report.md").read_text()
    for name in ("predicted_vs_measured.png", "memory.png", "timeline.png", "history.png"):
        assert f"({name})" in md


def test_report_opens_with_the_accuracy_of_the_run(written):
    folder, data = written
    page = (folder / "report.html").read_text()
    first_paragraph = re.search(r"</h1>\s*<p><b>(.*?)</b></p>", page, re.S)
    assert first_paragraph and first_paragraph.group(1).startswith("Accuracy of this run")
    want = abs(1 / MEASURED_SLOWER - 1) * 100
    assert f"step-time MAPE {want:.1f}%" in first_paragraph.group(1)
    assert (folder / "report.md").read_text().splitlines()[2].startswith("Accuracy of this run")
    assert "EMULATED" in page  # the default cluster is emulated: every report says so


def test_summary_accuracy_matches_golden_arithmetic(written):
    folder, data = written
    s = json.loads((folder / "summary.json").read_text())
    recs = [{"status": "ok", "pred_step_time_s": r.predicted.step_time_s, "meas_step_time_s": r.measured.step_time_s,
             "pred_peak_mem_bytes": list(r.predicted.peak_mem_bytes),
             "meas_peak_mem_bytes": list(r.measured.peak_mem_bytes)} for r in data.candidates]
    acc = golden.accuracy_of(recs)
    assert s["accuracy"]["step_time_mape"] == pytest.approx(acc.step_time_mape)
    assert s["accuracy"]["peak_mem_mape"] == pytest.approx(acc.peak_mem_mape)
