"""A calibration run that runs out of memory is remembered; one that crashes is retried."""

from __future__ import annotations

import pytest
from hetsim.search import calib_dataparallel, calib_modelparallel, calibrate, realruns
from hetsim.strategies.ddp import DDP, DDPPlan
from hetsim.strategies.zero import ZeRO

from hetsim.model.costmodel import CostModel
from hetsim.names import CALIB_REPEATS
from hetsim.profiling.store import group_key
from hetsim.types import Measurement


def _every_run_steps(monkeypatch, step_s: float) -> list:
    """Every real run (`realruns.measure`) steps `step_s`; the plans run, in order, in the list returned."""
    ran: list = []
    monkeypatch.setattr(realruns, "measure", lambda plan, **k: ran.append(plan) or Measurement(status="ok",
                                                                                             step_time_s=step_s))
    return ran


@pytest.mark.parametrize("status, runs", [("oom", 1), ("error", 2)])
def test_failed_uniform_calibration(make_cost, gn_profile, tmp_path, monkeypatch, status, runs):
    wl = gn_profile[0]
    cost = make_cost("emu:1.0@4G,0.5@4G")
    calls = []
    monkeypatch.setattr(realruns, "measure", lambda *a, **k: calls.append(1) or Measurement(status=status))
    said: list[str] = []
    profiles = calib_dataparallel.calibrate_sync(cost.cluster, wl, cost.profiles, tmp_path, said.append)
    profiles = calib_dataparallel.calibrate_sync(cost.cluster, wl, profiles, tmp_path, said.append)
    assert len(calls) == runs
    assert not any(m.sync_residual_s for m in profiles.models.values())
    if status == "oom":
        assert "not repeated" in said[-1] and "--reprofile" in said[-1]


@pytest.mark.parametrize("steps, repeats, runs, kept", [((1.0, 1.02), 2, 2, 1.01), ((1.0, 1.3, 1.04), 2, 3, 1.04),
                                                        ((1.0, 1.3, 1.6, 1.29), 2, 4, 1.295),
                                                        ((1.0, 1.3, 1.04, 1.02), None, 4, 1.03)])
def test_calibration_runs_out_vote_an_outlier(monkeypatch, steps, repeats, runs, kept):
    """`--calib-repeats` runs (four unless given), and more only while no two agree within the noise floor;
    their median is kept (one run caught in a slow phase had moved the data-parallel term by 0.16 s)."""
    seq = iter(steps)
    calls = []

    def fake_measure(*a, **k):
        calls.append(1)
        return Measurement(status="ok", step_time_s=next(seq))

    monkeypatch.setattr(realruns, "measure", fake_measure)
    said: list[str] = []
    more = {} if repeats is None else {"repeats": repeats}
    _, step = realruns.robust_step_s(object(), cluster=None, workload=type("W", (), {"spec": "x", "optimizer": "sgd"}),
                                      ref_probe_s=0.0, steps=10, say=said.append, **more)
    assert len(calls) == runs and step == pytest.approx(kept)
    assert len(said) == runs - (repeats or CALIB_REPEATS)


@pytest.mark.parametrize("statuses, ok", [(("timeout", "ok"), True), (("timeout", "timeout"), False),
                                          (("error",), False), (("ok",), True)])
def test_a_hung_calibration_run_runs_once_more(monkeypatch, statuses, ok):
    """A calibration run that times out (a hung rank) runs once more before its term is given up
    (`realruns.HUNG_RETRIES`); a run that fails otherwise, or succeeds, is not run again."""
    seq = iter(statuses)
    calls = []

    def fake_measure(*a, **k):
        calls.append(k["timeout_s"])
        status = next(seq)
        return Measurement(status=status, step_time_s=1.0 if status == "ok" else None)

    monkeypatch.setattr(realruns, "measure", fake_measure)
    said: list[str] = []
    m, step = realruns.robust_step_s(object(), cluster=None, workload=type("W", (), {"spec": "x", "optimizer": "sgd"}),
                                     ref_probe_s=0.0, steps=6, say=said.append, timeout_s=120, repeats=1)
    assert calls == [120] * len(statuses)
    assert m.status == statuses[-1]
    assert step == (pytest.approx(1.0) if ok else None)
    assert [s for s in said if "timed out" in s] == ["  the run timed out after 120 s (a rank hung): once more"] * (
        statuses[0] == "timeout")


