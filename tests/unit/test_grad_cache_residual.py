"""The gradient cache's own calibrated residual: measured on real single-device gradient-cache steps,
charged per chunk pass, stretched with a device's slowdown; plain steps keep theirs.  Nothing runs:
`measure` is replaced by the steps a run would report."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from hetsim.search import calibrate, realruns
from hetsim.strategies.ddp import DDP, DDPPlan
from hetsim.strategies.zero import ZeRO, ZeROPlan

from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.obtain import ProfileRequest
from hetsim.profiling.store import ModelProfile, ProfileSet, load, model_profile_path
from hetsim.testing import synthetic_comm
from hetsim.types import Fit, Measurement

PER_CHUNK = {8: 0.09, 16: 0.12}
"""Seconds a real chunk of this size takes beyond its blocks' isolated timings (both passes)."""


def _workload(coupled: bool = True):
    return SimpleNamespace(spec="stand-in@32", optimizer="adamw", has_batchnorm=False, batch_coupled=coupled,
                           logits_per_sample_sq=4 if coupled else 0)


def _cost(prof: ModelProfile, dev, spec: str = "emu:1.0@4G,0.5@4G") -> CostModel:
    ps = ProfileSet(models={"emu-cpu": prof}, devices={"emu-cpu": dev}, comm={2: synthetic_comm(2)})
    return CostModel(parse_cluster(spec), ps, "adamw", batch_coupled=True, logits_per_sample_sq=4)


def _fake_measure(prof, dev, calls: list):
    """A real run's step: the bare block model's prediction plus PER_CHUNK for every chunk."""
    bare = replace(prof, calib_residual_s=None, grad_cache_residual_s=None)

    def measure(plan, cluster, **k):
        calls.append(plan)
        one = CostModel(cluster, ProfileSet(models={"emu-cpu": bare}, devices={"emu-cpu": dev}), "adamw",
                        batch_coupled=True, logits_per_sample_sq=4)
        pred = DDP().predict(plan, one)[0].step_time_s
        if plan.grad_cache_chunks == 1:  # a plain step (the slowed device's speed): as simulated
            return Measurement(status="ok", step_time_s=pred)
        chunk = plan.local_batch[0] // plan.grad_cache_chunks
        return Measurement(status="ok", step_time_s=pred + plan.grad_cache_chunks * PER_CHUNK[chunk])

    return measure


def test_calibrated_grad_cache_steps_predict_as_measured(gn_profile, monkeypatch):
    """Two real single-device steps of 64 and 128 samples in 8 chunks; their own plans then predict the
    measured step exactly, and a half-speed device pays twice the residual per chunk."""
    _, prof, dev = gn_profile
    calls: list = []
    monkeypatch.setattr(realruns, "measure", _fake_measure(prof, dev, calls))
    one = parse_cluster("emu:1.0@4G").devices[0]
    after = calibrate.calibrate_grad_cache(one, _workload(), prof, dev, [64, 128], lambda m: None, repeats=1)
    assert [(p.local_batch, p.grad_cache_chunks) for p in calls] == [((64,), 8), ((128,), 8)]
    gc = after.grad_cache_residual_s
    assert gc(8) == pytest.approx(PER_CHUNK[8]) and gc(16) == pytest.approx(PER_CHUNK[16])
    assert gc(20) == pytest.approx(0.135)  # a fast device's larger chunks: along the line

    cost = _cost(after, dev, "emu:1.0@4G")
    for plan in calls:
        expect = _fake_measure(prof, dev, [])(plan, cost.cluster).step_time_s
        assert DDP().predict(plan, cost)[0].step_time_s == pytest.approx(expect, rel=1e-9)

    two = _cost(after, dev)
    assert two.overhead_s(1, 8, grad_cache=True) == pytest.approx(2 * two.overhead_s(0, 8, grad_cache=True))
    assert two.overhead_s(0, 8, grad_cache=True) == pytest.approx(PER_CHUNK[8] / 2)


def test_plain_steps_keep_the_plain_residual(gn_profile):
    """A plain micro-step never reads the gradient-cache term; without one a chunk falls back on the
    plain residual (the profiles recorded before it)."""
    _, prof, dev = gn_profile
    plain = replace(prof, calib_residual_s=Fit(intercept=0.05, slope=0.001))
    both = replace(plain, grad_cache_residual_s=Fit(intercept=0.3, slope=0.0, knots=((8.0, 0.3), (32.0, 0.3))))
    a, b = _cost(plain, dev), _cost(both, dev)
    assert a.overhead_s(0, 16) == b.overhead_s(0, 16) == pytest.approx(0.066)
    assert a.overhead_s(0, 16, grad_cache=True) == pytest.approx(0.066)
    assert b.overhead_s(0, 16, grad_cache=True) == pytest.approx(0.15)
    # Every family's gradient-cache step moves by the term: 2 passes x 4 chunks on the slower device.
    for fam, plan in ((DDP(), DDPPlan(devices=(0, 1), local_batch=(48, 32), grad_cache_chunks=4)),
                      (ZeRO(), ZeROPlan(devices=(0, 1), local_batch=(48, 32), zero_stage=3, grad_cache_chunks=4))):
        da, db = fam.predict(plan, a)[0].step_time_s, fam.predict(plan, b)[0].step_time_s
        assert db > da, fam
        flat = fam.predict(replace(plan, grad_cache_chunks=1), a)[0].step_time_s
        assert fam.predict(replace(plan, grad_cache_chunks=1), b)[0].step_time_s == pytest.approx(flat)


@pytest.mark.parametrize("coupled", [True, False])
def test_devices_calibrate_the_grad_cache_once_for_coupled_losses(gn_profile, tmp_path, monkeypatch, coupled):
    """A batch-coupled workload gets the term beside the plain residual, recorded: a second search runs
    nothing; a per-sample workload never gets one.  A failed run is remembered."""
    _, prof, dev = gn_profile
    prof = replace(prof, calib_residual_s=Fit(intercept=0.0, slope=0.0))
    calls: list = []
    monkeypatch.setattr(realruns, "measure", _fake_measure(prof, dev, calls))
    cost = _cost(prof, dev)
    req = ProfileRequest(root=tmp_path, global_batch=256, precisions=("fp32",), repeats=1)
    wl = _workload(coupled)
    profiles = calibrate.calibrate_devices(cost.cluster, wl, cost.profiles, req, lambda m: None)
    got = profiles.models["emu-cpu"].grad_cache_residual_s
    cached = [p for p in calls if p.grad_cache_chunks > 1]
    assert (got is not None) == coupled and len(cached) == (2 if coupled else 0)
    assert len(calls) - len(cached) == 1  # the 0.5 device's speed, once
    if coupled:
        assert [p.local_batch for p in cached] == [(64,), (128,)]  # half a uniform share and a whole one
        saved = load(ModelProfile, model_profile_path(tmp_path, "emu-cpu", wl.spec))
        assert saved.grad_cache_residual_s == got
    calls.clear()
    calibrate.calibrate_devices(cost.cluster, wl, profiles, req, lambda m: None)
    assert not calls

    monkeypatch.setattr(realruns, "measure", lambda *a, **k: calls.append(1) or Measurement(status="oom"))
    failed = calibrate.calibrate_devices(cost.cluster, wl, cost.profiles, req, lambda m: None)
    again = calibrate.calibrate_devices(cost.cluster, wl, failed, req, lambda m: None)
    assert len(calls) == (2 if coupled else 1)  # each failed run once: the cache's, the slowed device's
    assert (calibrate.GC_RESIDUAL in again.models["emu-cpu"].calib_failed) == coupled
