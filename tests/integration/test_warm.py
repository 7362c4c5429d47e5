"""Warm launches (calibration's): a job run by the warm server gives what a fresh torchrun launch
gives (losses, memory), failures come back the same way, and a job that outlives its time limit
takes the server and its ranks down while the next job still runs.

Two emulated ranks on the MLP; the fresh launch is a real torchrun command (about 10-20 s here).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import psutil
import pytest
from hetsim.strategies.ddp import DDPPlan

from hetsim.execution import warm
from hetsim.execution.runner import device_dicts, launch, measure
from hetsim.execution.worker import Fault, Job
from hetsim.hardware.cluster import parse_cluster
from hetsim.serial import to_dict

pytestmark = pytest.mark.slow

CLUSTER = parse_cluster("emu:1.0@1G,0.5@1G")
PLAN = DDPPlan(devices=(0, 1), local_batch=(6, 2))


def _job(out) -> Job:
    return Job(task="train", plan=to_dict(PLAN), workload="mlp", optimizer="adamw", global_batch=8,
               devices=device_dicts(CLUSTER, PLAN.devices), steps=3, warmup=2, seed=3, out_dir=str(out), probe=True)


def _measure(out, fault: Fault | None = None, timeout_s: float = 180):
    return measure(PLAN, cluster=CLUSTER, workload_spec="mlp", optimizer="adamw", steps=2, warmup=2,
                   timeout_s=timeout_s, out_dir=str(out), fault=fault)


def test_a_warm_job_gives_a_fresh_launchs_losses_and_memory(tmp_path):
    fresh, _, _ = launch(_job(tmp_path / "fresh"), 2, 180)
    with warm.warm_launches() as launcher:
        first, _, _ = launch(_job(tmp_path / "warm1"), 2, 180)
        server = launcher.proc.pid
        second, _, _ = launch(_job(tmp_path / "warm2"), 2, 180)
        assert launcher.proc.pid == server  # one server for both jobs
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE
    for results in (first, second):
        assert [r.status for r in results] == ["ok", "ok"]
        for a, b in zip(sorted(fresh, key=lambda r: r.rank), sorted(results, key=lambda r: r.rank)):
            assert a.losses == b.losses
            # Memory by category, to a few bytes (two fresh launches' activations differed by 4 bytes).
            for k, v in dataclasses.asdict(a.memory).items():
                assert abs(getattr(b.memory, k) - v) <= 64, (k, v, getattr(b.memory, k))
    assert (tmp_path / "warm1" / "torchrun.log").exists()


def test_warm_failures_are_reported_as_fresh_ones(tmp_path):
    with warm.warm_launches():
        killed = _measure(tmp_path / "kill", Fault(kind="kill", rank=1, at_step=2))
        crashed = _measure(tmp_path / "raise", Fault(kind="raise", rank=1, at_step=2))
        after = _measure(tmp_path / "ok")
    # The killed rank is named as the cause.  torchrun's subprocess agent lists every failed rank with its
    # exit code ("killed by signal 9"); the fork agent lists the first it polls, here often the survivor.
    assert killed.status == "error" and killed.failed_rank == 1, killed.error
    assert killed.error.startswith(("rank 1 was killed by signal 9 (SIGKILL", "rank 1 ended before it wrote a result")), killed.error
    assert crashed.status == "error" and crashed.error.startswith("rank 1: RuntimeError: injected crash"), crashed.error
    assert after.status == "ok", after.error


def test_a_hanging_warm_job_takes_its_server_down_and_the_next_job_runs(tmp_path):
    result = {}
    seen: set[int] = set()
    with warm.warm_launches() as launcher:
        t = threading.Thread(target=lambda: result.update(m=_measure(tmp_path / "hang", Fault(kind="hang", rank=0, at_step=2),
                                                                     timeout_s=30)))
        t0 = time.monotonic()
        t.start()
        while time.monotonic() - t0 < 28 and t.is_alive():  # the server and its agent's forked ranks
            proc = launcher.proc
            if proc is not None:
                try:
                    seen |= {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
                except psutil.Error:
                    pass
            time.sleep(0.5)
        t.join(timeout=120)
        assert not t.is_alive()
        assert result["m"].status == "timeout", result["m"].error
        assert "exceeded the 30 s timeout" in result["m"].error
        assert len(seen) >= 3, seen  # the server and two ranks were seen
        time.sleep(1)
        alive = [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"processes outlived their job: {alive}"
        after = _measure(tmp_path / "ok")
        assert after.status == "ok", after.error