def test_one_repeat_runs_each_calibration_plan_once(make_cost, gn_profile, tmp_path, monkeypatch):
    """--repeats 1 reaches every calibration run through ProfileRequest.repeats: one run each, its
    step kept as measured (no third run however far it is from the simulation)."""
    from hetsim.profiling.obtain import ProfileRequest

    cost = make_cost("emu:1.0@4G,0.5@4G")
    calls = _every_run_steps(monkeypatch, 5.0)
    monkeypatch.setattr(calibrate, "calibrate_devices", lambda c, w, p, r, s: p)
    req = ProfileRequest(root=tmp_path, global_batch=16, precisions=("fp32",), strategies=("ddp", "zero"), repeats=1)
    profiles = calibrate.calibrate(cost.cluster, gn_profile[0], cost.profiles, req, say=lambda m: None)
    assert len(calls) == 6  # data parallel (uniform, balanced), ZeRO-3, ZeRO-2, ZeRO-1, one-device offload: one each
    key = next(iter(next(iter(profiles.models.values())).sync_residual_s))
    sim = DDP().predict(calls[0], cost)[0].step_time_s
    assert next(iter(profiles.models.values())).sync_residual_s[key] == pytest.approx(5.0 - sim)


def test_tensor_parallel_calibration_makes_each_realisation_step_as_measured(make_gpt_cost, gpt_profile, tmp_path,
                                                                              monkeypatch):
    """Three real runs over the whole cluster as one tensor group, DTensor's even shards with and
    without sequence parallelism and the solved slices; each term is per collective, so the
    simulated step of the run it came from then equals the measured one, and the other realisations
    are left alone."""
    from hetsim.strategies.tp import TP, build_plan

    wl = gpt_profile[0]
    cost = make_gpt_cost("emu:1.0@4G,0.5@4G")
    tp = TP()
    extra = {"dtensor": 0.2, "sp": 0.3, "slices": 0.05}  # measured minus simulated, per realisation

    def plan_of(c, real):
        return build_plan(c, (0, 1), 2, "fast_links", 32, even=real != "slices", sequence_parallel=real == "sp")

    preds = {real: tp.predict(plan_of(cost, real), cost)[0].step_time_s for real in extra}
    ran = []

    def fake_measure(plan, **k):
        ran.append(plan.realisation)
        return Measurement(status="ok", step_time_s=preds[plan.realisation] + extra[plan.realisation])

    monkeypatch.setattr(realruns, "measure", fake_measure)
    said: list[str] = []
    profiles = calib_modelparallel.calibrate_tp(cost.cluster, wl, cost.profiles, tmp_path, said.append, 32)
    assert sorted(set(ran)) == sorted(extra)
    from hetsim.model.costmodel import CostModel

    after = CostModel(cost.cluster, profiles, wl.optimizer)
    for real in extra:
        assert tp.predict(plan_of(after, real), after)[0].step_time_s == pytest.approx(preds[real] + extra[real], rel=1e-6)
    assert after.tp_collective_s((0, 1), "sp") > after.tp_collective_s((0, 1), "dtensor") > \
        after.tp_collective_s((0, 1), "slices") > 0
    # Recorded: a second search measures nothing again.
    ran.clear()
    calib_modelparallel.calibrate_tp(cost.cluster, wl, profiles, tmp_path, said.append, 32)
    assert not ran


