"""Collective microbenchmarks over the real process group, fitted as alpha + n * beta."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

SIZES = [2**k for k in (10, 14, 17, 20, 22, 24, 25)]  # 1 KiB .. 32 MiB


def _time(fn, device, reps=5) -> float:
    fn()
    ts = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def run_commbench(device: torch.device) -> dict:
    ws = dist.get_world_size()
    rank = dist.get_rank()
    out = {"allreduce": [], "allgather": [], "sendrecv": []}
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4, device=device)
        out["allreduce"].append((nbytes, _time(lambda t=t: dist.all_reduce(t), device)))
        shard = torch.ones(nbytes // 4 // ws, device=device)
        full = torch.empty(shard.numel() * ws, device=device)
        out["allgather"].append((nbytes, _time(lambda s=shard, f=full: dist.all_gather_into_tensor(f, s), device)))

        def sr(t=t):
            if rank == 0:
                dist.send(t, 1)
            elif rank == 1:
                dist.recv(t, 0)

        out["sendrecv"].append((nbytes, _time(sr, device)))
    return out
