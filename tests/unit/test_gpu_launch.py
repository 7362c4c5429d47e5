"""A GPU job is never forked from calibration's warm server: CUDA does not survive a fork (on an H200
every calibration run failed "Cannot re-initialize CUDA in forked subprocess"); it is a torchrun
command.  A CPU job inside `warm_launches()` still goes to the server."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hetsim.strategies.ddp import DDPPlan

from hetsim.execution import runner, warm
from hetsim.execution.worker import Job
from hetsim.hardware.cluster import parse_cluster
from hetsim.serial import to_dict


def _job(tmp_path, backend: str) -> Job:
    cluster = parse_cluster("emu:1.0@1G")
    dev = replace(cluster.devices[0], backend=backend)
    plan = DDPPlan(devices=(0,), local_batch=(2,))
    return Job(task="train", plan=to_dict(plan), workload="mlp", optimizer="adamw", global_batch=2,
               devices=(to_dict(dev),), steps=1, warmup=2, seed=0, out_dir=str(tmp_path / backend), probe=False)


@pytest.mark.parametrize("backend, via", [("cuda", "torchrun"), ("emulated", "warm")])
def test_inside_warm_launches_only_cpu_jobs_go_to_the_warm_server(tmp_path, monkeypatch, backend, via):
    used = []
    monkeypatch.setattr(runner, "_torchrun", lambda *a, **k: used.append("torchrun") or (False, None))

    class Server:
        def run(self, *a, **k):
            used.append("warm")
            return False

    monkeypatch.setattr(warm, "active", lambda: Server())
    results, _, timed_out = runner.launch(_job(tmp_path, backend), 1, 5)
    assert used == [via]
    assert results == [] and not timed_out  # nothing ran: no rank files
