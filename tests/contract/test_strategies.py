"""The contract every registered strategy must pass.

1. its plans round-trip through JSON;
2. its simulation is deterministic;
3. a real run (torchrun, 2 emulated ranks) gives the single-process full-batch gradient, on a GroupNorm
   ResNet and on the smallest gpt (integer token inputs, embeddings, attention, an LM loss over tokens).

A family with no plan for a ResNet (`unavailable`: tensor parallelism needs attention heads to split)
takes its JSON and simulation checks on the gpt, and skips the ResNet real run.
"""

from __future__ import annotations

import json

import pytest
from hetsim.strategies.base import SearchContext

from hetsim import strategies
from hetsim.execution.runner import device_dicts, launch
from hetsim.execution.worker import Job
from hetsim.serial import to_dict
from hetsim.workloads.builtin import workload_from_spec

GPT_SPEC = "gpt@tiny@16"  # the conftest gpt_profile fixture profiles this workload

GLOBAL_BATCH = 8


@pytest.fixture
def cost_for(make_cost, request):
    """(family name) -> a cost model it has plans on: the GroupNorm ResNet's, else the gpt's."""

    def make(spec: str, name: str):
        cost = make_cost(spec)
        if strategies.get(name).unavailable(SearchContext(cost=cost, global_batch=GLOBAL_BATCH)) is None:
            return cost
        return request.getfixturevalue("make_gpt_cost")(spec)

    return make


def _examples(make_cost, name):
    cost = make_cost("emu:1.0@4G,0.5@4G")
    ctx = SearchContext(cost=cost, global_batch=GLOBAL_BATCH, precisions=("fp32",))
    if strategies.get(name).unavailable(ctx) is not None:
        pytest.skip(f"{name} has no plan on {cost.ref.model}")
    plans = strategies.get(name).examples(ctx)
    assert plans, f"strategy {name} gives no example plans"
    return cost, plans


@pytest.mark.parametrize("name", strategies.names())
def test_plan_json_roundtrip(cost_for, name):
    _, plans = _examples(lambda spec: cost_for(spec, name), name)
    for plan in plans:
        text = json.dumps(to_dict(plan))
        again = strategies.plan_from_dict(json.loads(text))
        assert again == plan
        assert again.strategy == name


@pytest.mark.parametrize("name", strategies.names())
def test_simulation_is_deterministic(cost_for, name):
    cost, plans = _examples(lambda spec: cost_for(spec, name), name)
    strat = strategies.get(name)
    for plan in plans:
        a, _, _ = strat.predict(plan, cost)
        b, _, _ = strat.predict(plan, cost)
        assert a == b
        assert a.step_time_s > 0
        assert a.samples_per_s == pytest.approx(plan.global_batch / a.step_time_s)
        assert len(a.peak_mem_bytes) == len(plan.devices)
        assert all(m > 0 for m in a.peak_mem_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("name", strategies.names())
def test_real_run_matches_full_batch_gradient(make_cost, name, tmp_path):
    _check_real_runs(make_cost, name, "gn_resnet@32", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", strategies.names())
def test_gpt_real_run_matches_full_batch_gradient(make_gpt_cost, name, tmp_path):
    _check_real_runs(make_gpt_cost, name, GPT_SPEC, tmp_path)


def _check_real_runs(make_cost, name, spec, tmp_path):
    cost, plans = _examples(make_cost, name)
    for i, plan in enumerate(plans):
        job = Job(task="grads", plan=to_dict(plan), workload=spec, global_batch=plan.global_batch,
                  devices=device_dicts(cost.cluster, plan.devices), out_dir=str(tmp_path / f"p{i}"))
        results, tail, timed_out = launch(job, len(plan.devices), timeout_s=180)
        assert not timed_out, tail
        assert len(results) == len(plan.devices), tail
        for r in results:
            assert r.status == "ok", r.error
            assert r.grad_rel_err is not None and r.grad_rel_err < 1e-4, (plan, r.rank, r.grad_rel_err)
        # Together the ranks hold a gradient for every parameter of the model.
        covered = set().union(*(set(r.grad_names) for r in results))
        all_names = {n for n, _ in workload_from_spec(spec).model().named_parameters()}
        assert covered == all_names, sorted(all_names - covered)
