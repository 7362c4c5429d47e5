"""Host-speed normalisation (hetsim.profiling.hostspeed): times taken beside a probe are compared at the
profiles' host speed; unprobed times (GPUs, old profiles) stay raw."""

from __future__ import annotations

import pytest
from hetsim.strategies.ddp import DDPPlan

from hetsim.execution.worker import RankResult, summarize_steps
from hetsim.profiling.hostspeed import ELASTICITY, at_ref, profile_ref, ref_of, shared_probes
from hetsim.profiling.store import ModelProfile
from hetsim.reporting import report
from hetsim.types import Fit, Measurement, MemoryBreakdown, Prediction


def test_times_are_scaled_by_their_own_probe():
    # A step of 1.0 s while the probe took 20 ms is a step of 0.5 s at a 10 ms host if the step
    # follows the probe one for one; it follows ELASTICITY of it: 0.5^0.7 = 0.616 s.
    assert at_ref([1.0, 2.0], [0.020, 0.010], 0.010, elasticity=1.0) == pytest.approx([0.5, 2.0])
    assert at_ref([1.0, 2.0], [0.020, 0.010], 0.010) == pytest.approx([0.5 ** ELASTICITY, 2.0])
    assert 0.5 < ELASTICITY < 1.0  # measured here 0.51-0.73 (hostspeed.ELASTICITY)


@pytest.mark.parametrize("probes, ref", [([0.02, 0.01], 0.0), ([0.02], 0.01), ([0.02, 0.0], 0.01), ([], 0.01)])
def test_unprobed_or_unreferenced_times_stay_raw(probes, ref):
    assert at_ref([1.0, 2.0], probes, ref) == [1.0, 2.0]


def test_reference_is_the_median_probe_ignoring_missing_ones():
    assert ref_of([0.03, 0.0, 0.01, 0.02]) == pytest.approx(0.02)
    assert ref_of([]) == 0.0


def _profile(probe_s: float) -> ModelProfile:
    return ModelProfile(model="m", device_kind="k", fingerprint={}, micro_batches=(1,), blocks=(),
                        opt_step_s={"adamw": Fit(intercept=0.0, slope=0.0)}, probe_s=probe_s)


def test_profile_reference_needs_one_probed_profile():
    assert profile_ref([_profile(0.016), _profile(0.0)]) == 0.016  # a GPU profile is not probed
    assert profile_ref([_profile(0.0)]) == 0.0
    assert profile_ref([_profile(0.016), _profile(0.020)]) == 0.0  # no common reference


def test_run_step_time_at_a_reference_speed_is_the_slowest_ranks_median():
    fast = RankResult(rank=0, status="ok", step_s=(1.0, 1.2, 1.1), probe_s=(0.02, 0.02, 0.02))
    slow = RankResult(rank=1, status="ok", step_s=(1.0, 2.0, 1.5), probe_s=(0.01, 0.04, 0.03))
    step, meds = summarize_steps([fast, slow])
    assert step == 1.5 and meds == (1.1, 1.5)
    # One probe per step for both ranks, their mean: 15, 30 and 25 ms.  At a 10 ms host each step
    # is scaled by (10 / probe)^ELASTICITY (0.75, 0.46, 0.53): rank 0's steps 0.75, 0.56, 0.58 and
    # rank 1's 0.75, 0.93, 0.79, so both medians are their third step.
    step, meds = summarize_steps([fast, slow], 0.010)
    third = (10 / 25) ** ELASTICITY
    assert meds == pytest.approx((1.1 * third, 1.5 * third)) and step == pytest.approx(1.5 * third)


def test_shared_probes_need_every_rank_probed_at_every_step():
    assert shared_probes([(0.02, 0.03), (0.01, 0.01)]) == pytest.approx([0.015, 0.02])
    assert shared_probes([(0.02, 0.03), ()]) == []
    assert shared_probes([(0.02, 0.03), (0.01,)]) == []
    assert shared_probes([(0.02, 0.03), (0.01, 0.0)]) == []  # an unprobed step
    unprobed = RankResult(rank=1, status="ok", step_s=(1.0, 2.0), probe_s=())
    probed = RankResult(rank=0, status="ok", step_s=(1.0, 3.0), probe_s=(0.02, 0.02))
    assert summarize_steps([probed, unprobed], 0.010)[1] == (2.0, 1.5)  # raw: no common probe


