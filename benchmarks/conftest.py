"""What every benchmark shares: the workload, the machine's default emulated cluster, its profiles.

The profiles are recorded anew at the start of every bench run, with the main job's two steps
(profiles, then calibration: hetsim.search.profiles.obtain_profiles) under results/local/bench/:
the figures are what a user with a fresh recording gets.  The committed recording in
results/profiles/ is never rewritten; the regression tests and the simulation-only benchmarks
(search and simulator speed) replay it.
"""

from __future__ import annotations

import os
import shutil

import pytest
from bench_config import GLOBAL_BATCH, IMAGE_SIZE, LOCAL, MODEL, PRECISIONS


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what the runner gives each worker process


@pytest.fixture(scope="session")
def workload():
    from hetsim.workloads.builtin import load_workload

    return load_workload(MODEL, IMAGE_SIZE)


@pytest.fixture(scope="session")
def cluster():
    from hetsim.hardware.cluster import DEFAULT_EMULATED, parse_cluster

    return parse_cluster(DEFAULT_EMULATED)


@pytest.fixture(scope="session")
def profiles(cluster, workload):
    from hetsim.search.profiles import obtain_profiles

    shutil.rmtree(LOCAL / "profiles", ignore_errors=True)  # a fresh recording every run
    return obtain_profiles(cluster, workload, root=LOCAL, global_batch=GLOBAL_BATCH, precisions=PRECISIONS)


@pytest.fixture(scope="session")
def cost(cluster, workload, profiles):
    from hetsim.model.costmodel import CostModel

    return CostModel(cluster, profiles, workload.optimizer, has_batchnorm=workload.has_batchnorm,
                     batch_coupled=workload.batch_coupled)


@pytest.fixture(scope="session")
def ctx(cost):
    from hetsim.strategies.base import SearchContext

    return SearchContext(cost=cost, global_batch=GLOBAL_BATCH, precisions=PRECISIONS)
