"""A low precision's data-parallel terms: calibrated by runs in that precision, read by its own plans, fp32's
read where it has none.  Nothing runs: `measure` is replaced by the step a run would report."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hetsim.search import calib_dataparallel, calibrate, realruns
from hetsim.strategies.ddp import DDP, DDPPlan
from hetsim.strategies.zero import ZeRO, ZeROPlan

from hetsim.model.costmodel import CostModel
from hetsim.profiling.obtain import ProfileRequest
from hetsim.profiling.store import group_key
from hetsim.types import Measurement


def _with_terms(cost: CostModel, **terms) -> CostModel:
    """`cost` with these `sync_residual_s` entries (by key) in every model profile."""
    models = {k: replace(m, sync_residual_s={**m.sync_residual_s, **terms}) for k, m in cost.profiles.models.items()}
    return CostModel(cost.cluster, replace(cost.profiles, models=models), cost.optimizer)


def test_a_low_precision_reads_its_own_term_else_fp32s(make_cost):
    base = make_cost("emu:1.0@4G,0.5@4G")
    key = group_key(base.cluster.devices)
    both = _with_terms(base, **{key: 0.05, f"{key}@bf16": 0.02})
    assert both.sync_residual_s((0, 1)) == pytest.approx(0.05)
    assert both.sync_residual_s((0, 1), precision="bf16") == pytest.approx(0.02)
    fp32_only = _with_terms(base, **{key: 0.05})
    assert fp32_only.sync_residual_s((0, 1), precision="bf16") == pytest.approx(0.05)
    # The plans read it: a bf16 ddp and ZeRO-1 step 30 ms less with the smaller bf16 term.
    for strat, plan in ((DDP(), DDPPlan(devices=(0, 1), local_batch=(8, 8), precision="bf16")),
                        (ZeRO(), ZeROPlan(devices=(0, 1), local_batch=(8, 8), zero_stage=1, precision="bf16"))):
        t_own, t_fp32 = (strat.predict(plan, c)[0].step_time_s for c in (both, fp32_only))
        assert t_fp32 - t_own == pytest.approx(0.03, abs=1e-6), strat.name
        fp32_plan = replace(plan, precision="fp32")
        assert strat.predict(fp32_plan, both)[0].step_time_s == strat.predict(fp32_plan, fp32_only)[0].step_time_s


def test_bf16_terms_are_calibrated_by_bf16_runs_against_a_bare_simulation(make_cost, gn_profile, tmp_path, monkeypatch):
    cost = make_cost("emu:1.0@4G,0.5@4G")
    wl = gn_profile[0]
    ran: list = []

    def measure(plan, **k):
        ran.append(plan)
        return Measurement(status="ok", step_time_s=5.0 if plan.precision == "fp32" else 3.0)

    monkeypatch.setattr(realruns, "measure", measure)
    monkeypatch.setattr(calibrate, "calibrate_devices", lambda c, w, p, r, s: p)
    monkeypatch.setattr(calibrate, "calibrate_pipeline", lambda c, w, p, *a, **k: p)
    monkeypatch.setattr(calibrate, "slowdown", lambda m, prec: 1.0)  # this recording's host had slow bf16
    req = ProfileRequest(root=tmp_path, global_batch=16, precisions=("fp32", "bf16"), strategies=("ddp",), repeats=2)
    profiles = calibrate.calibrate(cost.cluster, wl, cost.profiles, req, say=lambda s: None)
    key = group_key(cost.cluster.devices)
    prof = next(iter(profiles.models.values()))
    assert set(prof.sync_residual_s) == {key, f"{key}@bf16"}
    bf16_runs = [p for p in ran if p.precision == "bf16"]
    uniform = next(p for p in bf16_runs if p.local_batch == (8, 8))
    # The bf16 term is the bf16 run minus the bf16 simulation without any term, not minus fp32's term.
    bare = _with_terms(cost, **{f"{key}@bf16": 0.0})
    assert prof.sync_residual_s[f"{key}@bf16"] == pytest.approx(3.0 - DDP().predict(uniform, bare)[0].step_time_s)
    # The balanced bf16 step is balanced in bf16, and recorded under the bf16 key.
    balanced = next(p for p in bf16_runs if p.local_batch != (8, 8))
    assert f"{key}@bf16" in prof.sync_balanced_s and key in prof.sync_balanced_s
    assert balanced.local_batch[0] > balanced.local_batch[1]
    # Every run was taken ahead, in turn: two rounds of the fp32 and bf16 plans.
    assert len({repr(p) for p in ran}) * 2 == len(ran)
    ran.clear()
    calibrate.calibrate(cost.cluster, wl, profiles, req, say=lambda s: None)
    assert not ran


def test_pending_plans_carry_each_low_precisions_plans(make_cost, gn_profile):
    cost = make_cost("emu:1.0@4G,0.5@4G")
    plans = calib_dataparallel.pending_plans(cost.cluster, gn_profile[0], cost.profiles, 16, zero=False,
                                             precisions=("bf16",))
    assert [p.precision for _, p in plans[:2]] == ["fp32", "fp32"]
    assert plans[2][1] == DDPPlan(devices=(0, 1), local_batch=(8, 8), precision="bf16")
    assert all(p.precision == "bf16" for _, p in plans[2:])
