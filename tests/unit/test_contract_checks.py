"""The contract checks of hetsim.testing fail on a family that breaks the contract (they are not checks that can only pass)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hetsim.strategies.ddp import DDP

from hetsim.testing import (
    check_memory,
    check_plan_roundtrip,
    check_search_space,
    check_simulation,
    example_plans,
    structural_cost,
)


@pytest.fixture(scope="module")
def cost():
    return structural_cost("mlp")


def test_a_well_behaved_family_passes(cost):
    ddp = DDP()
    for plan in example_plans("ddp", cost):
        check_plan_roundtrip(ddp, plan)
        check_simulation(ddp, plan, cost)
        check_memory(ddp, plan, cost)
    check_search_space(ddp, cost)


def test_unprefixed_search_parameters_fail(cost):
    class Bare(DDP):
        param_prefix = None  # claims the default prefix "ddp." ...

        def param(self, knob: str) -> str:  # ... but suggests bare names
            return knob

    with pytest.raises(AssertionError, match="lack its prefix 'ddp.'"):
        check_search_space(Bare(), cost)


def test_negative_memory_fails(cost):
    class Negative(DDP):
        def memory(self, plan, cost):
            return tuple(dataclasses.replace(m, other_bytes=-1) for m in super().memory(plan, cost))

    plan = example_plans("ddp", cost)[0]
    with pytest.raises(AssertionError, match="negative category"):
        check_memory(Negative(), plan, cost)


def test_missing_parameters_fail(cost):
    class Forgetful(DDP):
        def memory(self, plan, cost):
            return tuple(dataclasses.replace(m, params_bytes=0) for m in super().memory(plan, cost))

    plan = example_plans("ddp", cost)[0]
    with pytest.raises(AssertionError, match="parameters held"):
        check_memory(Forgetful(), plan, cost)


def test_nondeterministic_simulation_fails(cost):
    ticks = itertools.count(1)

    class Jittery(DDP):
        def graph(self, plan, cost):
            g = super().graph(plan, cost)
            g.tasks[0].duration_s += next(ticks) * 1e-3
            return g

    plan = example_plans("ddp", cost)[0]
    with pytest.raises(AssertionError, match="two predictions differ"):
        check_simulation(Jittery(), plan, cost)


def test_a_plan_of_another_type_fails(cost):
    plan = example_plans("ddp", cost)[0]

    class Other(DDP):
        plan_type = dataclasses.make_dataclass("OtherPlan", [], bases=(type(plan),), frozen=True)

    with pytest.raises(AssertionError, match="not its plan_type"):
        check_plan_roundtrip(Other(), plan)
