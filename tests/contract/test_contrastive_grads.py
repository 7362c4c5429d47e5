"""Batch-coupled (contrastive) workloads keep their objective in every family.

For `simclr` and `clip` (InfoNCE over the whole global batch) no family offers plain accumulation
or several pipeline micro-batches, and the gradient cache that replaces accumulation is costed.
That every family's real run (uneven splits, the gradient cache, ZeRO stages with offload, model
parallelism, replicated pipelines) gives the single-process full-batch InfoNCE gradient is part of
the contract suite: both workloads are in every family's `contract_workloads` (hetsim.testing,
collected by tests/contract/test_strategies.py).
"""

from __future__ import annotations

import pytest
from hetsim.strategies.base import SearchContext

from hetsim import strategies
from hetsim.errors import InfeasiblePlanError
from hetsim.testing import structural_cost
from hetsim.workloads import workload_from_spec

GLOBAL_BATCH = 8
SPECS = ("simclr@32", "clip@32")  # 32 px: the same models as the defaults, faster to run


@pytest.fixture(scope="module")
def coupled_cost():
    """A cost model per contrastive workload: its real blocks, synthetic timings (nothing measured)."""
    return {spec: (workload_from_spec(spec), structural_cost(spec)) for spec in SPECS}


def _plans(coupled_cost, spec, name):
    wl, cost = coupled_cost[spec]
    return wl, cost, strategies.get(name).examples(SearchContext(cost=cost, global_batch=GLOBAL_BATCH))


@pytest.mark.parametrize("spec", SPECS)
def test_no_plan_changes_the_objective(coupled_cost, spec):
    wl, cost = coupled_cost[spec]
    assert wl.batch_coupled
    ddp = strategies.get("ddp")
    with pytest.raises(InfeasiblePlanError, match="grad_cache_chunks"):
        ddp.validate(ddp.plan_type(devices=(0, 1), local_batch=(4, 4), accum_steps=2), cost)
    pipe = strategies.get("pipeline")
    plan = pipe.solve(cost, (0, 1), schedule="GPipe", microbatches=2, batch=GLOBAL_BATCH)
    with pytest.raises(InfeasiblePlanError, match="1 micro-batch"):
        pipe.validate(plan, cost)
    for name in strategies.names():
        for p in _plans(coupled_cost, spec, name)[2]:
            assert getattr(p, "accum_steps", 1) == 1 and getattr(p, "microbatches", 1) == 1, p


@pytest.mark.parametrize("spec", SPECS)
def test_grad_cache_is_costed(coupled_cost, spec):
    """The gradient cache's second forward lengthens the step; its chunks shrink the activations."""
    _, cost = coupled_cost[spec]
    ddp = strategies.get("ddp")
    plain = ddp.plan_type(devices=(0, 1), local_batch=(6, 2))
    cached = ddp.plan_type(devices=(0, 1), local_batch=(6, 2), grad_cache_chunks=2)
    a, b = ddp.predict(plain, cost)[0], ddp.predict(cached, cost)[0]
    assert b.step_time_s > a.step_time_s
    assert b.memory[0].activations_bytes < a.memory[0].activations_bytes
