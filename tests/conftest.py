"""Shared fixtures: a small recorded profile (gn_resnet, 32 px) and cost models on emulated clusters.

Nothing here measures: the profile is read from tests/data/profiles/ (recorded by
tests/data/record_profiles.py), the collectives are synthetic.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.store import (
    DeviceProfile,
    ModelProfile,
    ProfileSet,
    device_profile_path,
    load,
    model_profile_path,
)
from hetsim.testing.contract import synthetic_comms

RECORDED = Path(__file__).resolve().parent / "data"
"""Holds profiles/ as a results folder does."""
ASSETS = Path(__file__).resolve().parent / "assets"
"""Test models written as users write them (`user_models`)."""


@pytest.fixture
def user_assets(monkeypatch):
    """tests/assets on sys.path for one test, and its `user_models` module forgotten afterwards."""
    monkeypatch.syspath_prepend(str(ASSETS))
    yield ASSETS
    sys.modules.pop("user_models", None)


@pytest.fixture(scope="session")
def gn_profile():
    """(workload, model profile, device profile) of gn_resnet at 32 px, as recorded."""
    from hetsim.workloads.builtin import load_workload

    wl = load_workload("gn_resnet", 32)
    model = load(ModelProfile, model_profile_path(RECORDED, "emu-cpu", wl.spec))
    assert model.model == wl.spec, f"{model.model} recorded, {wl.spec} loaded: run tests/data/record_profiles.py"
    return wl, model, load(DeviceProfile, device_profile_path(RECORDED, "emu-cpu"))


@pytest.fixture(scope="session")
def gpt_profile():
    """The smallest gpt (4 layers, 16 tokens) as recorded: the contract suite's transformer."""
    from hetsim.workloads.builtin import workload_from_spec

    wl = workload_from_spec(GPT_SPEC)
    model = load(ModelProfile, model_profile_path(RECORDED, "emu-cpu", wl.spec))
    assert model.model == wl.spec, f"{model.model} recorded, {wl.spec} loaded: run tests/data/record_profiles.py"
    return wl, model, load(DeviceProfile, device_profile_path(RECORDED, "emu-cpu"))


GPT_SPEC = "gpt@tiny@16"


@pytest.fixture
def make_gpt_cost(gpt_profile):
    wl, model, dev = gpt_profile

    def make(spec: str = "emu:1.0@4G,0.5@4G") -> CostModel:
        cluster = parse_cluster(spec)
        ps = ProfileSet(models={"emu-cpu": model}, devices={"emu-cpu": dev},
                        comm=synthetic_comms(len(cluster.devices)))
        return CostModel(cluster, ps, wl.optimizer)

    return make


@pytest.fixture
def make_cost(gn_profile):
    wl, model, dev = gn_profile

    def make(spec: str = "emu:1.0@4G,0.5@4G", optimizer: str = "adamw") -> CostModel:
        cluster = parse_cluster(spec)
        ps = ProfileSet(models={"emu-cpu": model}, devices={"emu-cpu": dev}, comm=synthetic_comms(len(cluster.devices)))
        return CostModel(cluster, ps, optimizer, has_batchnorm=wl.has_batchnorm)

    return make
