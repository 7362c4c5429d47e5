"""The measured timeline: the runner keeps each rank's timed steps (starts on one clock), and the
report writes them as a Chrome trace and a figure beside the simulated timeline."""

from __future__ import annotations

import json

from hetsim.strategies.ddp import DDPPlan

from hetsim.execution.runner import measured_timeline
from hetsim.execution.worker import RankResult
from hetsim.hardware.cluster import Cluster, Device
from hetsim.reporting import measured, report
from hetsim.serial import from_dict, to_dict
from hetsim.types import Measurement, MemoryBreakdown, Prediction

MiB = 2**20


def test_runner_aligns_the_ranks_on_the_earliest_start():
    ranks = [RankResult(rank=0, status="ok", step_s=(0.5, 0.4), step_starts_s=(100.2, 100.7)),
             RankResult(rank=1, status="ok", step_s=(0.6, 0.5), step_starts_s=(100.0, 100.6))]
    got = measured_timeline(ranks)
    assert [[round(t, 9) for t in r] for r in got["step_starts_s"]] == [[0.2, 0.7], [0.0, 0.6]]
    assert got["step_durations_s"] == ((0.5, 0.4), (0.6, 0.5))
    # A rank without starts (an older worker): no timeline rather than a wrong one.
    assert measured_timeline([ranks[0], RankResult(rank=1, status="ok", step_s=(0.6, 0.5))]) == {}


def _row(rank: int, label: str, m: Measurement) -> report.Row:
    pred = Prediction(step_time_s=1.0, samples_per_s=16.0, peak_mem_bytes=(MiB, MiB),
                      memory=(MemoryBreakdown(params_bytes=MiB),) * 2, capacity_bytes=(100 * MiB,) * 2, feasible=True)
    return report.Row(place=rank, label=label, plan=DDPPlan(devices=(0, 1), local_batch=(8, 8)), predicted=pred,
                      measured=m)


def _measured(sps: float, starts, durs) -> Measurement:
    return Measurement(status="ok", step_time_s=16 / sps, samples_per_s=sps, step_starts_s=starts,
                       step_durations_s=durs)


def test_report_writes_the_best_executed_plans_measured_timeline(tmp_path):
    fast = _measured(20.0, ((0.0, 0.8, 1.6), (0.05, 0.8, 1.6)), ((0.75, 0.8, 0.78), (0.7, 0.79, 0.8)))
    slow = _measured(10.0, ((0.0, 1.6), (0.0, 1.6)), ((1.6, 1.6), (1.6, 1.6)))
    assert from_dict(Measurement, json.loads(json.dumps(to_dict(fast)))) == fast  # a study keeps it
    devs = tuple(Device(name=f"emu{i}", kind="emu-cpu", memory_bytes=100 * MiB, index=i) for i in range(2))
    data = report.ReportData(study="s", model="mlp", cluster=Cluster(spec="emu", source="file", devices=devs),
                             global_batch=16, baseline=None, trials=[{"number": 0}],
                             candidates=[_row(1, "slow-plan", slow), _row(2, "fast-plan", fast),
                                         _row(3, "failed", Measurement(status="oom"))])
    folder = report.write(data, tmp_path)
    trace = json.loads((folder / "measured_timeline.trace.json").read_text())["traceEvents"]
    steps = [e for e in trace if e["ph"] == "X"]
    assert len(steps) == 6 and {e["tid"] for e in steps} == {0, 1}
    second = next(e for e in steps if e["tid"] == 1 and e["name"] == "step 0")
    assert second["ts"] == 0.05e6 and second["dur"] == 0.7e6
    assert any(e.get("args", {}).get("name") == "measured: fast-plan" for e in trace)  # the fastest run
    assert (folder / "measured_timeline.png").stat().st_size > 0
    assert "measured_timeline.png" in (folder / "report.md").read_text()
    assert "measured_timeline" in (folder / "report.html").read_text()


def test_the_simulated_plan_is_preferred():
    fast = _measured(20.0, ((0.0,), (0.0,)), ((0.8,), (0.8,)))
    slow = _measured(10.0, ((0.0,), (0.0,)), ((1.6,), (1.6,)))
    rows = [_row(1, "slow-plan", slow), _row(2, "fast-plan", fast)]
    assert measured.best_measured(rows, "slow-plan")[0] == "slow-plan"  # beside its simulated timeline
    assert measured.best_measured(rows, "not-executed")[0] == "fast-plan"
    assert measured.best_measured([_row(1, "x", Measurement(status="ok", samples_per_s=1.0))]) is None


def test_no_timeline_no_file(tmp_path):
    devs = tuple(Device(name=f"emu{i}", kind="emu-cpu", memory_bytes=100 * MiB, index=i) for i in range(2))
    data = report.ReportData(study="s", model="mlp", cluster=Cluster(spec="emu", source="file", devices=devs),
                             global_batch=16, baseline=None, trials=[{"number": 0}],
                             candidates=[_row(1, "p", Measurement(status="ok", step_time_s=1.0, samples_per_s=16.0))])
    folder = report.write(data, tmp_path)
    assert not (folder / "measured_timeline.trace.json").exists()
    assert "measured_timeline" not in (folder / "report.md").read_text()