def test_tensor_parallel_calibration_covers_the_groups_of_replicated_plans(make_gpt_cost, gpt_profile, tmp_path,
                                                                           monkeypatch):
    """On four devices a DP x TP plan's tensor groups are pairs: each kind of pair the search can form
    (mixed speeds, like speeds, DTensor on the fastest pair) gets a term from a run of its own, and a
    plan whose groups are all of one kind then steps as measured."""
    from hetsim.strategies.tp import TP, build_plan

    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.store import group_key

    wl = gpt_profile[0]
    cost = make_gpt_cost("emu:1.0@4G,1.0@4G,0.5@4G,0.5@4G")
    tp = TP()
    ran = []

    def fake_measure(plan, **k):
        ran.append((plan.tp_size, plan.dp, plan.dtensor, plan.sequence_parallel))
        return Measurement(status="ok", step_time_s=tp.predict(plan, cost)[0].step_time_s + 0.1)

    monkeypatch.setattr(realruns, "measure", fake_measure)
    profiles = calib_modelparallel.calibrate_tp(cost.cluster, wl, cost.profiles, tmp_path, lambda m: None, 32)
    assert {(2, 2, False, False), (2, 1, True, False), (2, 1, True, True), (4, 1, True, False), (4, 1, True, True)} <= set(ran)
    after = CostModel(cost.cluster, profiles, wl.optimizer)
    devs = cost.cluster.devices
    assert group_key([devs[0], devs[2]]) != group_key([devs[0], devs[1]])
    for pair in ((0, 2), (0, 1), (2, 3)):
        assert after.tp_collective_s(pair, "slices") > 0, pair
    assert after.tp_collective_s((0, 1), "dtensor") > 0 and after.tp_collective_s((0, 1), "sp") > 0
    strided = build_plan(cost, (0, 1, 2, 3), 2, "strided", 32)
    assert len({group_key([devs[d] for d in g]) for g in strided.groups()}) == 1
    assert tp.predict(strided, after)[0].step_time_s == pytest.approx(tp.predict(strided, cost)[0].step_time_s + 0.1,
                                                                      rel=1e-6)
    ran.clear()
    calib_modelparallel.calibrate_tp(cost.cluster, wl, profiles, tmp_path, lambda m: None, 32)
    assert not ran


def test_pipelines_of_tensor_groups_get_a_term_of_their_own(make_gpt_cost, gpt_profile, tmp_path, monkeypatch):
    """On four devices a PP x TP run of each grouping calibrates a signed relative compute change of
    its stages' groups, apart from the DP x TP runs' all-reduce terms: each PP x TP plan then steps
    as its run measured (faster than simulated here: the term is negative), a DP x TP plan as its
    own run did."""
    from hetsim.strategies.tp import TP, build_plan

    from hetsim.model.costmodel import CostModel

    wl = gpt_profile[0]
    cost = make_gpt_cost("emu:1.0@4G,1.0@4G,0.5@4G,0.5@4G")
    tp = TP()
    ran = []
    extra = {1: 0.01, 2: -0.03}  # by stages: DP x TP slower than simulated, PP x TP faster

    def fake_measure(plan, **k):
        ran.append(plan)
        return Measurement(status="ok", step_time_s=tp.predict(plan, cost)[0].step_time_s + extra[plan.stages])

    monkeypatch.setattr(realruns, "measure", fake_measure)
    profiles = calib_modelparallel.calibrate_tp(cost.cluster, wl, cost.profiles, tmp_path, lambda m: None, 32)
    staged = {p for p in ran if p.stages == 2}
    assert len(staged) == 2  # fast_links and strided (each run --repeats times)
    after = CostModel(cost.cluster, profiles, wl.optimizer)
    for plan in staged:
        assert tp.predict(plan, after)[0].step_time_s == pytest.approx(tp.predict(plan, cost)[0].step_time_s - 0.03,
                                                                       rel=1e-4)
    assert after.tp_pipeline_scale((0, 2)) < 0 < after.tp_collective_s((0, 2), "slices")
    strided = build_plan(cost, (0, 1, 2, 3), 2, "strided", 32)
    assert tp.predict(strided, after)[0].step_time_s == pytest.approx(tp.predict(strided, cost)[0].step_time_s + 0.01,
                                                                      rel=1e-6)


