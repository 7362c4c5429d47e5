"""The whole-cluster data-parallel terms' runs are taken in turn, round by round, before the terms are solved:
each term's runs lie apart in time and every term meets the same phases of the host.  Nothing runs:
`measure` is replaced by the step a run would report."""

from __future__ import annotations

import pytest
from hetsim.search import calib_dataparallel, calibrate, realruns
from hetsim.strategies.ddp import DDP, DDPPlan

from hetsim.profiling.obtain import ProfileRequest
from hetsim.types import Measurement


def _fake(monkeypatch, steps_of) -> list:
    """Every run steps `steps_of(plan, k)` (k: that plan's run so far); the plans run, in order, in the list."""
    ran: list = []

    def measure(plan, **k):
        n = sum(1 for p in ran if repr(p) == repr(plan))
        ran.append(plan)
        return Measurement(status="ok", step_time_s=steps_of(plan, n))

    monkeypatch.setattr(realruns, "measure", measure)
    return ran


def test_runs_in_turn_go_round_by_round_and_out_vote_per_plan():
    seqs = {0: [1.0, 1.01], 1: [1.0, 1.5, 1.49], 2: [2.0, 2.02]}
    order: list[int] = []
    disagreed: list[int] = []

    def run(i):
        return lambda k: order.append(i) or Measurement(status="ok", step_time_s=seqs[i][k])

    announced: list[tuple[int, int]] = []
    runs = realruns.runs_in_turn([run(0), run(1), run(2)], 2, at=lambda m: m.step_time_s,
                                 on_disagree=lambda i, lo, hi: disagreed.append(i),
                                 on_run=lambda i, k: announced.append((i, k)))
    assert order == [0, 1, 2, 0, 1, 2, 1]  # two rounds, then a third run for the plan whose runs disagree
    assert announced == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (1, 2)]  # each run, as it starts
    assert disagreed == [1]
    assert [realruns.consensus([m.step_time_s for m in r]) for r in runs] == pytest.approx([1.005, 1.49, 2.01])  # medians


def test_a_failing_plan_stops_alone():
    def run(i):
        return lambda k: Measurement(status="oom") if i == 0 else Measurement(status="ok", step_time_s=1.0)

    runs = realruns.runs_in_turn([run(0), run(1)], 2, at=lambda m: m.step_time_s)
    assert [len(r) for r in runs] == [1, 2] and runs[0][-1].status == "oom"


def test_every_data_parallel_term_runs_in_turn_and_solves_as_before(make_cost, gn_profile, tmp_path, monkeypatch):
    """Six terms, two rounds: the runs go A B C D E F A B C D E F, and each term is solved from its own
    plan's runs (the uniform data-parallel term from its two steps' mean)."""
    cost = make_cost("emu:1.0@4G,0.5@4G")
    ran = _fake(monkeypatch, lambda plan, k: 5.0 + 0.01 * k if isinstance(plan, DDPPlan) else 6.0)
    monkeypatch.setattr(calibrate, "calibrate_devices", lambda c, w, p, r, s: p)
    req = ProfileRequest(root=tmp_path, global_batch=16, precisions=("fp32",), strategies=("ddp", "zero"), repeats=2)
    said: list[str] = []
    profiles = calibrate.calibrate(cost.cluster, gn_profile[0], cost.profiles, req, say=said.append)
    assert len(ran) == 12
    assert [repr(p) for p in ran[:6]] == [repr(p) for p in ran[6:]]  # round by round
    assert len({repr(p) for p in ran}) == 6
    assert any("taken in turn" in s for s in said)
    runs_said = [s for s in said if "calibration run " in s]  # one line a run, as it starts
    assert [s.split(":")[0].strip() for s in runs_said] == [f"calibration run {n} of 12" for n in range(1, 13)]
    assert runs_said[0].endswith("(round 1)") and runs_said[-1].endswith("(round 2)")
    prof = next(iter(profiles.models.values()))
    key = next(iter(prof.sync_residual_s))
    sim = DDP().predict(ran[0], cost)[0].step_time_s
    assert prof.sync_residual_s[key] == pytest.approx(5.005 - sim)
    for field in ("sync_balanced_s", "shard_residual_s", "zero2_residual_s", "zero1_residual_s", "offload_single_s"):
        assert getattr(prof, field), field
    assert not realruns._TAKEN  # nothing left over for a later run

    ran.clear()  # every term recorded: nothing runs again
    calibrate.calibrate(cost.cluster, gn_profile[0], profiles, req, say=said.append)
    assert not ran


