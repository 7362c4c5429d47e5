"""Fidelity of tensor-parallel plans on four emulated devices: the `tp` family's own plans on
gpt@tiny@64 over `emu:1.0@2G,1.0@2G,0.5@1G,0.5@1G` (a tensor pair with and without sequence
parallelism, DP x TP replicas of pairs and
PP x TP pipelines of pairs, each grouping, every uneven plan beside its even counterpart),
predicted from a recording made at the start of the run, then run for real.

Writes results/local/bench/fidelity_tp.json (the same record per plan as the other suites,
`test_fidelity.run_suite`) with the accuracy per shape (tp, tp sp: sequence parallelism, dp x tp, pp x tp).  Four ranks on two
cores contend for the host, and runs of one plan spread by about 10 % here, so the bound is issue
15's own: every executed tensor-parallel plan within 10 % of its prediction, read as the MAPE.
"""

from __future__ import annotations

import shutil
import time

import pytest
from bench_config import GLOBAL_BATCH, LOCAL
from hetsim.search import golden
from test_fidelity import FIDELITY_TIMEOUT_S, accuracy_by, run_suite, save_suite

from hetsim import strategies
from hetsim.profiling.hostspeed import profile_ref

TP_CLUSTER = "emu:1.0@2G,1.0@2G,0.5@1G,0.5@1G"
TP_ROOT = LOCAL / "tp4"
"""Its own profiles folder: a four-device recording beside the default cluster's."""
TP_MAPE_MAX = 0.10


def shape(plan) -> str:
    return "pp x tp" if plan.stages > 1 else "dp x tp" if plan.dp > 1 else "tp sp" if plan.sequence_parallel else "tp"


@pytest.mark.timeout(FIDELITY_TIMEOUT_S)
def test_fidelity_tp():
    from hetsim.search.calibrate import calibrate
    from hetsim.search.profiles import profiles_step
    from hetsim.strategies.base import SearchContext

    from hetsim.hardware.cluster import parse_cluster
    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.obtain import ProfileRequest
    from hetsim.workloads.builtin import load_workload

    cluster = parse_cluster(TP_CLUSTER)
    wl = load_workload("gpt", size="tiny")
    shutil.rmtree(TP_ROOT / "profiles", ignore_errors=True)  # a fresh recording every run
    req = ProfileRequest(root=TP_ROOT, global_batch=GLOBAL_BATCH, precisions=("fp32",), strategies=("tp",))
    profiles = calibrate(cluster, wl, profiles_step(cluster, wl, req), req)
    cost = CostModel(cluster, profiles, wl.optimizer)
    tp = strategies.get("tp")
    plans = []
    for plan in tp.own_plans(SearchContext(cost=cost, global_batch=GLOBAL_BATCH, precisions=("fp32",))):
        for p in (plan, *tp.counterparts(plan, cost)):
            if p not in plans:
                plans.append(p)
    assert {shape(p) for p in plans} == {"tp", "tp sp", "dp x tp", "pp x tp"}, [tp.label(p) for p in plans]
    t0 = time.perf_counter()
    records = run_suite(plans, cost, cluster, wl, profile_ref(profiles.models.values()))
    acc = golden.accuracy_of(records)
    shape_of = {r["label"]: shape(p) for r, p in zip(records, plans)}
    by_shape = accuracy_by(records, lambda r: shape_of[r["label"]])
    save_suite("fidelity_tp.json", records, acc, t0, model=wl.spec, cluster=cluster.spec, global_batch=GLOBAL_BATCH,
               per_shape=by_shape, tp_pipeline_scale=next(iter(profiles.models.values())).tp_pipeline_scale)
    assert acc.step_time_mape <= TP_MAPE_MAX, (
        f"tensor-parallel plans on {TP_CLUSTER}: step-time MAPE {acc.step_time_mape:.3f} > {TP_MAPE_MAX} "
        f"(per shape: {by_shape})")