@pytest.mark.parametrize("cluster, strategies, terms", [
    ("emu:1.0@4G,0.5@4G", ("ddp",), ["sync"]),
    ("emu:1.0@4G,0.5@4G", ("zero",), ["sync", "sharded", "zero2", "zero1", "offload_single"]),
    ("emu:1.0@4G,0.5@4G", ("hybrid",), ["sync", "pipeline"]),
    ("emu:1.0@4G,0.5@4G", ("tp", "ddp"), ["sync", "tp"]),
    ("emu:1.0@4G,0.5@4G", None, ["sync", "sharded", "zero2", "zero1", "offload_single", "pipeline", "tp"]),
    ("emu:1.0@4G", ("ddp",), []),
    ("emu:1.0@4G", ("zero",), ["offload_single"]),
    ("emu:1.0@4G", None, ["offload_single"]),
])
def test_calibration_measures_the_terms_of_the_families_searched(make_cost, gn_profile, tmp_path, monkeypatch,
                                                                 cluster, strategies, terms):
    """The uniform data-parallel term always (the baseline runs); the others only for their families.
    One device has no group terms, only the offloaded step's own (an H200's one-device offload plans
    measured 45-52 % slower than simulated without it)."""
    from hetsim.profiling.obtain import ProfileRequest

    cost = make_cost(cluster)
    called = []
    monkeypatch.setattr(calibrate, "calibrate_devices", lambda c, w, p, r, s: p)
    monkeypatch.setattr(calib_dataparallel, "pending_plans", lambda *a, **k: [])
    for name in ("sync", "sharded", "zero2", "zero1", "offload_single", "pipeline", "tp"):
        for module in (calibrate, calib_dataparallel):
            if hasattr(module, f"calibrate_{name}"):
                monkeypatch.setattr(module, f"calibrate_{name}",
                                    lambda c, w, p, *a, name=name, **k: called.append(name) or p)
    req = ProfileRequest(root=tmp_path, global_batch=16, precisions=("fp32",), strategies=strategies)
    calibrate.calibrate(cost.cluster, gn_profile[0], cost.profiles, req, say=lambda m: None)
    assert called == terms


def test_single_device_residual_is_the_line_through_measured_minus_predicted(gn_profile, monkeypatch):
    """Two real single-device steps (the middle and the largest profiled size); the residual per
    micro-step is the line through their gaps; a failing run is remembered with its status."""
    from dataclasses import replace

    from hetsim.hardware.cluster import parse_cluster
    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.store import ProfileSet

    wl, prof, dev = gn_profile
    prof = replace(prof, calib_residual_s=None)
    one = CostModel(parse_cluster("emu:1.0@4G"), ProfileSet(models={"emu-cpu": prof}, devices={"emu-cpu": dev}),
                    wl.optimizer)
    ran = []

    def fake_measure(plan, **k):
        ran.append(plan.local_batch[0])
        pred = DDP().predict(plan, one)[0].step_time_s
        return Measurement(status="ok", step_time_s=pred + 0.1 + 0.002 * plan.local_batch[0])

    monkeypatch.setattr(realruns, "measure", fake_measure)
    device = parse_cluster("emu:1.0@4G").devices[0]
    after = calibrate.calibrate_residual(device, wl, prof, dev, (2, 8, 16, 31), lambda m: None, repeats=1)
    assert ran == [8, 31]
    assert after.calib_residual_s.intercept == pytest.approx(0.1) and after.calib_residual_s.slope == pytest.approx(0.002)
    monkeypatch.setattr(realruns, "measure", lambda *a, **k: Measurement(status="oom"))
    failed = calibrate.calibrate_residual(device, wl, prof, dev, (2, 8, 16, 31), lambda m: None, repeats=1)
    assert failed.calib_residual_s is None and failed.calib_failed[calibrate.RESIDUAL] == "oom"


def _bf16_at(prof, k: float):
    """`prof` with its bf16 block timings k times its fp32 ones (the recorded gn_resnet profile's bf16 is
    8.5x fp32: recorded on a CPU without bf16 arithmetic)."""
    from dataclasses import replace

    from hetsim.types import Fit

    def scaled(t):
        return replace(t, fwd_s=Fit(intercept=t.fwd_s.intercept * k, slope=t.fwd_s.slope * k),
                       bwd_s=Fit(intercept=t.bwd_s.intercept * k, slope=t.bwd_s.slope * k))

    return replace(prof, blocks=tuple(replace(b, timing={**b.timing, "bf16": scaled(b.timing["fp32"])})
                                      for b in prof.blocks))