def test_pending_plans_are_the_terms_own_plans(make_cost, gn_profile, monkeypatch):
    """What is run ahead is what each term's own function runs: none of its runs happens twice."""
    cost = make_cost("emu:1.0@4G,0.5@4G")
    plans = calib_dataparallel.pending_plans(cost.cluster, gn_profile[0], cost.profiles, 16, zero=True)
    assert [label.split()[0] for label, _ in plans] == ["ddp", "ddp", "zero3", "zero2", "zero1", "zero3"]
    assert plans[-1][1].offload and plans[-1][1].devices == (0,)
    assert calib_dataparallel.pending_plans(cost.cluster, gn_profile[0], cost.profiles, 16, zero=False) == plans[:2]


def test_single_device_terms_run_in_turn_and_solve_on_their_own_runs(make_cost, gn_profile, tmp_path, monkeypatch):
    """The fp32 residual's two batch sizes and the slowed device's speed: three plans, two rounds, the runs
    A B C A B C, and each term solved on its own plan's runs (the full-speed and the slowed step at the
    largest batch are one plan on two one-device clusters, each with its own runs)."""
    from dataclasses import replace

    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.obtain import micro_batch_sizes
    from hetsim.profiling.store import ProfileSet, group_key

    cost = make_cost("emu:1.0@4G,0.5@4G")
    bare = {k: replace(m, calib_residual_s=None, calib_residual_low_s={}, speed_scale={}, calib_failed={})
            for k, m in cost.profiles.models.items()}
    profiles = ProfileSet(models=bare, devices=cost.profiles.devices)
    slow = cost.cluster.devices[1]
    _, plan, one = calibrate.speed_plan(slow, micro_batch_sizes(16, 2))
    kind = next(iter(bare))
    slowed = 1.2 * DDP().predict(plan, CostModel(one, profiles, cost.optimizer))[0].step_time_s
    full = CostModel(calibrate.residual_plans(cost.cluster.devices[0], (2,))[0][2], profiles, cost.optimizer)
    ran: list = []

    def measure(plan, *, cluster, **k):
        speed = cluster.devices[0].speed
        n = sum(1 for p, s in ran if repr(p) == repr(plan) and s == speed)
        ran.append((plan, speed))
        step = DDP().predict(plan, full)[0].step_time_s if speed == 1.0 else slowed  # no residual at full speed
        return Measurement(status="ok", step_time_s=step * (1 + 0.01 * n))

    monkeypatch.setattr(realruns, "measure", measure)
    req = ProfileRequest(root=tmp_path, global_batch=16, precisions=("fp32",), repeats=2)
    said: list[str] = []
    out = calibrate.calibrate_devices(cost.cluster, gn_profile[0], profiles, req, said.append)
    assert len(ran) == 6
    assert [(repr(p), s) for p, s in ran[:3]] == [(repr(p), s) for p, s in ran[3:]]  # round by round
    assert [s for _, s in ran[:3]] == [1.0, 1.0, 0.5] and any("taken in turn" in s for s in said)
    assert not realruns._TAKEN
    prof = out.models[kind]
    assert prof.calib_residual_s is not None and group_key([slow]) in prof.speed_scale
    # The speed term makes the slowed device's step what its own two runs read (their median).
    at = CostModel(one, ProfileSet(models={kind: prof}, devices=out.devices), cost.optimizer)
    assert DDP().predict(plan, at)[0].step_time_s == pytest.approx(slowed * 1.005, rel=1e-6)
