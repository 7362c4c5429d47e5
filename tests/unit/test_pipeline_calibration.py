"""The calibrated per-action pipeline term, and why data parallelism cannot fit a cluster."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
from hetsim.search.calib_modelparallel import (
    calibration_multi_stage_plans,
    calibration_pipeline_plans,
    fit_action_residual,
)
from hetsim.strategies.base import SearchContext
from pipeline_synth import synthetic_cost

from hetsim import strategies
from hetsim.model.costmodel import CostModel
from hetsim.profiling.store import group_key, multi_stage_key, precision_action_key
from hetsim.types import Fit

PIPE = strategies.get("pipeline")


def _with_action_s(cost: CostModel, x: float, per_sample: float = 0.0, schedule: str | None = None) -> CostModel:
    key = group_key(cost.cluster.devices)
    fit = Fit(intercept=x, slope=per_sample)
    field, key = ("pipe_action_s", key) if schedule is None else ("pipe_action_multi_s", multi_stage_key(schedule, key))
    models = {k: replace(p, **{field: {key: fit}}) for k, p in cost.profiles.models.items()}
    return CostModel(cost.cluster, replace(cost.profiles, models=models), cost.optimizer)


def test_every_compute_action_carries_the_calibrated_term():
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 4)
    plan = PIPE.solve(cost, (0, 1), schedule="1F1B", microbatches=4, batch=16)
    g0 = PIPE.graph(plan, cost)
    g1 = PIPE.graph(plan, _with_action_s(cost, 0.01))
    for a, b in zip(g0.tasks, g1.tasks):
        assert b.duration_s == pytest.approx(a.duration_s + (0.01 if a.kind in ("F", "B", "W") else 0.0))
    # 2 ranks x 4 micro-batches x (F + B), of which the critical path crosses at least 2 x 4 + 2.
    d = PIPE.predict(plan, _with_action_s(cost, 0.01))[0].step_time_s - PIPE.predict(plan, cost)[0].step_time_s
    assert 0.10 - 1e-9 <= d <= 0.16 + 1e-9


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"])
def test_multi_stage_schedules_do_not_carry_the_single_stage_term(schedule):
    # The term is fitted on GPipe/1F1B, whose torch schedules wait on every send; torch's runtime for
    # multi-stage schedules waits on sends only at the end of the step (action_term).
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 8)
    plan = PIPE.solve(cost, (0, 1), schedule=schedule, stages_per_rank=2, microbatches=2, batch=16)
    with_term = _with_action_s(cost, 0.01, 1e-3)
    assert [t.duration_s for t in PIPE.graph(plan, with_term).tasks] == [t.duration_s for t in PIPE.graph(plan, cost).tasks]
    assert PIPE.predict(plan, with_term)[0].step_time_s == PIPE.predict(plan, cost)[0].step_time_s
    one_stage = PIPE.solve(cost, (0, 1), schedule="1F1B", microbatches=2, batch=16)
    assert PIPE.predict(one_stage, with_term)[0].step_time_s > PIPE.predict(one_stage, cost)[0].step_time_s + 0.03
    # Each multi-stage schedule carries the term of its own schedule's calibration run, not another's; one-stage
    # plans carry none of those.
    for run in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"):
        multi = _with_action_s(cost, 0.01, schedule=run)
        added = 0.01 if schedule == run else 0.0
        for a, b in zip(PIPE.graph(plan, cost).tasks, PIPE.graph(plan, multi).tasks):
            assert b.duration_s == pytest.approx(a.duration_s + (added if a.kind in ("F", "B", "W") else 0.0))
        grown = PIPE.predict(plan, multi)[0].step_time_s - PIPE.predict(plan, cost)[0].step_time_s
        assert grown > 0.03 if added else grown == 0.0
        assert PIPE.predict(one_stage, multi)[0].step_time_s == PIPE.predict(one_stage, cost)[0].step_time_s


def test_looped_bfs_carries_interleaved_1f1b_term():
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 8)
    plan = PIPE.solve(cost, (0, 1), schedule="LoopedBFS", stages_per_rank=2, microbatches=2, batch=16)
    base = PIPE.predict(plan, cost)[0].step_time_s
    assert PIPE.predict(plan, _with_action_s(cost, 0.01, schedule="Interleaved1F1B"))[0].step_time_s > base + 0.03
    assert PIPE.predict(plan, _with_action_s(cost, 0.01, schedule="InterleavedZeroBubble"))[0].step_time_s == base


def test_multi_stage_calibration_runs_are_plans_the_search_could_pick():
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 8)
    plans = calibration_multi_stage_plans(cost, 16, 1)
    # Two shapes each: 2 stages per rank x P micro-batches, and the most stages the 8 blocks allow (ZBV: 2)
    # with the most micro-batches up to 4P.
    assert [(p.schedule, p.stages_per_rank, p.microbatches) for p in plans] == [
        ("Interleaved1F1B", 2, 2), ("Interleaved1F1B", 4, 8), ("InterleavedZeroBubble", 2, 2),
        ("InterleavedZeroBubble", 4, 8), ("ZBVZeroBubble", 2, 2), ("ZBVZeroBubble", 2, 8)]
    for p in plans:  # of the two device orders, the one the simulation (and so the search) prefers
        both = [PIPE.solve(cost, d, schedule=p.schedule, stages_per_rank=p.stages_per_rank,
                           microbatches=p.microbatches, batch=16) for d in ((0, 1), (1, 0))]
        assert p in both and PIPE.predict(p, cost)[0].step_time_s == min(PIPE.predict(b, cost)[0].step_time_s
                                                                         for b in both)
    # At least 4 samples a micro-batch: at most 4 micro-batches, and 3 stages per rank on 6 blocks.
    few = calibration_multi_stage_plans(synthetic_cost([1.0, 0.5], [1e-3] * 6), 16, 4)
    assert [(p.schedule, p.stages_per_rank, p.microbatches) for p in few] == [
        ("Interleaved1F1B", 2, 2), ("Interleaved1F1B", 3, 4), ("InterleavedZeroBubble", 2, 2),
        ("InterleavedZeroBubble", 3, 4), ("ZBVZeroBubble", 2, 2), ("ZBVZeroBubble", 2, 4)]
    assert calibration_multi_stage_plans(cost, 3, 1) == []  # neither 2 nor 4 micro-batches divide the batch
    assert calibration_multi_stage_plans(synthetic_cost([1.0, 0.5], [1e-3] * 3), 16, 1) == []  # 3 blocks < 4 stages


def test_low_precision_calibration_runs_are_solved_in_that_precision():
    """A bf16 calibration run has the boundaries the bf16 search would give it, not fp32's: here bf16 makes
    the first four blocks 4x cheaper and leaves the last four as they were, which moves the cut."""
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 8)
    model = next(iter(cost.profiles.models.values()))
    blocks = tuple(replace(b, timing={**b.timing, "bf16": replace(b.timing["fp32"], fwd_s=Fit(
        intercept=0.0, slope=b.timing["fp32"].fwd_s.slope / (4 if k < 4 else 1)), bwd_s=Fit(
        intercept=0.0, slope=b.timing["fp32"].bwd_s.slope / (4 if k < 4 else 1)))},
        act_bytes={**b.act_bytes, "bf16": b.act_bytes["fp32"]}) for k, b in enumerate(model.blocks))
    cost = CostModel(cost.cluster, replace(cost.profiles, models={"emu-cpu": replace(model, blocks=blocks)}), "adamw")
    for plans_for in (calibration_pipeline_plans, calibration_multi_stage_plans):
        fp32, bf16 = plans_for(cost, 16, 1), plans_for(cost, 16, 1, precision="bf16")
        assert len(fp32) == len(bf16) and all(p.precision == "bf16" for p in bf16)
        for b in bf16:
            same_shape = dict(schedule=b.schedule, stages_per_rank=b.stages_per_rank, microbatches=b.microbatches,
                              batch=16, precision="bf16")
            assert b == PIPE.solve(cost, b.devices, **same_shape)
        assert any(a.boundaries != b.boundaries for a, b in zip(fp32, bf16))


def test_fitted_residual_reproduces_both_calibration_runs():
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 4, p2p_s_per_byte=1e-8)
    truth = (0.004, 0.0005)
    points = []
    for m in (1, 4):
        plan = PIPE.solve(cost, (0, 1), schedule="1F1B" if m >= 2 else "GPipe", microbatches=m, batch=16)
        base = PIPE.predict(plan, cost)[0].step_time_s
        n = (PIPE.predict(plan, _with_action_s(cost, 1e-3))[0].step_time_s - base) / 1e-3
        measured = PIPE.predict(plan, _with_action_s(cost, *truth))[0].step_time_s
        points.append((float(plan.micro_batch), n, measured - base))
    fit = fit_action_residual(points)
    assert fit.intercept == pytest.approx(truth[0], rel=1e-3) and fit.slope == pytest.approx(truth[1], rel=1e-3)
    assert fit_action_residual(points[:1]).slope == 0.0  # one run: a constant


def test_residual_at_three_micro_batch_sizes_is_reproduced_at_each():
    # Not a line in the micro-batch (vit@64: -0.4 ms at 32, +3.0 at 16, +0.4 at 8): each run's own value is
    # kept, and the simulation reproduces every run it was fitted on.
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 4, p2p_s_per_byte=1e-8)
    truth = {16: 0.0004, 8: 0.0030, 4: 0.0004}
    plans = [PIPE.solve(cost, (0, 1), schedule="1F1B" if m >= 2 else "GPipe", microbatches=m, batch=16)
             for m in (1, 2, 4)]
    points, measured = [], []
    for plan in plans:
        base = PIPE.predict(plan, cost)[0].step_time_s
        n = (PIPE.predict(plan, _with_action_s(cost, 1e-3))[0].step_time_s - base) / 1e-3
        measured.append(PIPE.predict(plan, _with_action_s(cost, truth[plan.micro_batch]))[0].step_time_s)
        points.append((float(plan.micro_batch), n, measured[-1] - base))
    fit = fit_action_residual(points)
    assert fit.knots == tuple((float(mb), pytest.approx(e)) for mb, e in sorted(truth.items()))
    assert fit.residual(2) == pytest.approx(0.0004) and fit.residual(64) == pytest.approx(0.0004)  # flat beyond
    assert fit.residual(12) == pytest.approx(0.0017)
    for plan, want in zip(plans, measured):
        assert PIPE.predict(plan, _with_fit(cost, fit))[0].step_time_s == pytest.approx(want, rel=1e-9)


def test_a_negative_action_residual_is_carried_only_where_it_was_measured():
    # Real pipelines faster than simulated (gpt@tiny@64, 1F1B: -2.3, -1.7 and -1.1 ms an action at 16, 8 and
    # 4 samples) keep that within the calibrated micro-batches; past them the term is never below zero
    # (a negative term carried to shapes no run measured made 3 x 8 InterleavedZeroBubble plans 59-69 % fast).
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 4, p2p_s_per_byte=1e-8)
    fit = Fit(intercept=0.0, slope=0.0, knots=((4.0, -0.0028), (8.0, 0.001), (16.0, -0.0058)))
    fitted = _with_fit(cost, fit)
    assert fitted.pipeline_action_s(16) == pytest.approx(-0.0058) and fitted.pipeline_action_s(4) == pytest.approx(-0.0028)
    assert fitted.pipeline_action_s(8) == pytest.approx(0.001) and fitted.pipeline_action_s(6) == pytest.approx(-0.0009)
    assert fitted.pipeline_action_s(2) == 0.0 and fitted.pipeline_action_s(32) == 0.0  # outside: floored
    plan = PIPE.solve(cost, (0, 1), schedule="1F1B", microbatches=4, batch=16)
    raw = PIPE.predict(plan, cost)[0].step_time_s
    assert PIPE.predict(plan, fitted)[0].step_time_s < raw - 0.01  # 4 samples: a knot, -2.8 ms an action
    assert all(t.duration_s >= 0.0 for t in PIPE.graph(plan, _with_fit(cost, replace(fit, knots=((4.0, -1.0), (16.0, -1.0))))).tasks)
    beyond = PIPE.solve(cost, (0, 1), schedule="1F1B", microbatches=8, batch=16)  # 2 samples: below the knots
    assert PIPE.predict(beyond, fitted)[0].step_time_s == PIPE.predict(beyond, cost)[0].step_time_s
    # A fit of one run (no knots: recordings before the knots) is never read below zero.
    assert _with_fit(cost, Fit(intercept=-0.002, slope=0.0)).pipeline_action_s(4) == 0.0


def _with_fit(cost: CostModel, fit: Fit) -> CostModel:
    key = group_key(cost.cluster.devices)
    models = {k: replace(p, pipe_action_s={key: fit}) for k, p in cost.profiles.models.items()}
    return CostModel(cost.cluster, replace(cost.profiles, models=models), cost.optimizer)


def test_one_stage_calibration_runs_cover_one_and_both_micro_batch_counts():
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 4)
    runs = [(p.schedule, p.microbatches) for p in calibration_pipeline_plans(cost, 16, 1)]
    assert runs == [("GPipe", 1), ("1F1B", 4), ("1F1B", 2)]
    assert [(p.schedule, p.microbatches) for p in calibration_pipeline_plans(cost, 16, 5)] == [("GPipe", 1), ("1F1B", 2)]
    assert [p.microbatches for p in calibration_pipeline_plans(cost, 16, 9)] == [1]  # 8 samples < 9
    assert [p.microbatches for p in calibration_pipeline_plans(cost, 6, 1)] == [1, 2]  # 4 does not divide 6


def test_ddp_explains_which_device_cannot_hold_the_training_state():
    # 4 blocks of 10M parameters: 160 MB of fp32 parameters + gradients + AdamW state per replica.
    cost = synthetic_cost([1.0, 1.0], [1e-3] * 4, param_counts=[10_000_000] * 4, caps=["100M", "120M"])
    text = strategies.get("ddp").why_never_fits(SearchContext(cost=cost, global_batch=8))
    assert text.startswith("ddp infeasible")
    assert "device 0 needs 763 MiB, capacity 100 MiB (663 MiB over: params 153 + grads 153 + adamw state 305" in text
    assert "device 1 needs 763 MiB, capacity 120 MiB (643 MiB over" in text
    roomy = synthetic_cost([1.0, 1.0], [1e-3] * 4, param_counts=[10_000_000] * 4, caps=["100M", "1G"])
    assert strategies.get("ddp").why_never_fits(SearchContext(cost=roomy, global_batch=8)) is None


def test_multi_stage_term_is_read_by_micro_batches_times_stages():
    # gpt@tiny@64: InterleavedZeroBubble missed -1.0 ms an action at 2 stages x 2 micro-batches and +0.9 at
    # 3 x 8; a term from the first alone predicted the second 28 % fast.  Each calibration shape reads
    # back its own value, a shape between them the interpolation, and one beyond them the nearer value.
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 8, p2p_s_per_byte=1e-8)
    sched = "InterleavedZeroBubble"
    truth = {4.0: 0.001, 32.0: 0.004}
    plans = [PIPE.solve(cost, (0, 1), schedule=sched, stages_per_rank=v, microbatches=m, batch=16)
             for v, m in ((2, 2), (4, 8))]
    points, measured = [], []
    for plan, x in zip(plans, truth):
        base = PIPE.predict(plan, cost)[0].step_time_s
        n = (PIPE.predict(plan, _with_action_s(cost, 1e-3, schedule=sched))[0].step_time_s - base) / 1e-3
        measured.append(PIPE.predict(plan, _with_action_s(cost, truth[x], schedule=sched))[0].step_time_s)
        points.append((x, n, measured[-1] - base))
    fit = fit_action_residual(points)
    key = multi_stage_key(sched, group_key(cost.cluster.devices))
    models = {k: replace(p, pipe_action_multi_s={key: fit}) for k, p in cost.profiles.models.items()}
    fitted = CostModel(cost.cluster, replace(cost.profiles, models=models), cost.optimizer)
    for plan, want in zip(plans, measured):
        assert PIPE.predict(plan, fitted)[0].step_time_s == pytest.approx(want, rel=1e-9)
    assert fitted.pipeline_action_s(16, schedule=sched) == pytest.approx(0.001 + 0.003 * 12 / 28)
    assert fitted.pipeline_action_s(64, schedule=sched) == pytest.approx(0.004)
    # The same micro-batch size at more stages per rank reads a larger term.
    v2, v4 = (PIPE.solve(cost, (0, 1), schedule=sched, stages_per_rank=v, microbatches=4, batch=16) for v in (2, 4))
    grow = [PIPE.predict(p, fitted)[0].step_time_s - PIPE.predict(p, cost)[0].step_time_s for p in (v2, v4)]
    n = [(PIPE.predict(p, _with_action_s(cost, 1e-3, schedule=sched))[0].step_time_s
          - PIPE.predict(p, cost)[0].step_time_s) / 1e-3 for p in (v2, v4)]
    assert grow[0] / n[0] == pytest.approx(0.001 + 0.003 * 4 / 28, rel=1e-6)
    assert grow[1] / n[1] == pytest.approx(0.001 + 0.003 * 12 / 28, rel=1e-6)


@pytest.mark.parametrize("schedule, run", [("1F1B", None), ("InterleavedZeroBubble", "InterleavedZeroBubble")])
def test_a_low_precision_reads_its_own_action_term_else_fp32s(schedule, run):
    # resnet50@64 on a host with AVX-512 bf16: with the fp32 terms alone its bf16 pipelines measured 27-34 %
    # slower than simulated while their fp32 twins were within 6 %: bf16 runs calibrate terms of their own.
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 8)
    group = group_key(cost.cluster.devices)
    field, key = ("pipe_action_s", group) if run is None else ("pipe_action_multi_s", multi_stage_key(run, group))
    spr = 1 if run is None else 2

    def with_terms(terms: dict) -> CostModel:
        models = {k: replace(p, **{field: {k2: Fit(intercept=v, slope=0.0) for k2, v in terms.items()}})
                  for k, p in cost.profiles.models.items()}
        return CostModel(cost.cluster, replace(cost.profiles, models=models), cost.optimizer)

    def extra(c: CostModel, precision: str) -> list[float]:
        plan = PIPE.solve(cost, (0, 1), schedule=schedule, stages_per_rank=spr, microbatches=4, batch=16,
                          precision=precision)
        return [b.duration_s - a.duration_s for a, b in zip(PIPE.graph(plan, cost).tasks, PIPE.graph(plan, c).tasks)
                if a.kind in ("F", "B", "W")]

    both = with_terms({key: 0.01, precision_action_key(key, "bf16"): 0.03})
    assert extra(both, "fp32") == pytest.approx([0.01] * len(extra(both, "fp32")))
    assert extra(both, "bf16") == pytest.approx([0.03] * len(extra(both, "bf16")))
    fp32_only = with_terms({key: 0.01})  # recordings made before, or a precision not calibrated: fp32's term
    assert extra(fp32_only, "bf16") == pytest.approx([0.01] * len(extra(fp32_only, "bf16")))


def test_pipelines_calibrate_bf16_only_where_it_is_searched_and_usable(monkeypatch):
    from hetsim.search import calibrate

    cost = synthetic_cost([1.0, 0.5], [1e-3] * 8)
    monkeypatch.setattr(calibrate, "low_precisions", lambda d, precs: [p for p in precs if p != "fp32"])
    monkeypatch.setattr(calibrate, "slowdown", lambda m, p: 0.7)
    monkeypatch.setattr(calibrate, "precision_problem", lambda m, p: None)
    assert calibrate.pipeline_precisions(cost.cluster, cost.profiles, ("fp32", "bf16", "fp16")) == ("bf16",)
    assert calibrate.pipeline_precisions(cost.cluster, cost.profiles, ("fp32",)) == ()
    monkeypatch.setattr(calibrate, "slowdown", lambda m, p: 31.5)  # bf16 emulated in software: not calibrated
    assert calibrate.pipeline_precisions(cost.cluster, cost.profiles, ("fp32", "bf16")) == ()
    monkeypatch.setattr(calibrate, "slowdown", lambda m, p: 0.7)
    monkeypatch.setattr(calibrate, "precision_problem", lambda m, p: "refused")
    assert calibrate.pipeline_precisions(cost.cluster, cost.profiles, ("fp32", "bf16")) == ()


def test_pipeline_calibration_runs_each_precision_and_keys_its_terms(monkeypatch, tmp_path):
    from hetsim.search import calib_modelparallel as cm

    cost = synthetic_cost([1.0, 0.5], [1e-3] * 8)
    ran = []

    def fake_robust(plan, **k):
        ran.append((plan.schedule, plan.precision))
        return None, PIPE.predict(plan, cost)[0].step_time_s + (0.05 if plan.precision == "bf16" else 0.01)

    monkeypatch.setattr(cm, "robust_step_s", fake_robust)
    monkeypatch.setattr(cm, "taken_in_turn", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(cm, "record", lambda profiles, root, wl, fn: replace(
        profiles, models={k: fn(k, p) for k, p in profiles.models.items()}))
    wl = type("W", (), {"optimizer": cost.optimizer, "has_batchnorm": False, "batch_coupled": False, "spec": "w"})()
    out = cm.calibrate_pipeline(cost.cluster, wl, cost.profiles, tmp_path, lambda m: None, 16, precisions=("bf16",))
    assert {p for _, p in ran} == {"fp32", "bf16"} and len(ran) % 2 == 0
    assert sum(p == "bf16" for _, p in ran) == sum(p == "fp32" for _, p in ran)
    group = group_key(cost.cluster.devices)
    m = next(iter(out.models.values()))
    assert set(m.pipe_action_s) == {group, precision_action_key(group, "bf16")}
    assert precision_action_key(multi_stage_key("ZBVZeroBubble", group), "bf16") in m.pipe_action_multi_s
    # The bf16 runs measured more: their terms are larger than fp32's.
    fitted = CostModel(cost.cluster, out, cost.optimizer)
    assert fitted.pipeline_action_s(4, precision="bf16") > fitted.pipeline_action_s(4) > 0


def test_pipeline_calibration_takes_every_run_in_turn(monkeypatch, tmp_path):
    """Every pipeline of every term runs once per round, the rounds one after the other; each term is then
    solved from its own plans' runs, as when each ran alone."""
    from hetsim.search import calib_modelparallel as cm
    from hetsim.search import realruns

    from hetsim.types import Measurement

    cost = synthetic_cost([1.0, 0.5], [1e-3] * 8)
    ran = []

    def fake_measure(plan, **k):
        ran.append(repr(plan))
        return Measurement(status="ok", step_time_s=PIPE.predict(plan, cost)[0].step_time_s + 0.01)

    monkeypatch.setattr(realruns, "measure", fake_measure)
    monkeypatch.setattr(cm, "record", lambda profiles, root, wl, fn: replace(
        profiles, models={k: fn(k, p) for k, p in profiles.models.items()}))
    wl = type("W", (), {"optimizer": cost.optimizer, "has_batchnorm": False, "batch_coupled": False, "spec": "w"})()
    out = cm.calibrate_pipeline(cost.cluster, wl, cost.profiles, tmp_path, lambda m: None, 16, repeats=2)
    n = len(ran) // 2
    assert n >= 4 and len(ran) == 2 * n and ran[:n] == ran[n:] and len(set(ran)) == n
    m = next(iter(out.models.values()))
    assert m.pipe_action_s and m.pipe_action_multi_s
    assert not realruns._TAKEN


def test_a_pipeline_on_one_device_carries_no_action_term():
    """A plan whose every stage is on one device has no peer to send to or wait on: the term measured on
    pipelines across the cluster is not added (a one-device GPipe m=2 of a 4-layer encoder was predicted
    29.2 % slow with it, 1.3 % without).  A two-device plan still carries it."""
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 4)
    with_term = _with_action_s(cost, 0.01)
    alone = PIPE.solve(cost, (0,), schedule="GPipe", microbatches=2, batch=16)
    assert PIPE.predict(alone, with_term)[0].step_time_s == PIPE.predict(alone, cost)[0].step_time_s
    two = PIPE.solve(cost, (0, 1), schedule="GPipe", microbatches=2, batch=16)
    assert PIPE.predict(two, with_term)[0].step_time_s > PIPE.predict(two, cost)[0].step_time_s + 0.03
