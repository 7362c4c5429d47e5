"""Sequence parallelism in the `tp` family: which plans may use it, what it changes in the
simulation (the norms' share of compute split over the group, each layer collective the same bytes
plus its own calibrated term) and in memory, and how the search and the report offer it."""

from __future__ import annotations

import dataclasses

import pytest
from hetsim.strategies.base import SearchContext
from hetsim.strategies.tp import build_plan, layer_collective_s, tp_dims

from hetsim import strategies
from hetsim.errors import InfeasiblePlanError
from hetsim.model.simulator import TaskKind
from hetsim.testing.contract import (
    check_memory,
    check_plan_roundtrip,
    check_simulation,
    drawn_plans,
    structural_cost,
)

SPEC = "gpt@tiny@16"
PAIR = "emu:1.0@4G,1.0@4G"


@pytest.fixture(scope="module")
def tp():
    return strategies.get("tp")


@pytest.fixture(scope="module")
def cost():
    return structural_cost(SPEC, cluster=PAIR)


def _with_term(cost, field: str, value: float):
    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.store import group_key

    key = group_key([cost.cluster.devices[0], cost.cluster.devices[1]])
    models = {k: dataclasses.replace(p, **{field: {key: value}}) for k, p in cost.profiles.models.items()}
    return CostModel(cost.cluster, dataclasses.replace(cost.profiles, models=models), cost.optimizer)


def test_sequence_parallel_splits_the_norms_and_saves_replicated_activations(tp, cost):
    plain = build_plan(cost, (0, 1), 2, "fast_links", 16, even=True)
    sp = build_plan(cost, (0, 1), 2, "fast_links", 16, even=True, sequence_parallel=True)
    assert sp == dataclasses.replace(plain, sequence_parallel=True) and sp.realisation == "sp"
    assert plain.realisation == "dtensor" and "sp" in tp.label(sp) and "sp" not in tp.label(plain)
    for plan in (plain, sp):
        check_plan_roundtrip(tp, plan)
        check_simulation(tp, plan, cost)
        check_memory(tp, plan, cost)

    def compute(plan):
        graph = tp.graph(plan, cost)
        return sum(t.duration_s for t in graph.tasks if t.kind in (TaskKind.FORWARD, TaskKind.BACKWARD))

    def collectives(plan):
        return [t.duration_s for t in tp.graph(plan, cost).tasks if t.resource.startswith("tp")]

    # uncalibrated, the collectives are the same; the layers' unsplit share runs on half the tokens
    assert collectives(sp) == pytest.approx(collectives(plain))
    assert compute(sp) < compute(plain)
    mem_plain, mem_sp = tp.memory(plain, cost), tp.memory(sp, cost)
    assert all(s.activations_bytes < p.activations_bytes for s, p in zip(mem_sp, mem_plain))
    assert all(s.params_bytes == p.params_bytes for s, p in zip(mem_sp, mem_plain))


def test_each_realisation_reads_its_own_calibrated_term_per_mib(tp, cost):
    dims = tp_dims(cost)
    sp_cost = _with_term(cost, "tp_sp_collective_s", 0.004)
    base = layer_collective_s(cost, dims, (0, 1), 8, "sp")
    # 4 ms per MiB: the activation of 8 x 16 tokens x 128 is 64 KiB
    assert layer_collective_s(sp_cost, dims, (0, 1), 8, "sp") == pytest.approx(base + 0.004 * dims.activation_bytes(8) / 2**20)
    assert layer_collective_s(sp_cost, dims, (0, 1), 8, "dtensor") == pytest.approx(base)
    assert layer_collective_s(sp_cost, dims, (0, 1), 16, "sp") - layer_collective_s(cost, dims, (0, 1), 16, "sp") == \
        pytest.approx(2 * 0.004 * dims.activation_bytes(8) / 2**20)
    plan = build_plan(cost, (0, 1), 2, "fast_links", 16, even=True, sequence_parallel=True)
    assert tp.predict(plan, sp_cost)[0].step_time_s > tp.predict(plan, cost)[0].step_time_s
    plain = dataclasses.replace(plan, sequence_parallel=False)
    assert tp.predict(plain, sp_cost)[0].step_time_s == tp.predict(plain, cost)[0].step_time_s


@pytest.mark.parametrize(("cluster", "kwargs", "rule"), [
    ("emu:1.0@4G,0.5@4G", {}, "even shards, one tensor group"),  # solved shards are uneven here
    ("emu:1.0@4G,1.0@4G,0.5@4G,0.5@4G", {"tp": 2, "grouping": "strided", "even": True}, "1 replica"),
])
def test_sequence_parallel_needs_a_dtensor_plan(cluster, kwargs, rule):
    cost = structural_cost(SPEC, cluster=cluster)
    n = cost.n_devices
    t = kwargs.pop("tp", n)
    grouping = kwargs.pop("grouping", "fast_links")
    with pytest.raises(InfeasiblePlanError, match="sequence parallelism runs through DTensor"):
        build_plan(cost, tuple(range(n)), t, grouping, 16, sequence_parallel=True, **kwargs)


def test_sequence_parallel_needs_the_group_to_divide_the_tokens(tp):
    cost = structural_cost("gpt@tiny@18", cluster="emu:1.0@4G,1.0@4G,1.0@4G,1.0@4G")
    plan = build_plan(cost, (0, 1, 2, 3), 4, "fast_links", 16, even=True)
    with pytest.raises(InfeasiblePlanError, match="18 tokens over the 4 ranks"):
        tp.validate(dataclasses.replace(plan, sequence_parallel=True), cost)


def test_search_offers_sequence_parallelism_only_on_dtensor_plans(tp):
    for cluster, offered in ((PAIR, True), ("emu:1.0@4G,0.5@4G", False)):
        cost = structural_cost(SPEC, cluster=cluster)
        seen = set()
        for trial, plan in drawn_plans(tp, SearchContext(cost=cost, global_batch=16), 40, seed=1):
            tp.validate(plan, cost)
            assert ("tp.sequence_parallel" in trial.params) == plan.dtensor
            seen.add(plan.sequence_parallel)
        assert seen == ({False, True} if offered else {False}), cluster


def test_counterpart_of_a_dtensor_plan_switches_sequence_parallelism(tp, cost):
    plain = build_plan(cost, (0, 1), 2, "fast_links", 16, even=True)
    sp = dataclasses.replace(plain, sequence_parallel=True)
    assert tp.counterparts(plain, cost) == [sp] and tp.counterparts(sp, cost) == [plain]
    uneven = build_plan(structural_cost(SPEC, cluster="emu:1.0@4G,0.5@4G"), (0, 1), 2, "fast_links", 16)
    assert not uneven.even and all(not c.sequence_parallel for c in tp.counterparts(uneven, cost))
