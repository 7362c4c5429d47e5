"""The contract for batch-coupled (contrastive) workloads, on every registered family.

For `simclr` and `clip` (InfoNCE over the whole global batch), every family's example plans on a
2-device emulated cluster — uneven splits, the gradient cache, ZeRO stages with offload, model
parallelism, replicated pipelines — give, on every rank, the single-process full-batch InfoNCE
gradient (same tolerance as test_strategies.py), and no family offers plain accumulation or
several pipeline micro-batches for them.
"""

from __future__ import annotations

import pytest
from hetsim.strategies.base import SearchContext

from hetsim import strategies
from hetsim.errors import InfeasiblePlanError
from hetsim.execution.runner import device_dicts, launch
from hetsim.execution.worker import Job
from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.store import CommProfile, ProfileSet
from hetsim.serial import to_dict
from hetsim.types import Fit

GLOBAL_BATCH = 8
SPECS = ("simclr@32", "clip@32")  # 32 px: the same models as the defaults, faster to run
COMM = CommProfile(backend="gloo", world_size=2, fingerprint={}, allreduce_s=Fit(intercept=1e-4, slope=1e-9),
                   allgather_s=Fit(intercept=1e-4, slope=0.5e-9), sendrecv_s=Fit(intercept=5e-5, slope=0.5e-9))
"""Plausible gloo-on-loopback figures (as tests/conftest.py's): the plans need a value, not a measurement."""


@pytest.fixture(scope="module")
def coupled_cost():
    """A cost model per contrastive workload, from its own quick profile (boundaries need its blocks)."""
    import torch

    from hetsim.profiling.measure import profile_device, profile_model
    from hetsim.workloads import workload_from_spec

    torch.set_num_threads(1)
    dev = profile_device("emu-cpu", torch.device("cpu"))
    out = {}
    for spec in SPECS:
        wl = workload_from_spec(spec)
        model = profile_model(wl, "emu-cpu", torch.device("cpu"), (2, 4), ("fp32",), reps=1)
        ps = ProfileSet(models={"emu-cpu": model}, devices={"emu-cpu": dev}, comm={2: COMM})
        out[spec] = (wl, CostModel(parse_cluster("emu:1.0@4G,0.5@4G"), ps, wl.optimizer, batch_coupled=True,
                                   logits_per_sample_sq=wl.logits_per_sample_sq))
    return out


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


@pytest.mark.slow
@pytest.mark.parametrize("name", strategies.names())
@pytest.mark.parametrize("spec", SPECS)
def test_real_run_matches_full_batch_infonce_gradient(coupled_cost, spec, name, tmp_path):
    wl, cost, plans = _plans(coupled_cost, spec, name)
    why = strategies.get(name).unavailable(SearchContext(cost=cost, global_batch=GLOBAL_BATCH))
    if why is not None:  # e.g. tp: a family that has no plan for this model says so, and is never searched
        pytest.skip(f"{name} {why}")
    assert plans, f"strategy {name} gives no example plans for {spec}"
    names = {n for n, _ in wl.model().named_parameters()}
    for i, plan in enumerate(plans):
        job = Job(task="grads", plan=to_dict(plan), workload=spec, global_batch=plan.global_batch,
                  devices=device_dicts(cost.cluster, plan.devices), out_dir=str(tmp_path / f"p{i}"))
        results, tail, timed_out = launch(job, len(plan.devices), timeout_s=300)
        assert not timed_out, tail
        assert len(results) == len(plan.devices), tail
        for r in results:
            assert r.status == "ok", r.error
            assert r.grad_rel_err is not None and r.grad_rel_err < 1e-4, (plan, r.rank, r.grad_rel_err)
        covered = set().union(*(set(r.grad_names) for r in results))
        assert covered == names, sorted(names - covered)
