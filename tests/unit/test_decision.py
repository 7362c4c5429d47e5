"""Decision quality (Kendall's tau, top-1 regret) and prediction intervals, on synthetic rows: what
every report's accuracy line and the fidelity bench compute (hetsim.reporting.decision)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hetsim.search import golden
from hetsim.strategies.ddp import DDPPlan

from hetsim.hardware.cluster import Cluster, Device
from hetsim.profiling.measure import rel_mad
from hetsim.profiling.store import ModelProfile, load, save
from hetsim.reporting import decision, report
from hetsim.types import Measurement, MemoryBreakdown, Prediction

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def _row(rank: int, pred_step_s: float, meas_step_s: float | None, *, status: str = "ok", batch: int = 32,
         ref_probe_s: float = 0.0, probe_s: float | None = None, spread: float | None = None) -> report.Row:
    pred = Prediction(step_time_s=pred_step_s, samples_per_s=batch / pred_step_s, peak_mem_bytes=(MiB,),
                      memory=(MemoryBreakdown(params_bytes=MiB),), capacity_bytes=(4 * MiB,), feasible=True)
    if status != "ok":
        meas = Measurement(status=status, error="boom")
    else:
        meas = Measurement(status="ok", step_time_s=meas_step_s, samples_per_s=batch / meas_step_s,
                           peak_mem_bytes=(MiB,), probe_s=probe_s,
                           steps_per_probe=meas_step_s / probe_s if probe_s else None)
    return report.Row(place=rank, label=f"plan{rank}", plan=DDPPlan(devices=(0,), local_batch=(batch,)),
                      predicted=pred, measured=meas, ref_probe_s=ref_probe_s, timing_spread=spread)


# ----------------------------------------------------------------------------- tau and regret


def test_kendall_tau_with_ties_and_its_one_home():
    assert decision.kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # tau-b: a tie on both sides counts in neither denominator; a tie on one side in that side's.
    assert decision.kendall_tau([1, 1, 2], [5, 5, 6]) == pytest.approx(1.0)
    assert decision.kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / 6**0.5)
    assert decision.kendall_tau([1, 1], [1, 2]) == 0.0  # no pair is ordered on both sides
    with pytest.raises(ValueError):
        decision.kendall_tau([1.0], [1.0])
    assert golden.kendall_tau is decision.kendall_tau  # the bench and the gate use the same rule


def test_top1_regret_zero_when_the_predicted_best_ran_fastest():
    assert decision.top1_regret([10, 20, 30], [11, 19, 33]) == 0.0


def test_top1_regret_is_the_measured_shortfall_of_the_predicted_best():
    # Predicted best: index 2 (30); it measured 24 against a best of 32: regret 1 - 24/32.
    assert decision.top1_regret([10, 20, 30], [32, 19, 24]) == pytest.approx(0.25)


def test_top1_regret_takes_the_slowest_among_tied_best_predictions():
    assert decision.predicted_best([30, 10, 30], [29, 40, 20]) == 2
    assert decision.top1_regret([30, 10, 30], [29, 40, 20]) == pytest.approx(0.5)


def test_decision_quality_of_one_plan_and_of_none():
    one = decision.decision_quality([(5.0, 4.0)])
    assert (one.n_plans, one.kendall_tau, one.top1_regret, one.predicted_best) == (1, None, 0.0, 0)
    none = decision.decision_quality([])
    assert (none.n_plans, none.kendall_tau, none.top1_regret) == (0, None, None)


def test_report_excludes_failed_runs_from_tau_and_regret():
    rows = [
        _row(1, 0.10, None, status="oom"),  # predicted fastest but ran out of memory: not in the figures
        _row(2, 0.20, 0.30),
        _row(3, 0.25, 0.24),  # measured fastest
        _row(4, 0.40, 0.41),
    ]
    a = report.accuracy(rows)
    assert a["executed_ok"] == 3
    assert a["top1_plan"] == "plan2"
    assert a["top1_regret"] == pytest.approx(1 - 0.24 / 0.30)
    assert a["kendall_tau"] == pytest.approx(decision.kendall_tau([1 / 0.2, 1 / 0.25, 1 / 0.4],
                                                                  [1 / 0.3, 1 / 0.24, 1 / 0.41]))
    assert a["kendall_tau"] == pytest.approx(1 / 3)
    assert a["oom_predicted_to_fit"] == 1


def test_report_compares_throughput_at_the_profiles_host_speed():
    # Raw, plan 2 ran faster (0.30 s against 0.32 s); but it ran while the host was fast (probe 10 ms
    # against 20 ms): at the profiles' host speed (16 ms) it is 0.48 s against 0.256 s.
    rows = [_row(1, 0.25, 0.32, ref_probe_s=0.016, probe_s=0.020),
            _row(2, 0.20, 0.30, ref_probe_s=0.016, probe_s=0.010)]
    a = report.accuracy(rows)
    assert a["top1_plan"] == "plan2"
    assert a["top1_regret"] == pytest.approx(1 - 0.256 / 0.48)
    assert a["kendall_tau"] == pytest.approx(-1.0)


# ----------------------------------------------------------------------------- intervals


def test_interval_half_width_has_a_floor():
    assert decision.interval_rel(None) == decision.NOISE_FLOOR_REL
    assert decision.interval_rel(0.001) == decision.NOISE_FLOOR_REL
    assert decision.interval_rel(0.04) == pytest.approx(decision.SPREAD_K * 0.04)
    # the band is the printed step error's, against the measured step: (1.0 - 1.05) / 1.05 = -4.8 % is
    # inside +-5 %, (1.0 - 0.95) / 0.95 = +5.3 % is not
    assert not decision.outside_interval(1.0, 1.05, 0.05)
    assert not decision.outside_interval(1.0, 1 / 1.049, 0.05)
    assert decision.outside_interval(1.0, 0.95, 0.05)
    assert decision.outside_interval(1.0, 1.06, 0.05) and decision.outside_interval(1.0, 0.94, 0.05)


def test_a_row_is_marked_outside_exactly_when_its_printed_error_is():
    from hetsim.reporting.metrics import rel_err

    for meas in (0.90, 0.94, 0.951, 0.96, 1.0, 1.04, 1.051, 1.06):
        assert decision.outside_interval(1.0, meas, 0.05) == (abs(rel_err(1.0, meas)) > 0.05), meas


def test_report_marks_measurements_outside_the_interval(tmp_path):
    rows = [_row(1, 0.20, 0.23, spread=0.02),  # +15 %: outside +-6 %
            _row(2, 0.25, 0.26, spread=0.02),  # +4 %: inside
            _row(3, 0.30, None, status="timeout", spread=0.02)]
    a = report.accuracy(rows)
    assert a["interval_rel"] == pytest.approx(0.06)
    assert (a["outside_interval"], a["outside_interval_plans"]) == (1, ["plan1"])
    devs = (Device(name="d0", kind="emu-cpu", memory_bytes=4 * MiB, index=0),)
    data = report.ReportData(study="s", model="mlp", cluster=Cluster(spec="x.toml", source="file", devices=devs),
                             global_batch=32, candidates=rows, baseline=None, trials=[])
    col = report.header(data).index("in interval")
    assert [r[col] for r in report.table_rows(data)] == ["OUT", "yes", "-"]
    line = report.accuracy_line(report.summary(data))
    assert "Kendall tau 1.00, top-1 regret 0.0% (predicted best: plan1)" in line
    assert ("1 of 2 measured steps outside their prediction's interval (step error beyond +-6.0%: "
            "3 x profile spread 2.0%)") in line
    folder = report.write(data, tmp_path)
    summary = json.loads((folder / "summary.json").read_text())["accuracy"]
    assert summary["outside_interval"] == 1 and summary["top1_plan"] == "plan1"
    assert "top-1 regret" in (folder / "report.md").read_text()
    assert "top-1 regret" in (folder / "report.html").read_text()


def test_accuracy_line_says_when_the_spread_is_unknown_or_one_plan_ran():
    a = report.accuracy([_row(1, 0.20, 0.21)])
    text = decision.decision_text({**a})
    assert "Kendall tau n/a" in text and "top-1 regret 0.0%" in text
    assert ("0 of 1 measured steps outside their prediction's interval (step error beyond +-5.0%: the noise floor; "
            "profile spread unknown)") in text


# ----------------------------------------------------------------------------- the recorded spread


def test_rel_mad():
    assert rel_mad([1.0, 1.1, 0.8]) == pytest.approx(0.1)
    assert rel_mad([2.0, 2.0, 2.0]) == 0.0


def test_committed_format3_profile_loads_with_unknown_spread_and_the_field_round_trips(tmp_path):
    path = ROOT / "results" / "profiles" / "emu-cpu" / "model-resnet18@64.json"
    raw = json.loads(path.read_text())
    assert "timing_spread" not in raw and raw["fingerprint"]["format"] == "3"
    prof = load(ModelProfile, path)
    assert prof.timing_spread is None
    assert decision.profile_spread([prof]) is None
    new = dataclasses.replace(prof, timing_spread=0.012)
    save(new, tmp_path / "p.json")
    again = load(ModelProfile, tmp_path / "p.json")
    assert again.timing_spread == pytest.approx(0.012)
    assert decision.profile_spread([prof, again]) == pytest.approx(0.012)


def test_bench_accuracy_carries_the_regret():
    recs = [{"status": "ok", "pred_step_time_s": p, "meas_step_time_s": m, "pred_peak_mem_bytes": [1],
             "meas_peak_mem_bytes": [1]} for p, m in ((0.2, 0.3), (0.25, 0.24), (0.4, 0.41))]
    recs.append({"status": "oom", "pred_step_time_s": 0.1, "meas_step_time_s": None})
    acc = golden.accuracy_of(recs)
    assert acc.n_plans == 3
    assert acc.top1_regret == pytest.approx(1 - 0.24 / 0.3)


def test_profile_model_times_every_point_in_interleaved_rounds(monkeypatch):
    """Each point is timed once per round, the rounds over every micro-batch size in alternating order,
    and the median kept; round 0 warms up and its timings (here 3x the others) are dropped; the
    profile's spread is that of the whole model's timings across the kept rounds (here 10 %, relative
    MAD)."""
    import torch

    from hetsim.profiling import measure
    from hetsim.workloads.builtin import load_workload

    order, calls, now = [], [], {}
    real = measure._measure_micro_batch

    def spy(m, model, prec, mb, first):
        order.append((m.round, mb))
        now["round"] = m.round
        return real(m, model, prec, mb, first)

    def fake_times(fn, device, reps, warmup=1):  # every timing of round r takes the r-th value
        fn()
        calls.append(reps)
        return [(0.030, 0.010, 0.011, 0.008)[now.get("round", 0)]] * reps

    class FixedProbe:  # a steady host: times at the reference speed are the raw ones
        def __call__(self):
            return 0.016

    monkeypatch.setattr(measure, "_measure_micro_batch", spy)
    monkeypatch.setattr(measure, "_times", fake_times)
    monkeypatch.setattr(measure, "HostProbe", FixedProbe)
    monkeypatch.setattr(measure, "REFINE_CHECKS", 0)  # sizes between these: test_refine_sizes_*
    torch.set_num_threads(1)
    prof = measure.profile_model(load_workload("mlp", 32), "emu-cpu", torch.device("cpu"), (2, 4), ("fp32",))
    assert order == [(0, 2), (0, 4), (1, 4), (1, 2), (2, 2), (2, 4), (3, 4), (3, 2)]
    assert calls and prof.timing_spread == pytest.approx(0.1)
    assert all(b.timing["fp32"].fwd_s(mb) == pytest.approx(0.010) for b in prof.blocks for mb in (2, 4))
    assert prof.fingerprint["format"] == measure.FORMAT == "9"
    # Each block's linear saves its input and its ReLU its output; the output layer ends in a linear.
    assert [(b.saves_input["fp32"], b.saves_output["fp32"]) for b in prof.blocks] == \
        [(True, True)] * (len(prof.blocks) - 1) + [(True, False)]


@pytest.mark.parametrize("cliff, knots", [(None, [2, 16, 31]), (14, [2, 9, 12, 13, 14, 16, 31])])
def test_refine_sizes_times_more_sizes_only_where_time_is_not_linear(monkeypatch, cliff, knots):
    """Between two profiled sizes the midpoint is checked; where the whole model is off the line there
    (here: every block costs 3x per sample below `cliff` samples), it becomes a knot of every block,
    timed as often as the others, and both halves are checked in turn; a linear midpoint is dropped."""
    import torch

    from hetsim.profiling import measure
    from hetsim.workloads.builtin import load_workload

    now, passes = {}, []
    real = measure._measure_micro_batch

    def spy(m, model, prec, mb, first):
        now["mb"] = mb
        if m.round == 3:
            passes.append(mb)
        return real(m, model, prec, mb, first)

    def per_sample() -> float:
        return 0.003 if cliff is not None and now["mb"] < cliff else 0.001

    def fake_times(fn, device, reps, warmup=1):
        fn()
        return [per_sample() * now["mb"]] * reps

    class FixedProbe:
        def __call__(self):
            return 0.016

    monkeypatch.setattr(measure, "_measure_micro_batch", spy)
    monkeypatch.setattr(measure, "_times", fake_times)
    monkeypatch.setattr(measure, "HostProbe", FixedProbe)
    torch.set_num_threads(1)
    prof = measure.profile_model(load_workload("mlp", 32), "emu-cpu", torch.device("cpu"), (2, 16, 31), ("fp32",))
    fwd = prof.blocks[0].timing["fp32"].fwd_s
    assert [x for x, _ in fwd.knots] == knots
    for x in knots:
        now["mb"] = x
        assert fwd(x) == pytest.approx(per_sample() * x)
    assert passes.count(23) == 2  # checked (a warm-up pass and a timed one), linear: dropped
    if cliff is not None:
        assert passes.count(9) == 1 + 3 and fwd(14) < fwd(13)  # a knot: warm-up, then three rounds


@pytest.mark.parametrize("cosine, floor, timed", [(0.19, 0.999, False), (0.97, None, True), (0.19, 0.42, True)])
def test_a_precision_whose_gradient_is_refused_is_not_timed(monkeypatch, cosine, floor, timed):
    """A low precision whose gradient cosine refuses its plans (0.19 where rounding the weights alone
    leaves 0.999) is neither timed nor memory-calibrated, and says so; its cosines and the asked
    precisions stay in the profile, so its plans are still refused and the stored profile still
    matches the request.  One that passes is timed as before, and so is one whose model's gradient
    moves about as far from rounding alone (BatchNorm resnet50 at initialisation: bf16 0.16 beside
    0.42; it trains in bf16 on an H200, 1.26x faster than fp32)."""
    import torch

    from hetsim.model.costmodel import precision_problem
    from hetsim.profiling import measure, precision
    from hetsim.workloads.builtin import load_workload

    timed_precs, said = [], []
    real = measure._measure_micro_batch

    def spy(m, model, prec, mb, first):
        timed_precs.append(prec)
        return real(m, model, prec, mb, first)

    monkeypatch.setattr(precision, "grad_cosine", lambda workload, device, precision, mb: cosine)
    monkeypatch.setattr(precision, "rounding_cosine", lambda workload, device, precision, mb: floor)
    monkeypatch.setattr(measure, "_measure_micro_batch", spy)
    torch.set_num_threads(1)
    prof = measure.profile_model(load_workload("mlp", 32), "emu-cpu", torch.device("cpu"), (2, 4), ("fp32", "bf16"),
                                 reps=1, progress=said.append)
    assert ("bf16" in timed_precs) is timed and "fp32" in timed_precs
    assert ("bf16" in prof.blocks[0].timing) is timed and ("bf16" in prof.memory.saved_bytes) is timed
    assert prof.grad_cosine == {"bf16": cosine} and prof.fingerprint["precisions"] == "fp32,bf16"
    assert prof.grad_cosine_floor == ({} if floor is None else {"bf16": floor})  # measured below 0.9 only
    assert (precision_problem(prof, "bf16") is None) is timed
    assert any(s.startswith("not timing mlp in bf16 on emu-cpu: ") and "0.19" in s for s in said) is not timed


@pytest.mark.parametrize("slower, rounds", [(10.0, 1), (1.5, 4)])
def test_a_precision_far_slower_than_fp32_is_timed_in_one_round(monkeypatch, slower, rounds):
    """A low precision whose blocks take more than `LOW_PRECISION_SKIP` times fp32's in the warm-up round
    (bf16 on a CPU without bf16 arithmetic: 9-15x) is not timed again in later rounds, and says so;
    its one round's timings stay in the profile (its plans are predicted, and lose).  One that is not
    far slower is timed in every round (the warm-up round and three more)."""
    import torch

    from hetsim.profiling import measure, precision
    from hetsim.workloads.builtin import load_workload

    order, now, said = [], {}, []
    real = measure._measure_micro_batch

    def spy(m, model, prec, mb, first):
        order.append((m.round, prec))
        now["prec"] = prec
        return real(m, model, prec, mb, first)

    def fake_times(fn, device, reps, warmup=1):  # every timing in bf16 takes `slower` times fp32's
        fn()
        return [0.010 * (slower if now.get("prec") == "bf16" else 1.0)] * reps

    class FixedProbe:
        def __call__(self):
            return 0.016

    monkeypatch.setattr(precision, "grad_cosine", lambda workload, device, precision, mb: 0.99)
    monkeypatch.setattr(measure, "_measure_micro_batch", spy)
    monkeypatch.setattr(measure, "_times", fake_times)
    monkeypatch.setattr(measure, "HostProbe", FixedProbe)
    torch.set_num_threads(1)
    prof = measure.profile_model(load_workload("mlp", 32), "emu-cpu", torch.device("cpu"), (2, 4), ("fp32", "bf16"),
                                 reps=3, progress=said.append)
    assert sorted({r for r, p in order if p == "bf16"}) == list(range(rounds))
    assert sorted({r for r, p in order if p == "fp32"}) == [0, 1, 2, 3]
    assert all(b.timing["bf16"].fwd_s(4) == pytest.approx(0.010 * slower) for b in prof.blocks)
    assert any(s.startswith("timing mlp in bf16 once: its blocks took 10.0x") for s in said) is (rounds == 1)


def test_a_precision_the_model_fails_under_is_refused_not_a_crash(monkeypatch):
    """A model that raises under a low precision's autocast (an nn.LSTM under CPU bf16 autocast on a CPU
    without bf16: oneDNN has no primitive) is not timed in it; the profile keeps the error, which
    refuses that precision's plans with a message naming the model and the fix."""
    import torch

    from hetsim.model.costmodel import precision_problem
    from hetsim.profiling import measure, precision
    from hetsim.workloads.builtin import load_workload

    def fails(workload, device, precision, mb):
        raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive. "
                           "Run workload with environment variable ONEDNN_VERBOSE=all")

    said = []
    monkeypatch.setattr(precision, "grad_cosine", fails)
    torch.set_num_threads(1)
    prof = measure.profile_model(load_workload("mlp", 32), "emu-cpu", torch.device("cpu"), (2, 4), ("fp32", "bf16"),
                                 reps=1, progress=said.append)
    assert "bf16" not in prof.blocks[0].timing and "fp32" in prof.blocks[0].timing
    assert prof.precision_failed == {"bf16": "RuntimeError: could not create a primitive descriptor for the LSTM "
                                              "forward propagation primitive"}
    why = precision_problem(prof, "bf16")
    assert why and "fails under bf16 autocast" in why and "use fp32" in why and prof.model in why
    assert precision_problem(prof, "fp32") is None
    assert any(s.startswith("not timing mlp in bf16 on emu-cpu: it fails under bf16 autocast") for s in said)


def test_rounding_cosine_measures_how_far_rounding_the_weights_moves_the_gradient():
    """On a model whose gradient is stable, rounding the weights to bf16 barely moves it; a precision
    that breaks the gradient moves it far further and is refused, a chaotic model's is not."""
    import torch

    from hetsim.model.costmodel import cosine_refuses
    from hetsim.profiling.precision import rounding_cosine
    from hetsim.workloads.builtin import load_workload

    torch.set_num_threads(1)
    floor = rounding_cosine(load_workload("mlp", 32), torch.device("cpu"), "bf16", 8)
    assert 0.99 < floor <= 1.0 + 1e-6
    assert cosine_refuses(0.5, floor) and cosine_refuses(0.5, None)
    assert not cosine_refuses(0.95, floor) and not cosine_refuses(0.16, 0.42)
