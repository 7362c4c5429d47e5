"""Each executed plan runs `--repeats` times (more while no two agree); the median run is reported."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hetsim.search import realruns

from hetsim.serial import from_dict, to_dict
from hetsim.types import Measurement


def _opts(repeats: int) -> SimpleNamespace:
    return SimpleNamespace(workload=SimpleNamespace(spec="mlp", optimizer="sgd"), cluster=None, steps=4, warmup=2,
                           timeout_s=60.0, seed=0, out=Path("/nonexistent"), study="s", launch=None, repeats=repeats)


def _run(per_probe: float, raw: float, status: str = "ok") -> Measurement:
    if status != "ok":
        return Measurement(status=status, error="boom")
    return Measurement(status="ok", step_time_s=raw, samples_per_s=32 / raw, probe_s=raw / per_probe,
                       steps_per_probe=per_probe, peak_mem_bytes=(1, 2))


@pytest.mark.parametrize("repeats, seq, runs, median", [
    (1, [(10.0, 1.0)], 1, 10.0),
    (2, [(10.0, 1.0), (10.2, 1.1)], 2, 10.1),             # within the noise floor: two runs, their mean
    (2, [(10.0, 1.0), (13.0, 1.2), (10.4, 1.3)], 3, 10.4),  # they disagree: a third, and the middle run
    (3, [(10.0, 1.0), (13.0, 1.2), (10.4, 1.3)], 3, 10.4),
    (4, [(10.0, 1.0), (13.0, 1.2), (10.4, 1.3), (9.0, 1.4)], 4, 10.2),  # the middle two of four
    # gpt@tiny@64, 2026-12-03: 11.5, 9.9 and 17.8 probe times, then about 10: the middle two of four.
    (2, [(11.5, 1.0), (9.9, 1.2), (17.8, 1.3), (10.1, 1.1)], 4, 10.8),
    (2, [(10.0, 1.0), (13.0, 1.2), (17.0, 1.3), (22.5, 1.4), (30.0, 1.5), (10.1, 1.0)], 5, 17.0),  # at most 3 more
])
def test_the_median_run_is_reported_and_every_run_kept(monkeypatch, repeats, seq, runs, median):
    it = iter(seq)
    dirs = []

    def fake_measure(plan, **k):
        dirs.append(Path(k["out_dir"]).name)
        return _run(*next(it))

    monkeypatch.setattr(realruns, "measure", fake_measure)
    m = realruns.run_plan(SimpleNamespace(plan=object(), place=4), _opts(repeats), fault=None)
    assert dirs == ["run-4", "run-4-2", "run-4-3", "run-4-4", "run-4-5"][:runs]
    assert m.steps_per_probe == pytest.approx(median)
    assert m.step_time_at(0.1) == pytest.approx(median * 0.1)
    if runs > 1:
        assert m.runs_at_probe == tuple(p for p, _ in seq[:runs])
        assert m.samples_per_s == pytest.approx(32 / m.step_time_s)
    # What the study stores comes back whole.
    assert from_dict(Measurement, to_dict(m)) == m


def test_a_failing_run_ends_the_plan_with_its_status(monkeypatch):
    it = iter([(10.0, 1.0), (0, 0, "oom")])
    monkeypatch.setattr(realruns, "measure", lambda plan, **k: _run(*next(it)))
    m = realruns.run_plan(SimpleNamespace(plan=object(), place=1), _opts(2), fault=None)
    assert m.status == "oom"


def test_the_fault_of_a_test_goes_to_the_first_run_only(monkeypatch):
    faults = []
    monkeypatch.setattr(realruns, "measure", lambda plan, **k: faults.append(k["fault"]) or _run(10.0, 1.0))
    realruns.run_plan(SimpleNamespace(plan=object(), place=1), _opts(2), fault="F")
    assert faults == ["F", None]
