"""Search speed and quality: 1,000-trial searches, a 512-device search against a 10x longer one, and
searches of spaces small enough to enumerate against the enumerated best.

Simulation only (catalog devices are scaled from the recorded emu-cpu profile), the CLI's default
search (hetsim.search.loop: the evolutionary sampler, seeded), in-memory storage or, as the CLI
keeps it, a journal file written once a second.  Besides the wall time it reports when the search
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


def _search(ctx, storage: str | None = None, trials: int = TRIALS, budget_s: float = BUDGET_S, seed: int = 0) -> dict:
    from hetsim.search.study import feasible_candidates, open_study, run_search

    study = open_study("bench-search", storage, seed=seed)
    best_at: list[tuple[float, int, float]] = []  # (seconds, trial, best feasible value so far)
    t0 = time.perf_counter()

    def track(st, trial):
        v = trial.value if trial.user_attrs.get("constraint", 1.0) <= 0 else None
        prev = best_at[-1][2] if best_at else 0.0
        if v is not None and v > prev:
            best_at.append((time.perf_counter() - t0, trial.number, v))

    run_search(study, ctx, strategies.names(), trials, callbacks=[track], seed=seed,
               stop=lambda: time.perf_counter() - t0 > budget_s)
    wall = time.perf_counter() - t0
    done = len(study.get_trials(deepcopy=False))
    cands = feasible_candidates(study)
    final = best_at[-1][2] if best_at else 0.0
    hit = next((b for b in best_at if b[2] >= (1 - WITHIN) * final), None)
    return {
        "trials": done,
        "completed": done >= trials,
        "wall_s": wall,
        "trials_per_s": done / wall,
        "projected_1000_trials_s": wall * TRIALS / done,
        "best_samples_per_s": final,
        "best_plan": strategies.get(cands[0].plan.strategy).label(cands[0].plan) if cands else None,
        "within_1pct_trial": hit[1] if hit else None,
        "within_1pct_s": hit[0] if hit else None,
        "distinct_feasible_plans": len(cands),
    }


@pytest.mark.parametrize("storage", ["memory", "journal"])
@pytest.mark.parametrize("n_devices", [8, 64])
def test_search_1000_trials(benchmark, workload, n_devices, storage, tmp_path):
    ctx = _context(n_devices, workload)
    url = f"journal:{tmp_path / 'bench.journal'}" if storage == "journal" else None
    out = benchmark.pedantic(_search, args=(ctx, url), rounds=1, iterations=1)
    benchmark.extra_info.update({"n_devices": n_devices, "storage": storage, **out})
    print(f"{n_devices} devices, {storage}: {out}")
    assert out["trials"] >= 1
    assert out["best_plan"] is not None, "the search found no feasible plan"


LARGE_KEYS = ("rtx_3090", "t4", "a10", "gtx_1080_ti")
LARGE_SHORT_S = 13.0
"""The short search's budget: it stops at the first trial that ends past it.  The whole call (study, search,
its ranked candidates) is what LARGE_MAX_S bounds: with 14.0 the search itself read 14.0 s and the call
14.7-15.05 s (2026-12-06/07, six benches; within 1 % of the best at 7.2-8.9 s), so the search gets 13."""
LARGE_MAX_S = 15.0
LARGE_WITHIN = 0.02


def test_search_512_devices_against_a_10x_longer_search(benchmark, workload):
    """512 catalog devices of four types: the best of a search of at most LARGE_MAX_S against the best of
    one ten times as long (both seeded alike, wall-clock budgets, `trials` unbounded)."""
    ctx = _context(512, workload)
    t0 = time.perf_counter()
    short = benchmark.pedantic(_search, args=(ctx, None, 10**6, LARGE_SHORT_S), rounds=1, iterations=1)
    whole = time.perf_counter() - t0  # the figure the bench's table shows, not only the search loop's wall_s
    long = _search(_context(512, workload), None, 10**6, 10 * LARGE_SHORT_S)
    ratio = short["best_samples_per_s"] / long["best_samples_per_s"] if long["best_samples_per_s"] else None
    benchmark.extra_info.update({
        "n_devices": 512, "short": short, "long": long, "short_over_long": ratio, "whole_s": whole,
        "within_2pct": ratio is not None and ratio >= 1 - LARGE_WITHIN,
    })
    print(f"512 devices: short {short}\nlong {long}\nratio {ratio}, whole call {whole:.2f} s")
    assert short["best_plan"] is not None
    assert whole <= LARGE_MAX_S, (f"the 512-device search took {whole:.2f} s > {LARGE_MAX_S} s "
                                  f"(its loop {short['wall_s']:.2f} s)")
    assert ratio is not None and ratio >= 1 - LARGE_WITHIN, (
        f"the {short['wall_s']:.0f} s search's best is {ratio:.3f} of the {long['wall_s']:.0f} s search's, "
        f"under {1 - LARGE_WITHIN:.2f}")


ENUMERABLE = (
    ("emu:1.0@4G,0.5@2G", 32, ("fp32", "bf16")),
    ("emu:1.0@200M,0.5@150M", 32, ("fp32", "bf16")),
    ("catalog:rtx_3090,t4*2", 32, ("fp32", "bf16", "fp16")),
    ("catalog:a10*2,gtx_1080_ti*2,t4", 40, ("fp32", "bf16", "fp16")),
)
ENUM_FAMILIES = ["ddp", "zero"]  # every knob categorical or int (pipelines order devices by floats)


@pytest.mark.parametrize("spec,gb,precisions", ENUMERABLE, ids=[e[0] for e in ENUMERABLE])
def test_search_finds_the_enumerated_best(benchmark, workload, spec, gb, precisions):
    """Spaces small enough to list every plan: the search's best against the true best, and how many
    trials it took to get within 1 % of it."""
    from enumerate_space import enumerate_best
    from hetsim.search import golden
    from hetsim.search.study import feasible_candidates, open_study, run_search

    ctx = golden._context(golden.Case(name="enum", cluster=spec, global_batch=gb, precisions=precisions), RESULTS)
    best, label, n_plans = enumerate_best(ctx, ENUM_FAMILIES)
    values: list[float] = []

    def search():
        study = open_study("enum", None, seed=0)
        run_search(study, ctx, ENUM_FAMILIES, 300, callbacks=[
            lambda s, t: values.append(t.value if t.user_attrs.get("constraint", 1.0) <= 0 else 0.0)])
        return study

    study = benchmark.pedantic(search, rounds=1, iterations=1)
    seeded = len(study.get_trials(deepcopy=False)) - len(values)
    found = feasible_candidates(study)[0]
    hit = next((i for i, v in enumerate(values) if v >= (1 - WITHIN) * best), None)
    equal = abs(found.prediction.samples_per_s - best) <= 1e-9 * best
    benchmark.extra_info.update({
        "cluster": spec, "plans_enumerated": n_plans, "enumerated_best": best, "enumerated_best_plan": label,
        "search_best": found.prediction.samples_per_s,
        "search_best_plan": strategies.get(found.plan.strategy).label(found.plan), "equal": equal,
        "seeded_trials": seeded, "within_1pct_trial": None if hit is None else seeded + hit,
    })
    print(benchmark.extra_info)
    assert equal, f"search best {found.prediction.samples_per_s} != enumerated best {best} ({label})"
