"""The stage-boundary solver: an exact DP, checked against brute force, memory caps respected."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hetsim.strategies._pipeline_bounds import (
    Lane,
    min_sum_plus_max,
    optimizer_tail,
    step_elements,
)
from hetsim.strategies._pipeline_memory import stage_state
from hetsim.strategies._pipeline_sched import inflight_counts, rank_actions
from pipeline_synth import synthetic_cost

from hetsim import strategies
from hetsim.errors import InfeasiblePlanError

PIPE = strategies.get("pipeline")


def all_boundaries(n_blocks: int, n_stages: int):
    for cuts in itertools.combinations(range(1, n_blocks), n_stages - 1):
        yield (0, *cuts, n_blocks)


def brute(n_blocks, n_stages, elem, weight):
    best = math.inf
    for b in all_boundaries(n_blocks, n_stages):
        es = [elem(s, b[s], b[s + 1]) for s in range(n_stages)]
        if any(e is None for e in es):
            continue
        best = min(best, sum(e[0] for e in es) + weight * max(e[1] for e in es))
    return best


def objective(elem, bounds, weight):
    es = [elem(s, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]
    assert all(e is not None for e in es)
    return sum(e[0] for e in es) + weight * max(e[1] for e in es)


def test_dp_matches_brute_force_on_random_tables():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 7)
        S = rng.randint(1, min(4, n))
        weight = rng.choice([0.0, 1.0, 3.0, 10.0])
        table = {}
        for s in range(S):
            for lo in range(n):
                for hi in range(lo + 1, n + 1):
                    table[(s, lo, hi)] = None if rng.random() < 0.15 else (rng.random(), rng.random())

        def elem(s, lo, hi, table=table):
            return table.get((s, lo, hi))

        want = brute(n, S, elem, weight)
        if want == math.inf:
            with pytest.raises(InfeasiblePlanError):
                min_sum_plus_max(S, n, elem, weight)
            continue
        got, bounds = min_sum_plus_max(S, n, elem, weight)
        assert got == pytest.approx(want)
        assert objective(elem, bounds, weight) == pytest.approx(want)


@pytest.mark.parametrize("schedule,m", [("GPipe", 1), ("GPipe", 4), ("1F1B", 4), ("1F1B", 8)])
def test_solver_is_optimal_for_its_objective_on_a_cost_model(schedule, m):
    rng = random.Random(1)
    fwd = [rng.uniform(0.5e-3, 3e-3) for _ in range(8)]
    devices = (1, 0, 2)
    cost = synthetic_cost([1.0, 0.5, 0.8], fwd, out_bytes=[rng.randint(10_000, 200_000) for _ in fwd],
                          param_counts=[rng.randint(1_000, 100_000) for _ in fwd], p2p_s_per_byte=1e-8,
                          opt_s_per_param=1e-8)
    plan = PIPE.solve(cost, devices, schedule=schedule, microbatches=m, batch=4 * m)
    inflight = inflight_counts(rank_actions(schedule, 3, m, 1), 3)
    elem = step_elements(cost, [Lane(devices, 4)], 3, "fp32", 0, inflight, optimizer_tail(cost))
    assert objective(elem, plan.boundaries, m - 1) == pytest.approx(brute(8, 3, elem, m - 1))


def test_memory_caps_are_respected():
    """A small device forces the split away from the unconstrained optimum; every stage still fits."""
    fwd = [1e-3] * 6
    params = [10_000, 10_000, 200_000, 200_000, 10_000, 10_000]
    free = synthetic_cost([1.0, 1.0], fwd, param_counts=params)
    capped = synthetic_cost([1.0, 1.0], fwd, param_counts=params, caps=["4G", "3M"])
    unconstrained = PIPE.solve(free, (0, 1), schedule="GPipe", microbatches=4, batch=16)
    plan = PIPE.solve(capped, (0, 1), schedule="GPipe", microbatches=4, batch=16)
    assert plan.boundaries != unconstrained.boundaries
    for r, mem in enumerate(PIPE.memory(plan, capped)):
        assert mem.total_bytes <= capped.device(plan.devices[r]).memory_bytes
    # ... and it is the best of the splits that fit.
    inflight = inflight_counts(rank_actions("GPipe", 2, 4, 1), 2)
    elem = step_elements(capped, [Lane((0, 1), 4)], 2, "fp32", 0, inflight, optimizer_tail(capped))
    assert objective(elem, plan.boundaries, 3) == pytest.approx(brute(6, 2, elem, 3))
    pred, _, _ = PIPE.predict(plan, capped)
    assert pred.feasible


def test_nothing_fits_is_infeasible():
    cost = synthetic_cost([1.0, 1.0], [1e-3] * 4, param_counts=[1_000_000] * 4, caps=["1M", "1M"])
    with pytest.raises(InfeasiblePlanError, match="memory"):
        PIPE.solve(cost, (0, 1), schedule="GPipe", microbatches=1, batch=4)


def test_stage_state_counts_adamw_state():
    cost = synthetic_cost([1.0], [1e-3] * 3, param_counts=[10, 20, 30])
    assert stage_state(cost, 1, 3) == (200, 200, 400)


@pytest.mark.parametrize("schedule,m", [("GPipe", 4), ("1F1B", 4)])
def test_dp_split_is_near_the_simulated_best(schedule, m):
    """The DP minimises an analytic step time; the event simulation of its split stays within
    5% of the best simulated split found by trying them all (heterogeneous devices and blocks)."""
    rng = random.Random(2)
    fwd = [rng.uniform(0.5e-3, 3e-3) for _ in range(7)]
    cost = synthetic_cost([1.0, 0.5, 0.8], fwd, out_bytes=[50_000] * 7, p2p_s_per_byte=1e-8)
    plan = PIPE.solve(cost, (0, 1, 2), schedule=schedule, microbatches=m, batch=4 * m)
    got = PIPE.predict(plan, cost)[0].step_time_s
    best = min(
        PIPE.predict(PIPE.plan_type(devices=(0, 1, 2), boundaries=b, schedule=schedule, microbatches=m,
                                    batch=4 * m), cost)[0].step_time_s
        for b in all_boundaries(7, 3)
    )
    assert got <= best * 1.05
