"""The per-rank entry point of every real run, started by torchrun on each rank:

    python -m torch.distributed.run --standalone --nproc-per-node N -m hetsim.strategies.rank JOB.json

It lives in the strategy layer because it turns the job's plan into that family's executor; the
loop around it (memory step, warm-up, timed steps, rank files) is the core's
(`hetsim.execution.worker`), which never imports a strategy.
"""

from __future__ import annotations

import sys

from hetsim.execution.worker import Job, RankEnv, main

from . import get, plan_from_dict
from .base import Executor, WorkerContext


def build_executor(job: Job, env: RankEnv) -> Executor:
    """The executor of the job's plan on this rank, built by the plan's family."""
    plan = plan_from_dict(job.plan)
    ctx = WorkerContext(rank=env.rank, world_size=env.world_size, device=env.device, workload=env.workload,
                        global_batch=job.global_batch, seed=job.seed, emulator=env.emulator, backend=env.backend)
    return get(plan.strategy).executor(plan, ctx)


if __name__ == "__main__":
    main(sys.argv[1:], build_executor)
