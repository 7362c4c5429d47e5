"""Block times that fall as the batch grows (oneDNN changing kernels): the profile keeps the drop,
the cost model says so, and the data-parallel split is searched exactly around it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetsim.model.batchsplit import min_max_split
from hetsim.types import Fit


def _brute(n: int, total: int, floor: int, time_of) -> float:
    best = float("inf")
    for split in itertools.product(range(floor, total + 1), repeat=n):
        if sum(split) == total:
            best = min(best, max(time_of(i, b) for i, b in enumerate(split)))
    return best


def _cliff(at: int, before: float, after: float):
    """Per-sample time `before` below `at` samples and `after` from it on (resnet50@64 fp32: 38 and 17 ms)."""
    return lambda b: b * (before if b < at else after)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(4, 24), speeds=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=2, max_size=3),
       at=st.integers(3, 12))
def test_exact_split_is_optimal_when_time_falls_with_the_batch(total, speeds, at):
    step = _cliff(at, 0.038, 0.017)

    def time_of(i, b):
        return step(b) / speeds[i]

    if total < len(speeds):
        return
    split = min_max_split(len(speeds), total, 1, time_of, monotone=False)
    assert sum(split) == total and min(split) >= 1
    assert max(time_of(i, b) for i, b in enumerate(split)) == pytest.approx(_brute(len(speeds), total, 1, time_of))


def test_the_greedy_split_stops_short_of_the_cliff_and_the_exact_one_does_not():
    """Two devices, the second half as fast, 32 samples: the greedy gives the slow device 10 (on the
    slow side of a cliff at 16); the exact split finds a better one."""
    step = _cliff(16, 0.038, 0.017)

    def time_of(i, b):
        return step(b) * (1 if i == 0 else 2)

    greedy = min_max_split(2, 32, 2, time_of)
    exact = min_max_split(2, 32, 2, time_of, monotone=False)

    def slowest(s):
        return max(time_of(i, b) for i, b in enumerate(s))

    assert slowest(exact) < slowest(greedy)
    assert slowest(exact) == pytest.approx(_brute(2, 32, 2, time_of))


def test_cost_model_says_when_a_profile_keeps_a_drop(gn_profile):
    """`monotone_in_batch` is false where one block's knots fall, and `balance_batch` then splits exactly."""
    from hetsim.hardware.cluster import parse_cluster
    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.store import ProfileSet
    from hetsim.testing.contract import synthetic_comms
    from strategies.helpers import _data_parallel_step_time, balance_batch

    wl, model, dev = gn_profile

    def cost_of(prof) -> CostModel:
        cluster = parse_cluster("emu:1.0@4G,0.5@4G")
        ps = ProfileSet(models={"emu-cpu": prof}, devices={"emu-cpu": dev}, comm=synthetic_comms(2))
        return CostModel(cluster, ps, "adamw", has_batchnorm=wl.has_batchnorm)

    assert cost_of(model).monotone_in_batch(0) and cost_of(model).monotone_in_batch(1)
    blocks = list(model.blocks)
    t = blocks[0].timing["fp32"]
    big = 10 * sum(b.timing["fp32"].fwd_s(31) + b.timing["fp32"].bwd_s(31) for b in model.blocks)
    drop = Fit(intercept=0.0, slope=0.0, knots=((2.0, big * 0.1), (8.0, big * 0.4), (15.0, big), (16.0, big * 0.2),
                                                (31.0, big * 0.4)))
    blocks[0] = dataclasses.replace(blocks[0], timing={**blocks[0].timing, "fp32": dataclasses.replace(t, fwd_s=drop)})
    cliff = cost_of(dataclasses.replace(model, blocks=tuple(blocks)))
    assert not cliff.monotone_in_batch(0)
    local = balance_batch(cliff, (0, 1), 32, 1, "fp32", 0, 2)
    step = _data_parallel_step_time(cliff, (0, 1), 1, "fp32", 0, False)
    assert max(step(i, b) for i, b in enumerate(local)) == pytest.approx(_brute(2, 32, 2, step))
    assert all(not 9 <= b <= 15 for b in local)  # nobody is left on the slow side of the drop
