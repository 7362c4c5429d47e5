"""PP x TP plans of the `tp` family (tensor groups as pipeline stages, and replicas of such a
pipeline): search space, simulation, memory and validation on a structural cost model."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
from hetsim.strategies._tp_pipeline import stage_groups, stage_params
from hetsim.strategies.base import SearchContext
from hetsim.strategies.tp import build_plan, stage_choices, tp_dims

from hetsim import strategies
from hetsim.errors import InfeasiblePlanError
from hetsim.model.simulator import TaskKind
from hetsim.testing.contract import (
    check_memory,
    check_plan_roundtrip,
    check_search_space,
    check_simulation,
    structural_cost,
)

FOUR = "emu:1.0@4G,1.0@4G,0.5@4G,0.5@4G"
EIGHT = "emu:" + ",".join(["1.0@4G"] * 4 + ["0.5@4G"] * 4)
SPEC = "gpt@tiny@16"


@pytest.fixture(scope="module")
def cost4():
    return structural_cost(SPEC, cluster=FOUR)


@pytest.fixture(scope="module")
def tp():
    return strategies.get("tp")


def _plans(cost, n):
    return [build_plan(cost, tuple(range(n)), 2, g, 16, stages=2, microbatches=m)
            for g in ("fast_links", "strided") for m in (1, 2, 4)]


def test_stage_choices_need_two_devices_a_stage():
    assert stage_choices(2) == (1,)
    assert stage_choices(4) == (1, 2)
    assert stage_choices(8) == (1, 2, 4)


@pytest.mark.parametrize("n", [4, 8])
def test_plans_simulate_deterministically_with_sane_memory(n, tp):
    cost = structural_cost(SPEC, cluster=FOUR if n == 4 else EIGHT)
    for plan in _plans(cost, n):
        assert plan.stages == 2 and plan.dp == n // 4
        assert plan.schedule == ("GPipe" if plan.microbatches < 2 else "1F1B")
        check_plan_roundtrip(tp, plan)
        check_simulation(tp, plan, cost)
        check_memory(tp, plan, cost)


def test_every_layer_all_reduce_is_simulated_once_per_micro_batch(cost4, tp):
    dims = tp_dims(cost4)
    for plan in _plans(cost4, 4):
        g = tp.graph(plan, cost4)
        on_groups = [t for t in g.tasks if t.kind == TaskKind.ALLREDUCE and t.resource.startswith("tp")]
        # each layer: two all-reduces forward and two backward, per micro-batch, per replica
        assert len(on_groups) == 4 * dims.n_layer * plan.microbatches * plan.dp
        with_layers = {s for s in range(plan.stages)
                       if any(plan.boundaries[s] <= k < plan.boundaries[s + 1] for k in dims.layer_blocks)}
        assert {int(t.resource.split(".")[1]) for t in on_groups} == with_layers
        used = {t.resource for t in g.tasks if t.resource.startswith("dev")}
        assert used == {f"dev{d}" for d in plan.devices}


def test_stage_shards_add_up_to_the_stage(cost4):
    dims = tp_dims(cost4)
    plan = build_plan(cost4, (0, 1, 2, 3), 2, "strided", 16, stages=2, microbatches=2)
    assert not plan.even  # a fast and a slow device in every group
    for s in range(plan.stages):
        lo, hi = plan.boundaries[s], plan.boundaries[s + 1]
        whole = cost4.param_count(lo, hi)
        # what no position splits: the stage without its layers' four Linears
        layers = [k for k in dims.layer_blocks if lo <= k < hi]
        d, u = dims.d_model, dims.hidden
        replicated = whole - len(layers) * (4 * d * d + 3 * d + 2 * d * u + u)
        held = [stage_params(cost4, dims, h, x, lo, hi) for h, x in zip(plan.heads, plan.hidden)]
        assert sum(held) - (plan.tp_size - 1) * replicated == whole


def test_groups_become_stages_fastest_first(cost4):
    plan = build_plan(cost4, (0, 1, 2, 3), 2, "fast_links", 16, stages=2, microbatches=2)
    assert stage_groups(plan) == [[(0, 1), (2, 3)]]
    assert plan.even  # like devices together
    # the fast pair holds more of the model than the slow one
    b = plan.boundaries
    assert b[1] - b[0] >= b[2] - b[1]


def test_validate_names_the_rule(cost4, tp):
    plan = build_plan(cost4, (0, 1, 2, 3), 2, "fast_links", 16, stages=2, microbatches=2)
    bad = {
        "accum_steps": (dataclasses.replace(plan, accum_steps=2), "accum_steps 2 must be 1"),
        "schedule": (dataclasses.replace(plan, schedule="ZBVZeroBubble"), "schedule 'ZBVZeroBubble'"),
        "boundaries": (dataclasses.replace(plan, boundaries=(0, 6)), "needs 3 boundaries"),
        "microbatches": (dataclasses.replace(plan, microbatches=3), "microbatches(3)"),
        "devices": (dataclasses.replace(plan, devices=(0, 1, 2)), "stages(2)"),
    }
    for p, text in bad.values():
        with pytest.raises(InfeasiblePlanError, match=text.replace("(", r"\(").replace(")", r"\)")):
            tp.validate(p, cost4)
    with pytest.raises(InfeasiblePlanError, match="divide"):
        build_plan(cost4, (0, 1, 2), 2, "fast_links", 16, stages=2, microbatches=2)


def test_search_space_reaches_pipelines_of_tensor_groups(cost4, tp):
    check_search_space(tp, cost4)
    ctx = SearchContext(cost=cost4, global_batch=16)
    params = {"tp.count_dev0": 2, "tp.count_dev2": 2, "tp.size": 2, "tp.grouping": "strided", "tp.stages": 2,
              "tp.microbatches": 4}
    plan = tp.space(optuna.trial.FixedTrial(params), ctx)
    tp.validate(plan, cost4)
    assert (plan.stages, plan.tp_size, plan.microbatches, plan.schedule) == (2, 2, 4, "1F1B")
    assert stage_groups(plan) == [[(0, 2), (1, 3)]]
    with pytest.raises(InfeasiblePlanError, match="2 stages of 2-device tensor groups do not divide the 2"):
        tp.space(optuna.trial.FixedTrial({**params, "tp.count_dev2": 0}), ctx)


def test_uneven_pipeline_plans_have_an_even_counterpart(cost4, tp):
    plan = build_plan(cost4, (0, 1, 2, 3), 2, "strided", 16, stages=2, microbatches=2)
    [even] = tp.counterparts(plan, cost4)
    assert even.even and even.stages == 2 and stage_groups(even) == stage_groups(plan)
    assert even.global_batch == plan.global_batch
    tp.validate(even, cost4)
