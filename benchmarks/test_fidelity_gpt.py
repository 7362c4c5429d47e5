"""Fidelity on a transformer: the suite's plans for the built-in `gpt` (every family and knob),
predicted, then run for real on the default emulated cluster, reported per family.

Writes results/local/bench/fidelity_gpt.json beside the ResNet suite's fidelity.json (same record per
plan, from test_fidelity.run_suite), with the accuracy of each family.  Its bounds are the ResNet
suite's; its profiles are recorded under results/local/bench/profiles/, like the ResNet ones.
"""

from __future__ import annotations

import time

import pytest
from bench_config import GLOBAL_BATCH, LOCAL, PRECISIONS
from fidelity_suite import suite_plans
from hetsim.search import golden
from test_fidelity import FIDELITY_TIMEOUT_S, accuracy_by, run_suite, save_suite

from hetsim.profiling.hostspeed import profile_ref

GPT_MODEL = "gpt"
GPT_SIZE = "tiny"
"""gpt tiny at its 64 tokens: ~0.25 s per step of 32 samples on one quiet core (0.46 s measured
while the host ran at half speed), the emulated default."""
GPT_PLANS = 10
"""At least eight across every family and knob (issue 14), few enough for ~10 minutes of runs."""


@pytest.fixture(scope="module")
def gpt_setup(cluster):
    from hetsim.search.profiles import obtain_profiles
    from hetsim.strategies.base import SearchContext

    from hetsim.model.costmodel import CostModel
    from hetsim.workloads.builtin import load_workload

    wl = load_workload(GPT_MODEL, size=GPT_SIZE)
    profiles = obtain_profiles(cluster, wl, root=LOCAL, global_batch=GLOBAL_BATCH, precisions=PRECISIONS)
    cost = CostModel(cluster, profiles, wl.optimizer)
    return wl, profiles, cost, SearchContext(cost=cost, global_batch=GLOBAL_BATCH, precisions=PRECISIONS)


@pytest.mark.timeout(FIDELITY_TIMEOUT_S)
def test_fidelity_gpt(cluster, gpt_setup):
    wl, profiles, cost, ctx = gpt_setup
    plans = suite_plans(ctx, target=GPT_PLANS)
    assert len({p.strategy for p in plans}) >= 4 and len(plans) >= 8, [p.strategy for p in plans]
    t0 = time.perf_counter()
    records = run_suite(plans, cost, cluster, wl, profile_ref(profiles.models.values()))
    acc = golden.accuracy_of(records)
    save_suite("fidelity_gpt.json", records, acc, t0, model=wl.spec, tokens_per_sample=wl.tokens_per_sample,
               cluster=cluster.spec, global_batch=GLOBAL_BATCH,
               per_family=accuracy_by(records, lambda r: r["strategy"]))
    bad = acc.violations()
    assert not bad, f"gpt fidelity bounds broken over {acc.n_plans} plans: {'; '.join(bad)}"
