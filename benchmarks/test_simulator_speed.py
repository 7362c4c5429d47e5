"""Simulator speed: plans simulated per second (Strategy.predict: task graph, event loop, memory).

Data-parallel and pipeline plans, on the default emulated cluster (2 devices) and on a catalog
cluster of 8 devices; the plan of each is the family's own example with the most tasks.
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


@pytest.mark.parametrize("cluster_kind", ["emulated-2", "catalog-8"])
@pytest.mark.parametrize("family", ["ddp", "pipeline"])
def test_plans_simulated_per_second(benchmark, profiles, workload, family, cluster_kind):
    from hetsim.strategies.base import SearchContext

    if family not in strategies.names():
        pytest.skip(f"strategy {family!r} is not registered (registered: {strategies.names()})")
    spec = CATALOG_8 if cluster_kind == "catalog-8" else "emu:1.0@4G,0.5@2G"
    gb = GLOBAL_BATCH if cluster_kind == "emulated-2" else 4 * GLOBAL_BATCH
    cost = _cost(spec, workload)
    ctx = SearchContext(cost=cost, global_batch=gb, precisions=PRECISIONS)
    strat = strategies.get(family)
    plan = _largest_example(family, ctx)
    pred = benchmark(strat.predict, plan, cost)[0]
    assert pred.step_time_s > 0
    benchmark.extra_info.update({
        "plan": strat.label(plan),
        "tasks": len(strat.graph(plan, cost).tasks),
        "plans_per_s": 1.0 / benchmark.stats.stats.mean,
    })
