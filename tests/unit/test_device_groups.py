"""Interchangeable devices: how they are grouped, and the device choice the data-parallel families search."""

from __future__ import annotations

import dataclasses

import pytest
from hetsim.search import golden
from hetsim.strategies.base import SearchContext
from hetsim.strategies.helpers import choose_devices

from hetsim.errors import InfeasiblePlanError
from hetsim.hardware.cluster import Link, interchangeable_groups, parse_cluster
from hetsim.model.costmodel import CostModel

optuna = pytest.importorskip("optuna")


def _ctx(spec: str) -> SearchContext:
    # The recorded resnet18 profile: loading it is cheap, and catalog devices scale from it.
    cost = CostModel(parse_cluster(spec), golden.recorded_profiles(golden.RESULTS, "resnet18@64"))
    return SearchContext(cost=cost, global_batch=32)


def _ask(ctx: SearchContext):
    """A real trial of a seeded study (its distributions show what was suggested) and its devices."""
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    try:
        return trial, choose_devices(trial, ctx, str)
    except InfeasiblePlanError:
        return trial, ()


def test_groups_follow_kind_and_keep_index_order():
    c = parse_cluster("catalog:rtx_3090*3,gtx_1080_ti*2,t4,rtx_3090")
    assert interchangeable_groups(c) == ((0, 1, 2, 6), (3, 4), (5,))


def test_emulated_groups_need_the_same_speed_and_memory():
    twins = parse_cluster("emu:1.0@4G,1.0@4G,0.5@2G,1.0@4G")
    assert interchangeable_groups(twins) == ((0, 1, 3), (2,))
    # The golden cases' mismatched clusters: every device alone.
    mismatched = parse_cluster("emu:1.0@4G,1.0@2G,0.5@2G,0.25@1G")
    assert interchangeable_groups(mismatched) == ((0,), (1,), (2,), (3,))


def test_same_device_on_other_links_is_not_interchangeable():
    # Three identical T4s where 0 and 1 share a fast link: 2 reaches both slowly, so it stands apart.
    c = parse_cluster("catalog:t4*3")
    fast, slow = Link(bandwidth_bps=50e9, latency_s=5e-6), c.links[0][2]
    links = tuple(
        tuple(fast if {a, b} == {0, 1} else c.links[a][b] for b in range(3)) for a in range(3)
    )
    assert links[0][1] == fast and links[1][2] == slow
    assert interchangeable_groups(dataclasses.replace(c, links=links)) == ((0, 1), (2,))


def test_names_and_positions_do_not_split_a_group():
    c = parse_cluster("catalog:t4*2")
    renamed = (c.devices[0], dataclasses.replace(c.devices[1], name="the other T4"))
    assert interchangeable_groups(dataclasses.replace(c, devices=renamed)) == ((0, 1),)


def test_identical_devices_give_one_count():
    ctx = _ctx("catalog:t4*4,a10*2")
    trial, _ = _ask(ctx)
    assert trial.distributions == {
        "count_dev0": optuna.distributions.IntDistribution(0, 4),
        "count_dev4": optuna.distributions.IntDistribution(0, 2),
    }
    fixed = optuna.trial.FixedTrial({"count_dev0": 3, "count_dev4": 1})
    assert choose_devices(fixed, ctx, str) == (0, 1, 2, 4)  # the first k of each group


def test_mismatched_devices_keep_one_yes_no_each():
    ctx = _ctx("catalog:rtx_3090,gtx_1080_ti*2,t4")
    trial, _ = _ask(ctx)
    yes_no = optuna.distributions.CategoricalDistribution([True, False])
    assert trial.distributions == {
        "use_dev0": yes_no,
        "count_dev1": optuna.distributions.IntDistribution(0, 2),
        "use_dev3": yes_no,
    }
    fixed = optuna.trial.FixedTrial({"use_dev0": False, "count_dev1": 2, "use_dev3": True})
    assert choose_devices(fixed, ctx, str) == (1, 2, 3)

    ctx = _ctx("catalog:rtx_3090,gtx_1080_ti,t4,a10")
    trial, _ = _ask(ctx)
    assert trial.distributions == {f"use_dev{i}": yes_no for i in range(4)}
    fixed = optuna.trial.FixedTrial(
        {"use_dev0": True, "use_dev1": False, "use_dev2": True, "use_dev3": False}
    )
    assert choose_devices(fixed, ctx, str) == (0, 2)


def test_choosing_no_device_is_infeasible_with_a_reason():
    ctx = _ctx("catalog:rtx_3090,t4*2")
    with pytest.raises(InfeasiblePlanError, match="chose no device"):
        choose_devices(optuna.trial.FixedTrial({"use_dev0": False, "count_dev1": 0}), ctx, str)


def test_one_device_needs_no_suggestion():
    trial, devices = _ask(_ctx("catalog:t4"))
    assert devices == (0,) and trial.distributions == {}
