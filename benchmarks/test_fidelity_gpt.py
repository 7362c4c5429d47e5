"""Fidelity on a transformer: the suite's plans for the built-in `gpt` (every family and knob),
predicted, then run for real on the default emulated cluster, reported per family.

Writes results/local/bench/fidelity_gpt.json beside the ResNet suite's fidelity.json (same record per
plan, from test_fidelity.run_suite), with the accuracy of each family.  Its bounds are the ResNet
suite's; its profiles are recorded under results/local/bench/profiles/, like the ResNet ones.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

import pytest
from bench_config import GLOBAL_BATCH, LOCAL, PRECISIONS
from fidelity_suite import suite_plans
from hetsim.search import golden
from test_fidelity import FIDELITY_TIMEOUT_S, PASSES, STEPS, run_suite

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


def per_family(records: list[dict]) -> dict:
    out = {}
    for name in sorted({r["strategy"] for r in records}):
        acc = golden.accuracy_of([r for r in records if r["strategy"] == name])
        out[name] = {"n_plans": acc.n_plans, "step_time_mape": acc.step_time_mape,
                     "step_time_max_err": acc.step_time_max_err, "peak_mem_mape": acc.peak_mem_mape}
    return out


@pytest.mark.timeout(FIDELITY_TIMEOUT_S)
def test_fidelity_gpt(cluster, gpt_setup):
    wl, profiles, cost, ctx = gpt_setup
    plans = suite_plans(ctx, target=GPT_PLANS)
    assert len({p.strategy for p in plans}) >= 4 and len(plans) >= 8, [p.strategy for p in plans]
    t0 = time.perf_counter()
    records = run_suite(plans, cost, cluster, wl, profile_ref(profiles.models.values()))
    acc = golden.accuracy_of(records)
    result = {"model": wl.spec, "tokens_per_sample": wl.tokens_per_sample, "cluster": cluster.spec,
              "global_batch": GLOBAL_BATCH, "steps": STEPS, "passes": PASSES, "n_plans": acc.n_plans,
              "step_time_mape": acc.step_time_mape, "step_time_max_err": acc.step_time_max_err,
              "peak_mem_mape": acc.peak_mem_mape, "kendall_tau": acc.kendall_tau, "per_family": per_family(records),
              "load_avg_at_end": list(os.getloadavg()), "wall_s": time.perf_counter() - t0,
              "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "plans": records}
    LOCAL.mkdir(parents=True, exist_ok=True)
    (LOCAL / "fidelity_gpt.json").write_text(json.dumps(result, indent=1) + "\n")
    failed = [f"{r['label']}: {r['status']}" for r in records if r["status"] != "ok"]
    assert not failed, failed
    bad = acc.violations()
    assert not bad, f"gpt fidelity bounds broken over {acc.n_plans} plans: {'; '.join(bad)}"
