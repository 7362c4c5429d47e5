"""Calibration's pooled runs (`hetsim.execution.pool`): several jobs in one torchrun give what fresh
launches give, a job of another world size gets its own torchrun, and a failing or hanging job is
reported as a fresh launch's would be, after which the next job runs in a new torchrun.

Two emulated ranks on the MLP; real torchrun launches.
"""

from __future__ import annotations

import json

import pytest
from clitools import processes_naming
from hetsim.strategies.ddp import DDPPlan

from hetsim.execution.pool import pooled_runs
from hetsim.execution.runner import measure
from hetsim.execution.worker import Fault
from hetsim.hardware.cluster import parse_cluster

pytestmark = pytest.mark.slow

CLUSTER = parse_cluster("emu:1.0@1G,0.5@1G")
PLAN = DDPPlan(devices=(0, 1), local_batch=(6, 2))
ONE = DDPPlan(devices=(0,), local_batch=(4,))


def run(plan, out, fault: Fault | None = None, timeout_s: float = 180):
    return measure(plan, cluster=CLUSTER, workload_spec="mlp", optimizer="adamw", steps=2, warmup=2,
                   timeout_s=timeout_s, out_dir=str(out), fault=fault)


def losses(out, rank: int = 0) -> list[float]:
    return json.loads((out / f"rank{rank}.json").read_text())["losses"]


def test_jobs_share_a_torchrun_and_match_a_fresh_launch(tmp_path):
    fresh = run(PLAN, tmp_path / "fresh")
    with pooled_runs(tmp_path / "pool") as pool:
        runs = [run(plan, tmp_path / f"run{i}") for i, plan in enumerate((PLAN, PLAN, ONE, PLAN))]
        assert pool.launches == 3  # two-rank jobs, then a one-rank job, then two ranks again
        assert processes_naming(str(tmp_path / "pool")), "the pool's torchrun should still be running"
    assert [m.status for m in runs] == ["ok"] * 4, [m.error for m in runs]
    assert not processes_naming(str(tmp_path / "pool")), "the pool's processes outlived it"
    # Same plan and seed: the same losses on every rank as a fresh launch, whatever ran before it in the pool.
    for i in (0, 1, 3):
        for rank in (0, 1):
            assert losses(tmp_path / f"run{i}", rank) == losses(tmp_path / "fresh", rank)
    assert runs[1].peak_mem_bytes == fresh.peak_mem_bytes
    assert all(m.step_time_s > 0 for m in runs)


@pytest.mark.parametrize("fault,status,timeout_s", [(Fault(kind="raise", rank=1, at_step=2), "error", 180),
                                                    (Fault(kind="hang", rank=0, at_step=2), "timeout", 30)])
def test_a_failed_job_is_reported_and_the_next_gets_a_new_torchrun(tmp_path, fault, status, timeout_s):
    with pooled_runs(tmp_path / "pool") as pool:
        first = run(PLAN, tmp_path / "ok")
        failed = run(PLAN, tmp_path / "failed", fault=fault, timeout_s=timeout_s)
        assert not processes_naming(str(tmp_path / "pool")), "a failed job's torchrun outlived it"
        after = run(PLAN, tmp_path / "after")
        assert pool.launches == 2
    assert first.status == "ok" and after.status == "ok", (first.error, after.error)
    assert failed.status == status, failed.error
    if status == "error":
        assert failed.error.startswith("rank 1:") and "injected crash" in failed.error
    assert losses(tmp_path / "after") == losses(tmp_path / "ok")
    assert not processes_naming(str(tmp_path / "pool"))