def test_measurement_at_reference_speed():
    m = Measurement(status="ok", step_time_s=0.8, probe_s=0.02, steps_per_probe=30.0)  # written before the exponent
    assert m.step_time_at(0.016) == pytest.approx(0.48)
    assert m.step_time_at(0.0) == 0.8
    assert Measurement(status="ok", step_time_s=0.8).step_time_at(0.016) == 0.8
    # Taken with the exponent: 0.8 s at a 20 ms probe is 0.8 x (16 / 20)^ELASTICITY at 16 ms.
    m = Measurement(status="ok", step_time_s=0.8, probe_s=0.02, steps_per_probe=0.8 / 0.02 ** ELASTICITY,
                    probe_elasticity=ELASTICITY)
    assert m.step_time_at(0.016) == pytest.approx(0.8 * 0.8 ** ELASTICITY)


def test_a_run_normalised_in_probe_units_reads_the_same_as_one_normalised_at_the_reference():
    """The runner keeps a run's step at a probe of 1 (`steps_per_probe`); turned back into a time at a
    profile's probe it must equal the steps normalised at that probe directly."""
    ranks = [RankResult(rank=0, status="ok", step_s=(0.9, 1.3, 1.0), probe_s=(0.018, 0.025, 0.02))]
    m = Measurement(status="ok", step_time_s=1.0, probe_s=0.02, steps_per_probe=summarize_steps(ranks, 1.0)[0],
                    probe_elasticity=ELASTICITY)
    assert m.step_time_at(0.016) == pytest.approx(summarize_steps(ranks, 0.016)[0])


def test_a_share_of_a_core_is_divided_out_whole():
    """Four ranks on two cores each get half a core: RunProbe's probe makes `at_ref` halve their step
    whatever the exponent, and normalise the probe's own change by the exponent."""
    from hetsim.profiling.hostspeed import with_share

    lone, share = 0.012, 2.0
    probe = with_share(lone, share)  # what RunProbe hands every rank
    assert at_ref([1.0], [probe], lone)[0] == pytest.approx(0.5)
    assert at_ref([1.0], [probe], 0.015)[0] == pytest.approx(0.5 * (0.015 / lone) ** ELASTICITY)
    assert with_share(lone, 1.0) == lone


def test_report_error_is_taken_at_the_profiles_host_speed():
    pred = Prediction(step_time_s=0.55, samples_per_s=58.2, peak_mem_bytes=(1,), memory=(MemoryBreakdown(),),
                      capacity_bytes=(2,), feasible=True)
    # 0.625 s raw while the probe took 20 ms (the profile's took 16 ms): 0.5 s at the profile's speed.
    meas = Measurement(status="ok", step_time_s=0.625, samples_per_s=51.2, peak_mem_bytes=(1,), probe_s=0.020,
                       steps_per_probe=0.625 / 0.020)
    row = report.Row(place=1, label="x", plan=DDPPlan(devices=(0,), local_batch=(32,)), predicted=pred,
                     measured=meas, ref_probe_s=0.016)
    assert report.host_speed(row) == pytest.approx(0.8)
    assert report.err_pct(row) == pytest.approx(10.0)
    raw = report.Row(place=1, label="x", plan=row.plan, predicted=pred, measured=meas)
    assert report.host_speed(raw) is None and report.err_pct(raw) == pytest.approx(-12.0)


def _probe_rank(rank: int, world: int, store_path: str, out_dir: str, cores: int) -> None:
    import json

    import torch.distributed as dist

    from hetsim.profiling import hostspeed

    hostspeed.host_cores = lambda: cores  # this host, as seen by the probe
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        probe = hostspeed.RunProbe()
        times = [probe() for _ in range(3)]
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump({"times": times, "probed": probe._probe is not None, "share": probe.share}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cores, share", [(2, 1.0), (1, 2.0)])
def test_run_probe_is_rank_0s_alone_and_every_rank_gets_it(tmp_path, cores, share):
    import json

    import torch.multiprocessing as mp

    mp.spawn(_probe_rank, args=(2, str(tmp_path / "store"), str(tmp_path), cores), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["probed"] and not r1["probed"]  # one rank times it; the other waits
    assert r0["times"] == r1["times"] and all(t > 0 for t in r0["times"])
    assert r0["share"] == r1["share"] == share  # two ranks on one core: each runs at half its speed


def test_run_probe_outside_a_process_group_times_its_own():
    from hetsim.profiling.hostspeed import RunProbe

    probe = RunProbe()
    assert probe() > 0 and probe.share == 1.0
