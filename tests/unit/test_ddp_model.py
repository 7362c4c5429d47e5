"""The data-parallel simulation and the exact batch-split solver."""

import itertools

import pytest
from hetsim.strategies.base import SearchContext
from hetsim.strategies.ddp import DDP, DDPPlan, balance_batch, buckets, micro_sizes


def _step(cost, devices, local, accum=1):
    plan = DDPPlan(devices=devices, local_batch=local, accum_steps=accum)
    return DDP().predict(plan, cost)[0].step_time_s


def test_balance_is_optimal_against_brute_force(make_cost):
    cost = make_cost("emu:1.0@4G,0.5@4G,0.25@4G")
    devs = (0, 1, 2)
    gb = 12
    n = cost.facts.n_blocks

    def compute(i, b):
        d = devs[i]
        return (cost.fwd_s(d, 0, n, b) + cost.bwd_s(d, 0, n, b) + cost.overhead_s(d, b)
                + cost.opt_s(d, cost.param_count()))

    got = balance_batch(cost, devs, gb, 1, "fp32", 0, 1)
    assert sum(got) == gb
    best = min(
        max(compute(i, b) for i, b in enumerate(split))
        for split in itertools.product(range(1, gb), repeat=3) if sum(split) == gb
    )
    assert max(compute(i, b) for i, b in enumerate(got)) == pytest.approx(best)


def test_faster_device_gets_more_samples(make_cost):
    cost = make_cost("emu:1.0@4G,0.5@4G")
    local = balance_batch(cost, (0, 1), 32, 1, "fp32", 0, 1)
    assert local[0] > local[1] and sum(local) == 32


def test_balanced_split_beats_uniform_in_simulation(make_cost):
    cost = make_cost("emu:1.0@4G,0.5@4G")
    local = balance_batch(cost, (0, 1), 32, 1, "fp32", 0, 1)
    assert _step(cost, (0, 1), local) < _step(cost, (0, 1), (16, 16))


def test_slow_device_dominates_step(make_cost):
    cost = make_cost("emu:1.0@4G,0.5@4G")
    n = cost.facts.n_blocks
    t = _step(cost, (0, 1), (16, 16))
    slow = cost.fwd_s(1, 0, n, 16) + cost.bwd_s(1, 0, n, 16) + cost.opt_s(1, cost.param_count())
    assert t >= slow


def test_accumulation_splits_micro_batches():
    assert micro_sizes(7, 3) == [3, 2, 2]
    assert sum(micro_sizes(32, 4)) == 32


def test_buckets_cover_every_parameter(make_cost):
    cost = make_cost()
    assert sum(b for _, b in buckets(cost)) == cost.param_bytes()


def test_memory_cap_bounds_the_split(make_cost):
    cost = make_cost("emu:1.0@4G,0.5@4G")
    free = balance_batch(cost, (0, 1), 64, 1, "fp32", 0, 1)
    # A cap just above what 8 samples need forces device 0 to take at most 8.
    from hetsim.strategies.ddp import data_parallel_memory
    cap8 = data_parallel_memory(cost, 0, 8, "fp32", 0).total_bytes
    capped = make_cost(f"emu:1.0@{cap8 + 1024},0.5@4G")
    got = balance_batch(capped, (0, 1), 64, 1, "fp32", 0, 1)
    assert got[0] <= 8 < free[0]


def test_infeasible_when_batch_too_small(make_cost):
    from hetsim.errors import InfeasiblePlanError

    cost = make_cost("emu:1.0@4G,0.5@4G")
    with pytest.raises(InfeasiblePlanError, match="global batch 3"):
        balance_batch(cost, (0, 1), 3, 2, "fp32", 0, 1)


def test_baseline_is_uniform(make_cost):
    cost = make_cost("emu:1.0@4G,0.5@4G")
    plan = DDP().baseline(SearchContext(cost=cost, global_batch=33))
    assert plan.local_batch == (17, 16) and plan.devices == (0, 1)
