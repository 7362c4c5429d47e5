"""The contract tests, parametrized over every (registered family, workload) case: `pytest --pyargs hetsim.testing`."""

from __future__ import annotations

import pytest

from hetsim import strategies
from hetsim.testing.contract import (
    cases,
    check_memory,
    check_plan_roundtrip,
    check_real_run_gradient,
    check_search_space,
    check_simulation,
    example_plans,
    structural_cost,
)

CASES = cases()
IDS = [f"{name}-{wl}" for name, wl in CASES]


def _examples(name, workload):
    """(the family's strategy, the workload's structural cost model, the family's example plans on it)."""
    cost = structural_cost(workload)
    return strategies.get(name), cost, example_plans(name, cost)


@pytest.mark.parametrize(("name", "workload"), CASES, ids=IDS)
def test_plans_roundtrip_through_json(name, workload):
    strat, _, plans = _examples(name, workload)
    for plan in plans:
        check_plan_roundtrip(strat, plan)


@pytest.mark.parametrize(("name", "workload"), CASES, ids=IDS)
def test_simulation_is_deterministic(name, workload):
    strat, cost, plans = _examples(name, workload)
    for plan in plans:
        check_simulation(strat, plan, cost)


@pytest.mark.parametrize(("name", "workload"), CASES, ids=IDS)
def test_memory_prediction_is_sane(name, workload):
    strat, cost, plans = _examples(name, workload)
    for plan in plans:
        check_memory(strat, plan, cost)


@pytest.mark.parametrize(("name", "workload"), CASES, ids=IDS)
def test_search_space_gives_valid_prefixed_plans(name, workload):
    check_search_space(strategies.get(name), structural_cost(workload))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "workload"), CASES, ids=IDS)
def test_real_run_matches_full_batch_gradient(name, workload, tmp_path):
    strat, cost, plans = _examples(name, workload)
    for i, plan in enumerate(plans):
        check_real_run_gradient(strat, plan, cost, workload, tmp_path / f"plan{i}")
