"""Sequence parallelism (DTensor's `SequenceParallel` norms, reduce-scatter and all-gather between
the tensor-parallel regions) computes the single-process full-batch gradient on every rank, on a
tensor group of four mismatched devices.  The family's own contract cases run it on two."""

from __future__ import annotations

import pytest
from hetsim.strategies.tp import build_plan

from hetsim import strategies
from hetsim.testing.contract import GLOBAL_BATCH, check_real_run_gradient, structural_cost

SPEC = "gpt@tiny@16"


@pytest.mark.slow
def test_sequence_parallel_group_of_four_matches_full_batch_gradient(tmp_path):
    cost = structural_cost(SPEC, cluster="emu:1.0@4G,1.0@4G,0.5@4G,0.5@4G")
    plan = build_plan(cost, (0, 1, 2, 3), 4, "fast_links", GLOBAL_BATCH, even=True, sequence_parallel=True)
    assert plan.sequence_parallel and plan.realisation == "sp" and plan.tp_size == 4
    check_real_run_gradient(strategies.get("tp"), plan, cost, SPEC, tmp_path)
