"""What makes a search over hundreds of devices affordable, checked for sameness: compute times
shared by devices alike, a hybrid plan simulated with one replica per class, and the log-scaled
replica count of hybrid shapes (drawn and stepped within its bounds)."""

from __future__ import annotations

import dataclasses
import math
import random

import optuna
from hetsim.search.sampler import LiteTrial, _step
from hetsim.search.study import KeyedRandomSampler
from pipeline_synth import synthetic_cost

from hetsim import strategies
from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel

HYB = strategies.get("hybrid")


def test_devices_alike_but_for_name_and_position_share_a_class():
    cost = synthetic_cost([1.0, 1.0, 0.5, 1.0, 0.5], [1e-3] * 4)
    assert cost.klass == (0, 0, 2, 0, 2)
    assert cost.fwd_s(3, 0, 4, 8) == cost.fwd_s(0, 0, 4, 8) != cost.fwd_s(2, 0, 4, 8)
    other_cap = synthetic_cost([1.0, 1.0], [1e-3] * 4, caps=["4G", "2G"])
    assert other_cap.klass == (0, 1)  # memory differs: another class


def test_alike_replicas_are_simulated_once_with_the_full_graphs_numbers():
    speeds = [1.0, 1.0, 0.5, 0.5] * 3  # six replicas of two ranks: two classes of device pairs
    cost = synthetic_cost(speeds, [1e-3, 2e-3, 1e-3, 3e-3, 1e-3, 1e-3], p2p_s_per_byte=1e-8, opt_s_per_param=1e-6)
    plan = HYB.solve(cost, tuple(range(12)), replicas=6, schedule="1F1B", microbatches=2, global_batch=48)
    assert len(set(plan.replica_batch)) == 2  # the solver gave alike replicas alike batches
    uneven = dataclasses.replace(plan, replica_batch=(10, 6, 8, 8, 8, 8))  # batches split the classes
    for p in (plan, uneven):
        fast, ref = HYB.evaluate(p, cost), HYB.predict(p, cost)[0]
        assert math.isclose(fast.step_time_s, ref.step_time_s, rel_tol=1e-12)
        assert math.isclose(fast.bubble_fraction, ref.bubble_fraction, rel_tol=1e-9, abs_tol=1e-12)
        assert fast.breakdown_s.keys() == ref.breakdown_s.keys()
        for kind, s in ref.breakdown_s.items():
            assert math.isclose(fast.breakdown_s[kind], s, rel_tol=1e-9), kind
    seen: list[int] = []
    real = strategies.hybrid.replicas_graph

    def spy(cost, reps, *a, **kw):
        seen.append(len(reps))
        return real(cost, reps, *a, **kw)

    strategies.hybrid.replicas_graph = spy
    try:
        HYB.step_timing(plan, cost)
    finally:
        strategies.hybrid.replicas_graph = real
    assert seen == [2]  # two representatives stand for six replicas


def test_log_scaled_ints_are_drawn_and_stepped_within_bounds():
    rng = random.Random(0)
    dists: dict = {}
    drawn = [LiteTrial({}, rng, dists).suggest_int("replicas", 2, 256, log=True) for _ in range(2000)]
    assert min(drawn) >= 2 and max(drawn) <= 256
    assert sum(v <= 16 for v in drawn) > 0.4 * len(drawn)  # log-uniform: 2..16 is 3/7 of the log range
    d = optuna.distributions.IntDistribution(2, 256, log=True)
    moved = [_step(d, 64, rng) for _ in range(500)]
    numeric = [m for m in moved if isinstance(m, int)]
    assert numeric and all(2 <= m <= 256 for m in numeric) and any(m != 64 for m in numeric)
    trial = optuna.create_study(sampler=KeyedRandomSampler(seed=3)).ask()
    assert 2 <= trial.suggest_int("replicas", 2, 256, log=True) <= 256


def test_hybrid_shapes_cover_what_the_cluster_allows():
    cost = CostModel(parse_cluster("emu:" + ",".join(["1.0@4G"] * 12)), synthetic_cost([1.0], [1e-3] * 6).profiles)
    rng = random.Random(1)
    got = {strategies.hybrid.choose_shape(LiteTrial({}, rng, {}), HYB.param, 12, cost.facts.n_blocks)
           for _ in range(3000)}
    assert got == set(strategies.hybrid.shapes(12, 6))


def test_neighbours_change_one_knob_to_a_nearby_valid_value():
    from hetsim.search.sampler import neighbours

    params = {"strategy": "hybrid", "pipeline_ranks": 5, "hybrid_devices": 100, "order_dev0": 0.4}
    dists = {"strategy": optuna.distributions.CategoricalDistribution(["ddp", "hybrid", "zero"]),
             "pipeline_ranks": optuna.distributions.IntDistribution(2, 6),
             "hybrid_devices": optuna.distributions.IntDistribution(4, 512, log=True),
             "order_dev0": optuna.distributions.FloatDistribution(0.0, 1.0)}
    out = neighbours(params, dists, random.Random(0))
    for n in out:
        changed = [k for k in params if n[k] != params[k]]
        assert len(changed) == 1, n
        k = changed[0]
        assert dists[k]._contains(dists[k].to_internal_repr(n[k])), n
    ranks = sorted(n["pipeline_ranks"] for n in out if n["pipeline_ranks"] != 5)
    assert ranks == [2, 3, 4, 6]  # +-1, 2, 3 within 2..6
    assert {n["strategy"] for n in out} == {"ddp", "hybrid", "zero"}
    assert {90, 110} <= {n["hybrid_devices"] for n in out}  # small multiplicative steps on a log scale


def test_a_knob_moved_to_what_the_plan_allows_is_stored_as_it_ran():
    # 1F1B needs micro-batches >= ranks: a drawn 2 on 4 ranks runs as 4, and the trial says 4.
    from hetsim.strategies.pipeline import choose_microbatches

    cost = synthetic_cost([1.0] * 4, [1e-3] * 8)
    from hetsim.strategies.base import SearchContext

    ctx = SearchContext(cost=cost, global_batch=32, precisions=("fp32",))
    trial = LiteTrial({"microbatches": 2}, random.Random(0), {})
    m = choose_microbatches(trial, ctx, HYB.param, "1F1B", 4, 1)
    assert m == 4 and trial.params["microbatches"] == 4
