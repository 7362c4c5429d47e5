"""The fidelity suite: a fixed list of plans across every registered family and knob.

Built from what each family says about itself, so a family registered tomorrow is in the
suite without editing this file:

1. its baseline and `examples(ctx)` (each family's own representative plans), each followed by
   its `counterparts` (tp: the even-shard plan beside an uneven one; tp has plans only on a gpt
   workload, so the resnet bench has none);
2. a bf16 and a fully checkpointed variant of its baseline (every family accepts both knobs);
3. plans drawn from its own search space (`space(trial, ctx)`) by a seeded random sampler,
   which covers its remaining knobs (devices, accumulation, ZeRO stage, offload, schedule,
   micro-batches) the way the search would combine them.

Only valid plans that are predicted to fit are kept, each once, in a deterministic order: with
the recorded profiles the suite is the same list on every run.
"""

from __future__ import annotations

import dataclasses
import json
import math

from hetsim import strategies
from hetsim.errors import InfeasiblePlanError
from hetsim.serial import to_dict

TARGET_PLANS = 24
"""Enough for a meaningful MAPE and Kendall tau, few enough for ~24 minutes of real runs (three
runs of each plan, benchmarks/test_fidelity.py)."""
MAX_PRED_STEP_S = 2.5
"""Leave out drawn plans predicted slower than this: they add minutes and no new knob."""
SAMPLER_SEED = 0
MAX_DRAWS = 200


def _key(plan) -> str:
    return json.dumps(to_dict(plan), sort_keys=True)


def knobs(plan) -> dict:
    """The knobs a plan turns (for the coverage table of the suite)."""
    out = {"strategy": plan.strategy, "devices": len(plan.devices), "precision": plan.precision,
           "checkpoint_blocks": plan.checkpoint_blocks}
    for name in ("accum_steps", "zero_stage", "offload", "schedule", "microbatches", "replicas", "tp_size"):
        if hasattr(plan, name):
            out[name] = getattr(plan, name)
    if hasattr(plan, "heads"):
        out["uneven_shards"] = not plan.even
    batches = getattr(plan, "local_batch", None)
    if batches is not None:
        out["uneven"] = len(set(batches)) > 1
    return out


def _variants(strat, ctx) -> list:
    base = strat.baseline(ctx)
    if base is None:
        return []
    out = []
    if "bf16" in ctx.precisions and base.precision == "fp32":
        out.append(dataclasses.replace(base, precision="bf16"))
    if base.checkpoint_blocks == 0:
        out.append(dataclasses.replace(base, checkpoint_blocks=ctx.cost.facts.n_blocks))
    return out


def _drawn(strat, ctx, seed: int):
    import optuna

    from hetsim.testing.contract import drawn_plans

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for _, plan in drawn_plans(strat, ctx, MAX_DRAWS, seed):
        yield plan


def _candidates(strat, ctx, seed: int, limit: int) -> list:
    """Up to `limit` distinct valid plans of one family predicted to fit, in order of preference."""
    out, seen = [], set()

    def take(plan, max_step_s: float = math.inf) -> None:
        k = _key(plan)
        if k in seen:
            return
        try:
            pred, _, _ = strat.predict(plan, ctx.cost)
        except InfeasiblePlanError:
            return
        if pred.feasible and pred.step_time_s <= max_step_s:
            seen.add(k)
            out.append(plan)

    try:
        own = strat.own_plans(ctx) + _variants(strat, ctx)
    except InfeasiblePlanError:  # a family may have no valid example on this cluster
        own = []
    for plan in own:
        take(plan)
        for other in strat.counterparts(plan, ctx.cost):  # e.g. tp: the even plan beside an uneven one
            take(other)
    for plan in _drawn(strat, ctx, seed):
        if len(out) >= limit:
            break
        take(plan, MAX_PRED_STEP_S)
    return out[:limit]


def suite_plans(ctx, target: int = TARGET_PLANS) -> list:
    """About `target` plans spread evenly over the registered families (a family with fewer valid
    plans leaves its share to the others), grouped by family."""
    names = strategies.names()
    cands = {name: _candidates(strategies.get(name), ctx, SAMPLER_SEED + i, target)
             for i, name in enumerate(names)}
    taken = dict.fromkeys(names, 0)
    total = 0
    while total < target and any(taken[n] < len(cands[n]) for n in names):
        for n in names:
            if total < target and taken[n] < len(cands[n]):
                taken[n] += 1
                total += 1
    return [plan for n in names for plan in cands[n][: taken[n]]]
