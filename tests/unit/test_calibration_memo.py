"""A calibration run that runs out of memory is remembered; one that crashes is retried."""

from __future__ import annotations

import pytest
from hetsim.search import calibrate

from hetsim.types import Measurement


@pytest.mark.parametrize("status, runs", [("oom", 1), ("error", 2)])
def test_failed_uniform_calibration(make_cost, gn_profile, tmp_path, monkeypatch, status, runs):
    wl = gn_profile[0]
    cost = make_cost("emu:1.0@4G,0.5@4G")
    calls = []
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: calls.append(1) or Measurement(status=status))
    said: list[str] = []
    profiles = calibrate.calibrate_sync(cost.cluster, wl, cost.profiles, tmp_path, said.append)
    profiles = calibrate.calibrate_sync(cost.cluster, wl, profiles, tmp_path, said.append)
    assert len(calls) == runs
    assert not any(m.sync_residual_s for m in profiles.models.values())
    if status == "oom":
        assert "not repeated" in said[-1] and "--reprofile" in said[-1]