def test_low_precision_gets_its_own_single_device_residual(gn_profile, tmp_path, monkeypatch):
    """With bf16 searched, the single-device residual is measured again from real bf16 steps against the
    bare block model; bf16 micro-steps then carry it and fp32 ones keep theirs.  Measured once: a
    second calibration finds both; a failed bf16 run is remembered under its own key."""
    from dataclasses import replace

    from hetsim.hardware.cluster import parse_cluster
    from hetsim.profiling.obtain import ProfileRequest
    from hetsim.profiling.store import ProfileSet
    from hetsim.types import Fit

    wl, prof, dev = gn_profile
    prof = replace(_bf16_at(prof, 1.2), calib_residual_s=None, calib_residual_low_s={})
    cluster = parse_cluster("emu:1.0@4G")
    bare = CostModel(cluster, ProfileSet(models={"emu-cpu": prof}, devices={"emu-cpu": dev}), wl.optimizer)
    ran = []

    def fake_measure(plan, **k):
        ran.append((plan.precision, plan.local_batch[0]))
        pred = DDP().predict(plan, bare)[0].step_time_s
        extra = (0.2 + 0.001 * plan.local_batch[0]) if plan.precision == "bf16" else 0.05
        return Measurement(status="ok", step_time_s=pred + extra)

    monkeypatch.setattr(realruns, "measure", fake_measure)
    req = ProfileRequest(root=tmp_path, global_batch=16, precisions=("fp32", "bf16"), repeats=1)
    profiles = calibrate.calibrate_devices(cluster, wl, ProfileSet(models={"emu-cpu": prof}, devices={"emu-cpu": dev}),
                                           req, lambda m: None)
    after = profiles.models["emu-cpu"]
    assert sorted({p for p, _ in ran}) == ["bf16", "fp32"] and len(ran) == 4
    assert after.calib_residual_s.intercept == pytest.approx(0.05) and after.calib_residual_s.slope == pytest.approx(0)
    low = after.calib_residual_low_s["bf16"]
    assert low.intercept == pytest.approx(0.2) and low.slope == pytest.approx(0.001)
    cost = CostModel(cluster, profiles, wl.optimizer)
    assert cost.overhead_s(0, 8, precision="bf16") - cost.overhead_s(0, 8) == pytest.approx(0.208 - 0.05)
    plan = DDPPlan(devices=(0,), local_batch=(8,), precision="bf16")
    assert DDP().predict(plan, cost)[0].step_time_s == pytest.approx(DDP().predict(plan, bare)[0].step_time_s + 0.208)
    ran.clear()
    calibrate.calibrate_devices(cluster, wl, profiles, req, lambda m: None)
    assert ran == []
    # A precision whose gradients the profile refuses (resnet50's BatchNorm under CPU bf16: cosine 0.18)
    # has no plans to correct, and its plan would not validate: not run.
    refused = replace(prof, grad_cosine={"bf16": 0.18}, calib_residual_s=Fit(intercept=0.0, slope=0.0))
    out = calibrate.calibrate_devices(cluster, wl, ProfileSet(models={"emu-cpu": refused}, devices={"emu-cpu": dev}),
                                      req, lambda m: None)
    assert ran == [] and out.models["emu-cpu"].calib_residual_low_s == {}
    monkeypatch.setattr(realruns, "measure", lambda *a, **k: Measurement(status="oom"))
    failed = calibrate.calibrate_residual(cluster.devices[0], wl, replace(after, calib_residual_low_s={}), dev,
                                          (2, 8, 16), lambda m: None, repeats=1, precision="bf16")
    assert failed.calib_residual_low_s == {} and failed.calib_failed[f"{calibrate.RESIDUAL}:bf16"] == "oom"
    assert failed.calib_residual_s == after.calib_residual_s and isinstance(failed.calib_residual_s, Fit)


