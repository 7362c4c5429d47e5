"""A minimal hand-written DDP training loop: the yardstick of the `ddp` executor's overhead.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/minimal_ddp.py \
        --model resnet18@64 --local-batch 21,11 --speeds 1.0,0.5 --steps 10 --warmup 3 --out OUT.json

It trains the same model on the same uneven split as a hetsim `ddp` plan, with nothing but
DistributedDataParallel, AdamW and a timed loop.  The emulated devices are emulated the same way
(hetsim.execution.emulation.Emulator throttles each block of a slower device): that is the "hardware",
not part of the executor being measured.  Like a hetsim run on an emulated cluster, it times
hetsim.profiling.hostspeed's probe before every step (untimed), so that the two can be compared at one host
speed.  Rank 0 writes the slowest rank's median step time, raw and in probe times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hetsim.execution.emulation import Emulator
from hetsim.profiling.hostspeed import HostProbe, at_ref, shared_probes
from hetsim.workloads.builtin import workload_from_spec


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--local-batch", required=True, help="comma list, one per rank")
    p.add_argument("--speeds", required=True, help="comma list of relative speeds, one per rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = [int(b) for b in args.local_batch.split(",")]
    speed = float(args.speeds.split(",")[rank])

    wl = workload_from_spec(args.model)
    model = wl.model()
    emulator = Emulator(speed, 2**62)
    emulator.attach(model.children())
    ddp = DistributedDataParallel(model)
    opt = wl.make_optimizer(ddp.parameters())
    emulator.wrap_optimizer(opt)

    global_batch = sum(local)
    x, y = wl.make_batch(global_batch, 0)
    lo = sum(local[:rank])
    x, y = x[lo : lo + local[rank]], y[lo : lo + local[rank]]
    scale = world / global_batch  # DDP averages: this makes the gradient the full-batch one

    def step() -> None:
        loss = wl.loss_sum(ddp(x), y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    probe = HostProbe()
    dist.barrier()
    times, probes = [], []
    for _ in range(args.steps):
        probes.append(probe())
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    medians: list[float | None] = [None] * world
    all_probes: list[list[float] | None] = [None] * world
    dist.all_gather_object(medians, statistics.median(times))
    dist.all_gather_object(all_probes, probes)
    shared = shared_probes(all_probes)  # one probe per step for all ranks, as hetsim's runner takes it
    per_rank: list[float | None] = [None] * world
    dist.all_gather_object(per_rank, statistics.median(at_ref(times, shared, 1.0)))  # in probe units, as the runner
    if rank == 0:
        step_s = max(medians)
        with open(args.out, "w") as f:
            json.dump({"rank_median_step_s": medians, "step_time_s": step_s,
                       "samples_per_s": global_batch / step_s, "steps_per_probe": max(per_rank)}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit after all work is done


if __name__ == "__main__":
    main()
