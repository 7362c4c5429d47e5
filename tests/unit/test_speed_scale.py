"""A slowed emulated device's realised speed: one real single-device step at its own speed, solved for the
multiplier on its compute, which every plan on that device then carries.  Nothing runs: `measure` is
replaced by the step a run would report."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from hetsim.search import calibrate, realruns
from hetsim.strategies.ddp import DDP, DDPPlan

from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.obtain import ProfileRequest
from hetsim.profiling.store import ModelProfile, ProfileSet, group_key, load, model_profile_path
from hetsim.testing import synthetic_comm
from hetsim.types import Fit, Measurement

REALISED = 1.08
"""How much slower than 1/speed the fake slowed device computes."""


def _cost(prof: ModelProfile, dev, spec: str = "emu:1.0@4G,0.5@4G") -> CostModel:
    ps = ProfileSet(models={"emu-cpu": prof}, devices={"emu-cpu": dev}, comm={2: synthetic_comm(2)})
    return CostModel(parse_cluster(spec), ps, "adamw")


def _fake_measure(prof, dev, calls: list):
    """A real run: the simulated step with the slowed device's compute REALISED times slower."""
    def measure(plan, cluster, **k):
        calls.append((plan, cluster.devices[0].speed))
        keys = {group_key([d]): REALISED for d in cluster.devices if d.speed < 1}
        cost = CostModel(cluster, ProfileSet(models={"emu-cpu": replace(prof, speed_scale=keys)},
                                             devices={"emu-cpu": dev}), "adamw")
        return Measurement(status="ok", step_time_s=DDP().predict(plan, cost)[0].step_time_s)

    return measure


@pytest.fixture
def profile(gn_profile):
    _, prof, dev = gn_profile
    return replace(prof, calib_residual_s=Fit(intercept=0.01, slope=0.0005), speed_scale={}), dev


def test_calibrated_speed_recovers_the_realised_slowdown(profile, tmp_path, monkeypatch):
    prof, dev = profile
    calls: list = []
    monkeypatch.setattr(realruns, "measure", _fake_measure(prof, dev, calls))
    cost = _cost(prof, dev)
    req = ProfileRequest(root=tmp_path, global_batch=64, precisions=("fp32",), repeats=1)
    wl = SimpleNamespace(spec="stand-in@32", optimizer="adamw", has_batchnorm=False, batch_coupled=False)
    after = calibrate.calibrate_devices(cost.cluster, wl, cost.profiles, req, lambda m: None)
    assert [speed for _, speed in calls] == [0.5]  # one run, on the slowed device at its own speed
    got = after.models["emu-cpu"]
    assert got.speed_scale == {"emu-cpux0.5": pytest.approx(REALISED)}
    assert load(ModelProfile, model_profile_path(tmp_path, "emu-cpu", wl.spec)).speed_scale == got.speed_scale

    # Its plans now predict what the device does; the full-speed device's are unchanged.
    fixed = _cost(got, dev)
    for devices in ((1,), (0,)):
        plan = DDPPlan(devices=devices, local_batch=(16,))
        real = _fake_measure(prof, dev, [])(plan, fixed.cluster).step_time_s
        before, now = DDP().predict(plan, cost)[0].step_time_s, DDP().predict(plan, fixed)[0].step_time_s
        if devices == (1,):
            assert before < real and now == pytest.approx(real, rel=1e-9)
        else:
            assert before == now
    # Every family reads the device's block times, which carry it.
    assert fixed.fwd_s(1, 0, 1, 8, "fp32") == pytest.approx(REALISED * cost.fwd_s(1, 0, 1, 8, "fp32"))

    calls.clear()
    calibrate.calibrate_devices(cost.cluster, wl, after, req, lambda m: None)
    assert not calls  # recorded: never measured again


def test_a_failed_speed_run_is_remembered_and_changes_nothing(profile, tmp_path, monkeypatch):
    prof, dev = profile
    calls: list = []
    monkeypatch.setattr(realruns, "measure", lambda *a, **k: calls.append(1) or Measurement(status="timeout"))
    cost = _cost(prof, dev)
    req = ProfileRequest(root=tmp_path, global_batch=64, precisions=("fp32",), repeats=1)
    wl = SimpleNamespace(spec="stand-in@32", optimizer="adamw", has_batchnorm=False, batch_coupled=False)
    failed = calibrate.calibrate_devices(cost.cluster, wl, cost.profiles, req, lambda m: None)
    calibrate.calibrate_devices(cost.cluster, wl, failed, req, lambda m: None)
    assert len(calls) == 1 + realruns.HUNG_RETRIES  # a timed-out run runs once more, then is remembered
    got = failed.models["emu-cpu"]
    assert got.speed_scale == {} and f"{calibrate.SPEED}:emu-cpux0.5" in got.calib_failed
    assert _cost(got, dev).fwd_s(1, 0, 1, 8, "fp32") == cost.fwd_s(1, 0, 1, 8, "fp32")


def test_full_speed_clusters_have_nothing_to_calibrate(profile, tmp_path, monkeypatch):
    prof, dev = profile
    calls: list = []
    monkeypatch.setattr(realruns, "measure", _fake_measure(prof, dev, calls))
    cost = _cost(prof, dev, "emu:1.0@4G,1.0@4G")
    req = ProfileRequest(root=tmp_path, global_batch=64, precisions=("fp32",), repeats=1)
    wl = SimpleNamespace(spec="stand-in@32", optimizer="adamw", has_batchnorm=False, batch_coupled=False)
    calibrate.calibrate_devices(cost.cluster, wl, cost.profiles, req, lambda m: None)
    assert not calls
