"""The contract suite every strategy family must pass, shipped so that a third-party family runs it against itself.

Run it over every registered family (built in, and installed plugins of the `hetsim.strategies`
entry-point group):

    python -m pytest -q --pyargs hetsim.testing                 # everything, real runs included
    python -m pytest -q --pyargs hetsim.testing -m "not slow"   # no real multi-process runs
    HETSIM_CONTRACT_WORKLOADS=gpt@tiny python -m pytest -q --pyargs hetsim.testing  # one more workload

For every (family, workload) case: its plans round-trip through JSON, its simulation is
deterministic, its memory prediction is sane, its search space names its parameters with its
prefix, and a real run of each of its plans (torchrun, emulated CPU devices) gives every rank the
single-process full-batch gradient.  The workloads are each family's `contract_workloads` plus
`$HETSIM_CONTRACT_WORKLOADS`.  The check functions below are public for a family's own tests.

`hetsim.testing` is the one part of the core that imports `hetsim.strategies` (it tests that layer);
nothing in the core imports it.
"""

from hetsim.testing.contract import (
    CLUSTER,
    GLOBAL_BATCH,
    GRAD_REL_TOL,
    WORKLOADS_ENV,
    cases,
    check_memory,
    check_plan_roundtrip,
    check_real_run_gradient,
    check_search_space,
    check_simulation,
    example_plans,
    families,
    structural_cost,
    structural_profile,
    synthetic_comm,
    synthetic_comms,
    workloads_for,
)

__all__ = [
    "CLUSTER",
    "GLOBAL_BATCH",
    "GRAD_REL_TOL",
    "WORKLOADS_ENV",
    "cases",
    "check_memory",
    "check_plan_roundtrip",
    "check_real_run_gradient",
    "check_search_space",
    "check_simulation",
    "example_plans",
    "families",
    "structural_cost",
    "structural_profile",
    "synthetic_comm",
    "synthetic_comms",
    "workloads_for",
]