def test_uniform_terms_are_calibrated_at_the_searched_batch_when_it_fits(make_cost, gn_profile, tmp_path, monkeypatch):
    """The uniform plan of a data-parallel term runs at the search's global batch (what its baseline
    executes), or at the small batch when the search's is predicted not to fit."""
    from hetsim.profiling.obtain import ProfileRequest

    cost = make_cost("emu:1.0@4G,0.5@4G")
    ran = _every_run_steps(monkeypatch, 1.0)
    monkeypatch.setattr(calibrate, "calibrate_devices", lambda c, w, p, r, s: p)
    req = ProfileRequest(root=tmp_path, global_batch=40, precisions=("fp32",), strategies=("ddp", "zero"), repeats=1)
    calibrate.calibrate(cost.cluster, gn_profile[0], cost.profiles, req, say=lambda m: None)
    assert [(p.local_batch, getattr(p, "zero_stage", None)) for p in ran] == [
        ((20, 20), None), ((27, 13), None), ((20, 20), 3), ((20, 20), 2), ((20, 20), 1), ((40,), 3)]

    huge = 1 << 14
    assert not DDP().predict(DDPPlan(devices=(0, 1), local_batch=(huge // 2, huge // 2)),
                                       cost)[0].feasible
    assert calib_dataparallel.uniform_plan(DDP(), cost, huge).local_batch == (8, 8)
    assert calib_dataparallel.uniform_plan(DDP(), cost, None).local_batch == (8, 8)
    from hetsim.strategies.zero import ZeROPlan

    assert calib_dataparallel.uniform_plan(ZeRO(), cost, 40, zero_stage=1) == ZeROPlan(
        devices=(0, 1), local_batch=(20, 20), zero_stage=1)


def test_the_balanced_data_parallel_step_is_predicted_as_measured_and_the_uniform_one_as_before(
        make_cost, gn_profile, tmp_path, monkeypatch):
    """The second data-parallel run, at the split the search's solver balances: its term is solved so
    that the model predicts that run's step exactly (the term may hide behind a rank's compute), the
    uniform plan keeps its own term, and a plan between them reads a term between the two."""
    from hetsim.profiling.obtain import ProfileRequest

    cost = make_cost("emu:1.0@4G,0.5@4G")
    steps = {(20, 20): 2.0, (27, 13): 3.0}
    monkeypatch.setattr(realruns, "measure", lambda plan, **k: Measurement(status="ok",
                                                                            step_time_s=steps[plan.local_batch]))
    monkeypatch.setattr(calibrate, "calibrate_devices", lambda c, w, p, r, s: p)
    req = ProfileRequest(root=tmp_path, global_batch=40, precisions=("fp32",), strategies=("ddp",), repeats=1)
    profiles = calibrate.calibrate(cost.cluster, gn_profile[0], cost.profiles, req, say=lambda m: None)
    after = CostModel(cost.cluster, profiles, cost.optimizer)
    for split, real in steps.items():
        plan = DDPPlan(devices=(0, 1), local_batch=split)
        assert DDP().predict(plan, after)[0].step_time_s == pytest.approx(real, abs=1e-3)
    uniform, balanced, mid = (after.sync_residual_s((0, 1), o) for o in (0.0, 1.0, None))
    at_u, at_b, _ = next(iter(profiles.models.values())).sync_balanced_s[group_key(cost.cluster.devices)]
    assert uniform < after.sync_residual_s((0, 1), (at_u + at_b) / 2) < balanced
    assert mid == uniform  # no overlap given (FSDP's graph): the uniform step's term


def test_term_for_solves_a_term_hidden_in_part_behind_compute():
    # A term that only shows above 0.3 s (a rank's own compute ends 0.3 s after the all-reduces).
    def predicted(x):
        return 1.0 + max(0.0, x - 0.3)

    assert calib_dataparallel.term_for(1.5, predicted) == pytest.approx(0.8, abs=1e-3)
    assert calib_dataparallel.term_for(0.9, predicted) == pytest.approx(-0.1)  # below the model's floor


def test_one_device_offload_term_makes_its_plan_step_as_measured(make_cost, gn_profile, tmp_path, monkeypatch):
    """ZeRO-3 with CPU offload on the fastest device alone, measured minus simulated: ZeRO-2 and ZeRO-3
    offload plans with that device carry it (several ranks: the largest of theirs); plans on the other
    device alone do not."""
    from hetsim.strategies.zero import ZeROPlan

    cost = make_cost("emu:0.5@4G,1.0@4G")
    runs = _every_run_steps(monkeypatch, 3.0)
    said: list[str] = []
    profiles = calib_dataparallel.calibrate_offload_single(cost.cluster, gn_profile[0], cost.profiles, tmp_path,
                                                           said.append, global_batch=16)
    assert [(p.devices, p.zero_stage, p.offload, p.local_batch) for p in runs] == [((1,), 3, True, (16,))] * CALIB_REPEATS
    assert "one device" in said[0]
    after = CostModel(cost.cluster, profiles, cost.optimizer, has_batchnorm=cost.facts.has_batchnorm)
    zero = ZeRO()
    assert zero.predict(runs[0], after)[0].step_time_s == pytest.approx(3.0)
    gained = zero.predict(runs[0], after)[0].step_time_s - zero.predict(runs[0], cost)[0].step_time_s
    assert gained > 0
    for plan, carries in ((ZeROPlan(devices=(1,), local_batch=(16,), zero_stage=2, offload=True, accum_steps=2), True),
                          (ZeROPlan(devices=(0,), local_batch=(16,), zero_stage=3, offload=True), False),
                          (ZeROPlan(devices=(0, 1), local_batch=(8, 8), zero_stage=3, offload=True), True),
                          (ZeROPlan(devices=(0, 1), local_batch=(8, 8), zero_stage=3, offload=False), False)):
        grown = zero.predict(plan, after)[0].step_time_s - zero.predict(plan, cost)[0].step_time_s
        assert grown == pytest.approx(gained if carries else 0.0, abs=1e-9)
    # Recorded once: a later calibration reuses it.
    again = calib_dataparallel.calibrate_offload_single(cost.cluster, gn_profile[0], profiles, tmp_path, said.append,
                                                        global_batch=16)
    assert len(runs) == CALIB_REPEATS and again is profiles


def test_a_low_precision_far_slower_than_fp32_keeps_the_fp32_residual(gn_profile, tmp_path, monkeypatch):
    """A CPU without bf16 arithmetic (gpt@tiny@64 on an AMD EPYC: bf16 blocks 9-10x fp32's) runs no bf16
    calibration step: its plans lose by far and keep the fp32 term; the user is told why."""
    from dataclasses import replace

    from hetsim.hardware.cluster import parse_cluster
    from hetsim.profiling.obtain import ProfileRequest
    from hetsim.profiling.store import ProfileSet
    from hetsim.types import Fit

    wl, prof, dev = gn_profile

    def with_bf16(k):
        return replace(_bf16_at(prof, k), calib_residual_s=Fit(intercept=0.0, slope=0.0), calib_residual_low_s={})

    assert calibrate.slowdown(with_bf16(5.0), "bf16") == pytest.approx(5.0)
    assert calibrate.slowdown(with_bf16(1.0), "fp16") == 1.0  # not profiled: nothing to compare
    ran, said = [], []
    monkeypatch.setattr(realruns, "measure",
                        lambda plan, **k: ran.append(plan.precision) or Measurement(status="ok", step_time_s=0.1))
    cluster = parse_cluster("emu:1.0@4G")
    req = ProfileRequest(root=tmp_path, global_batch=16, precisions=("fp32", "bf16"), repeats=1)
    for k, runs in ((5.0, []), (1.5, ["bf16", "bf16"])):
        ran.clear()
        out = calibrate.calibrate_devices(cluster, wl, ProfileSet(models={"emu-cpu": with_bf16(k)},
                                                                  devices={"emu-cpu": dev}), req, said.append)
        assert ran == runs
        assert ("bf16" in out.models["emu-cpu"].calib_residual_low_s) == bool(runs)
    assert any("not calibrating emu-cpu in bf16" in s and "5.0x" in s for s in said)
