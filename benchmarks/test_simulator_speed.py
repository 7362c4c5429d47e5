"""Simulator speed: plans predicted per second, by the event simulation and by what the search calls.

Data-parallel and pipeline plans, on the default emulated cluster (2 devices) and on a catalog
cluster of 8 devices.  `event`: Strategy.predict (task graph, event loop, memory) of the family's
example with the most tasks.  `search`: Strategy.evaluate (the closed form where the family has one,
else the same event simulation) over up to 200 distinct plans on every device of the cluster, drawn
from the family's search space, in turn, as a search meets them (per-device step times and memory are memoized, whole plans are not).
"""

from __future__ import annotations

import dataclasses

import pytest
from bench_config import GLOBAL_BATCH, PRECISIONS, RESULTS
from hetsim.search import golden

from hetsim import strategies

CATALOG_8 = "catalog:rtx_3090*2,gtx_1080_ti*2,t4*2,a10*2"


def _cost(spec: str, workload):
    from hetsim.hardware.cluster import parse_cluster
    from hetsim.model.costmodel import CostModel

    cluster = dataclasses.replace(parse_cluster(spec), host_memory_bytes=golden.HOST_MEMORY_BYTES)
    return CostModel(cluster, golden.recorded_profiles(RESULTS, workload.spec), workload.optimizer,
                     has_batchnorm=workload.has_batchnorm, batch_coupled=workload.batch_coupled)


def _largest_example(name: str, ctx):
    """The family's example plan with the most tasks in its step graph."""
    strat = strategies.get(name)
    plans = list(strat.examples(ctx))
    return max(plans, key=lambda p: len(strat.graph(p, ctx.cost).tasks))


def _distinct_plans(strat, ctx, n: int) -> list:
    import random

    from hetsim.search.sampler import LiteTrial

    from hetsim.errors import InfeasiblePlanError

    rng, plans, dists = random.Random(0), {}, {}
    for _ in range(100 * n):
        if len(plans) >= n:
            break
        try:
            plan = strat.space(LiteTrial({}, rng, dists), ctx)
            strat.validate(plan, ctx.cost)
        except InfeasiblePlanError:
            continue
        if len(plan.devices) == ctx.cost.n_devices:  # plans on every device of the cluster
            plans.setdefault(plan, None)
    return list(plans)


@pytest.mark.parametrize("cluster_kind", ["emulated-2", "catalog-8"])
@pytest.mark.parametrize("family", ["ddp", "pipeline"])
@pytest.mark.parametrize("path", ["event", "search"])
def test_plans_simulated_per_second(benchmark, workload, family, cluster_kind, path):
    from hetsim.strategies.base import SearchContext

    if family not in strategies.names():
        pytest.skip(f"strategy {family!r} is not registered (registered: {strategies.names()})")
    spec = CATALOG_8 if cluster_kind == "catalog-8" else "emu:1.0@4G,0.5@2G"
    gb = GLOBAL_BATCH if cluster_kind == "emulated-2" else 4 * GLOBAL_BATCH
    cost = _cost(spec, workload)
    ctx = SearchContext(cost=cost, global_batch=gb, precisions=PRECISIONS)
    strat = strategies.get(family)
    if path == "search":
        import itertools

        plans = _distinct_plans(strat, ctx, 200)
        turn = itertools.cycle(plans)
        pred = benchmark(lambda: strat.evaluate(next(turn), cost))
        assert pred.step_time_s > 0
        benchmark.extra_info.update({
            "path": "Strategy.evaluate (closed form where the family has one)",
            "distinct_plans": len(plans),
            "closed_form": strat.step_timing(plans[0], cost) is not None,
            "n_devices": cost.n_devices,
            "plans_per_s": 1.0 / benchmark.stats.stats.mean,
        })
        return
    plan = _largest_example(family, ctx)
    pred = benchmark(strat.predict, plan, cost)[0]
    assert pred.step_time_s > 0
    benchmark.extra_info.update({
        "path": "Strategy.predict (event simulation)",
        "plan": strat.label(plan),
        "tasks": len(strat.graph(plan, cost).tasks),
        "plans_per_s": 1.0 / benchmark.stats.stats.mean,
    })
