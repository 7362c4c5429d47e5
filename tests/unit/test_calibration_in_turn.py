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
    assert [realruns.consensus([m.step_time_s for m in r]) for r in runs] == pytest.approx([1.005, 1.495, 2.01])


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
