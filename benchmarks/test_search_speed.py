"""Search speed: a 1,000-trial search over every registered family on 8 and on 64 catalog devices.

Simulation only (catalog devices are scaled from the recorded emu-cpu profile), in-memory Optuna
storage, seeded TPE as the CLI configures it.  Besides the wall time it reports when the search
first held a plan within 1 % of its final best (trial number and seconds).

Each search has a wall-clock budget so that the bench stays within its ~30 minutes on 2 cores:
a search that hits it reports the trials it finished, `completed: false` and a linear projection
of the 1,000-trial time (a lower bound: TPE's own cost grows with the trials).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from bench_config import RESULTS
from hetsim.search import golden

from hetsim import strategies

TRIALS = 1000
KEYS = ("rtx_3090", "gtx_1080_ti", "t4", "a10")
WITHIN = 0.01
BUDGET_S = 240.0


def _context(n_devices: int, workload):
    from hetsim.strategies.base import SearchContext

    from hetsim.hardware.cluster import parse_cluster
    from hetsim.model.costmodel import CostModel

    spec = "catalog:" + ",".join(f"{k}*{n_devices // len(KEYS)}" for k in KEYS)
    cluster = dataclasses.replace(parse_cluster(spec), host_memory_bytes=golden.HOST_MEMORY_BYTES)
    cost = CostModel(cluster, golden.recorded_profiles(RESULTS, workload.spec), workload.optimizer,
                     has_batchnorm=workload.has_batchnorm, batch_coupled=workload.batch_coupled)
    # Four samples per device: every device can take part (BatchNorm needs two per micro-batch).
    return SearchContext(cost=cost, global_batch=4 * n_devices, precisions=("fp32", "bf16", "fp16"))


def _search(ctx) -> dict:
    from hetsim.search.study import feasible_candidates, open_study, run_search

    study = open_study("bench-search", None, seed=0)
    best_at: list[tuple[float, int, float]] = []  # (seconds, trial, best feasible value so far)
    t0 = time.perf_counter()

    def track(st, trial):
        v = trial.value if trial.user_attrs.get("constraint", 1.0) <= 0 else None
        prev = best_at[-1][2] if best_at else 0.0
        if v is not None and v > prev:
            best_at.append((time.perf_counter() - t0, trial.number, v))

    run_search(study, ctx, strategies.names(), TRIALS, callbacks=[track],
               stop=lambda: time.perf_counter() - t0 > BUDGET_S)
    wall = time.perf_counter() - t0
    done = len(study.trials)
    cands = feasible_candidates(study)
    final = best_at[-1][2] if best_at else 0.0
    hit = next((b for b in best_at if b[2] >= (1 - WITHIN) * final), None)
    return {
        "trials": done,
        "completed": done >= TRIALS,
        "wall_s": wall,
        "trials_per_s": done / wall,
        "projected_1000_trials_s": wall * TRIALS / done,
        "best_samples_per_s": final,
        "best_plan": strategies.get(cands[0].plan.strategy).label(cands[0].plan) if cands else None,
        "within_1pct_trial": hit[1] if hit else None,
        "within_1pct_s": hit[0] if hit else None,
        "distinct_feasible_plans": len(cands),
    }


@pytest.mark.parametrize("n_devices", [8, 64])
def test_search_1000_trials(benchmark, profiles, workload, n_devices):
    ctx = _context(n_devices, workload)
    out = benchmark.pedantic(_search, args=(ctx,), rounds=1, iterations=1)
    benchmark.extra_info.update({"n_devices": n_devices, **out})
    print(f"{n_devices} devices: {out}")
    assert out["trials"] >= 1
    assert out["best_plan"] is not None, "the search found no feasible plan"
