"""PP x TP and DP x PP x TP real runs (torchrun, gloo) compute the single-process full-batch gradient
on every rank, for even shards and uneven ones.  The family's own contract cases run on two
devices, too few for a pipeline of tensor groups, so these run on four and eight."""

from __future__ import annotations

import pytest
from hetsim.strategies.tp import build_plan

from hetsim import strategies
from hetsim.testing.contract import GLOBAL_BATCH, check_real_run_gradient, structural_cost

SPEC = "gpt@tiny@16"
CASES = {
    # like devices form each group: even shards, the fast pair the first stage
    "pp2xtp2-even": ("emu:1.0@4G,1.0@4G,0.5@4G,0.5@4G", "fast_links", 2),
    # a fast and a slow device in each group: uneven shards (heads 3/1)
    "pp2xtp2-uneven-gpipe": ("emu:1.0@4G,1.0@4G,0.5@4G,0.5@4G", "strided", 1),
    "pp2xtp2-uneven": ("emu:1.0@4G,1.0@4G,0.5@4G,0.5@4G", "strided", 2),
    "dp2xpp2xtp2-uneven": ("emu:" + ",".join(["1.0@2G"] * 4 + ["0.5@2G"] * 4), "strided", 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_of_tensor_groups_matches_full_batch_gradient(case, tmp_path):
    cluster, grouping, m = CASES[case]
    cost = structural_cost(SPEC, cluster=cluster)
    plan = build_plan(cost, tuple(range(cost.n_devices)), 2, grouping, GLOBAL_BATCH, stages=2, microbatches=m)
    assert plan.stages == 2 and plan.even == (grouping == "fast_links")
    check_real_run_gradient(strategies.get("tp"), plan, cost, SPEC, tmp_path)
