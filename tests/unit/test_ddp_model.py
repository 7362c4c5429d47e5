"""The data-parallel simulation and the exact batch-split solver."""

import itertools

import pytest
from hetsim.strategies.base import SearchContext
from hetsim.strategies.ddp import DDP, DDPPlan, buckets, data_parallel_memory
from hetsim.strategies.helpers import balance_batch, split_evenly
from pipeline_synth import synthetic_cost


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
    assert split_evenly(7, 3) == [3, 2, 2]
    assert sum(split_evenly(32, 4)) == 32


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


def _linear_scan_balance(cost, devices, global_batch, accum, precision, ckpt, floor, memory_fn):
    """The O(devices x batch) greedy that balance_batch replaced: the heap must give the same split."""
    n = cost.facts.n_blocks

    def step_time(i, b):
        d = devices[i]
        return sum(cost.fwd_s(d, 0, n, m, precision) + cost.bwd_s(d, 0, n, m, precision)
                   + cost.recompute_s(d, 0, n, m, precision, ckpt) + cost.overhead_s(d, m)
                   for m in split_evenly(b, accum)) + cost.opt_s(d, cost.param_count())

    def fits(i, b):
        return memory_fn(devices[i], -(-b // accum)).total_bytes <= cost.device(devices[i]).memory_bytes

    for respect_memory in (True, False):
        local = [floor] * len(devices)
        ok = True
        for _ in range(global_batch - floor * len(devices)):
            choices = [(step_time(i, local[i] + 1), i) for i in range(len(devices))
                       if not respect_memory or fits(i, local[i] + 1)]
            if not choices:
                ok = False
                break
            local[min(choices)[1]] += 1
        if ok:
            break
    return tuple(local), step_time, fits


@pytest.mark.parametrize("speeds", [(1.0, 0.5, 0.25), (1.0, 1.0, 0.5), (0.3, 1.0, 0.7, 0.7)])
def test_heap_balance_matches_linear_scan_and_brute_force(speeds):
    # Caps between what 3 and 4 samples (micro-batches) need: devices 0 and 2 can take at most 3 per micro-step.
    probe = synthetic_cost(speeds, [1e-3, 2e-3, 1.5e-3], act_bytes=[4e6, 4e6, 4e6], opt_s_per_param=1e-6)
    mem3 = data_parallel_memory(probe, 0, 3, "fp32", 0).total_bytes
    mem4 = data_parallel_memory(probe, 0, 4, "fp32", 0).total_bytes
    tight = str((mem3 + mem4) // 2)
    # No cap; caps on every other device; caps on all (small batches fit, larger ones ignore memory).
    for caps in (None, [tight if k % 2 == 0 else "4G" for k in range(len(speeds))], [tight] * len(speeds)):
        cost = synthetic_cost(speeds, [1e-3, 2e-3, 1.5e-3], act_bytes=[4e6, 4e6, 4e6], opt_s_per_param=1e-6,
                              caps=caps)
        devs = tuple(range(len(speeds)))

        def mem(d, micro, cost=cost):
            return data_parallel_memory(cost, d, micro, "fp32", 0)

        for gb, accum, floor in [(12, 1, 1), (13, 2, 2), (9, 1, 2), (16, 4, 4), (30, 1, 1)]:
            if floor * len(devs) > gb:
                continue
            got = balance_batch(cost, devs, gb, accum, "fp32", 0, floor)
            ref, step_time, fits = _linear_scan_balance(cost, devs, gb, accum, "fp32", 0, floor, mem)
            assert got == ref, (caps, gb, accum, floor)
            feasible = [s for s in itertools.product(range(floor, gb + 1), repeat=len(devs))
                        if sum(s) == gb and all(fits(i, b) for i, b in enumerate(s))]
            if feasible:  # memory respected: the greedy's slowest device is the best achievable
                best = min(max(step_time(i, b) for i, b in enumerate(s)) for s in feasible)
                assert all(fits(i, b) for i, b in enumerate(got))
                assert max(step_time(i, b) for i, b in enumerate(got)) == pytest.approx(best, rel=1e-12)


def test_micro_batches_are_their_own_tensors_on_the_rank_device():
    """Every executor's micro-batches: on a CPU their own storage (a view would keep, and MemTracker
    count, the whole global batch), and on the rank's device (the tensor-parallel executor once left
    them on the host, which a CUDA model refuses)."""
    import torch
    from hetsim.strategies.helpers import own_micro_batches

    x, y = torch.arange(20.0).view(10, 2), torch.arange(10)
    micro = own_micro_batches(x, y, 2, 8, [4, 2], torch.device("cpu"))
    assert [len(a) for a, _ in micro] == [4, 2]
    assert torch.equal(torch.cat([a for a, _ in micro]), x[2:8]) and torch.equal(torch.cat([b for _, b in micro]), y[2:8])
    assert all(a.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for a, _ in micro)
    moved = own_micro_batches(x, y, 0, 10, [5, 5], torch.device("meta"))
    assert all(a.device.type == b.device.type == "meta" for a, b in moved)
