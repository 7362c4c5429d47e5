"""`prepare`: apply a found plan inside your own training loop, in the spirit of accelerate's
`prepare`.

    from hetsim.search.train import prepare

    run = prepare("best_plan.json", model, lambda params: torch.optim.AdamW(params, lr=3e-4), dataset)
    for x, y in run.batches(steps=1000):      # this rank's share of each global batch
        for xm, ym in run.micro_batches(x, y):  # the plan's accumulation (no_sync inside)
            run.backward(loss_fn(run.model(xm), ym))  # loss_fn sums over samples
        run.step()

Run it under torchrun with the plan's number of ranks (launch.sh shows the command).  The plan's
family wraps the model: `ddp` with DistributedDataParallel, `zero` stage 1 with
ZeroRedundancyOptimizer, stages 2 and 3 with FSDP2's `fully_shard` on every child and the root
(the optimizer is built after wrapping, hence a factory).  `backward` scales a summed loss by
world size / global batch, so uneven shares give the full-batch mean gradient.  Pipeline plans
need the model cut into stages and their own schedule: train them with `python -m hetsim.search.train`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from hetsim.search.train.data import collate
from hetsim.search.train.sampler import PlanSampler
from hetsim.strategies import plan_from_dict
from torch import nn

from hetsim.errors import ConfigError
from hetsim.execution.planfile import PlanFile, load_plan_file
from hetsim.model.batchsplit import split_evenly


@dataclass
class Prepared:
    """A model, optimizer and data feed wrapped for one plan, on this rank."""

    plan_file: PlanFile
    model: nn.Module
    """The wrapped model (DDP or FSDP2): call it for the forward pass."""
    optimizer: torch.optim.Optimizer
    sampler: PlanSampler
    dataset: object
    accum_steps: int = 1
    _ddp: nn.Module | None = None
    _global_size: int = 0

    def batches(self, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, targets) of each of the next `steps` global batches."""
        for _ in range(steps):
            idx, self._global_size = self.sampler.next_batch()
            yield collate(self.dataset, idx)

    def micro_batches(self, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The plan's accumulation micro-steps; gradients synchronise on the last one only."""
        parts = split_evenly(len(x), min(self.accum_steps, len(x)))
        for j, (xm, ym) in enumerate(zip(torch.split(x, parts), torch.split(y, parts))):
            last = j == len(parts) - 1
            with contextlib.nullcontext() if last or self._ddp is None else self._ddp.no_sync():
                yield xm, ym

    def backward(self, loss_sum: torch.Tensor) -> None:
        """Backpropagate a loss summed over this micro-batch's samples."""
        if self._global_size == 0:
            raise RuntimeError("call backward on samples from batches()")
        (loss_sum * dist.get_world_size() / self._global_size).backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def set_shares(self, shares: tuple[int, ...]) -> None:
        """Rebalance: the samples per rank of the next global batches (same total)."""
        if sum(shares) != self.sampler.global_batch or len(shares) != len(self.sampler.shares):
            raise ConfigError(f"shares {shares} must be {len(self.sampler.shares)} counts adding up to "
                              f"{self.sampler.global_batch}")
        self.sampler.shares = tuple(shares)


def prepare(plan: str | PlanFile, model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer], dataset,
            *, seed: int = 0) -> Prepared:
    """Wrap `model` for the plan on this rank (torch.distributed must be initialised by torchrun);
    `optimizer(params)` builds the optimizer after wrapping."""
    pf = plan if isinstance(plan, PlanFile) else load_plan_file(plan)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if all(d.get("backend") == "cuda" for d in pf.devices) else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != pf.world_size:
        raise ConfigError(f"the plan runs on {pf.world_size} ranks, this group has {world}; "
                          f"start it with torchrun --nproc-per-node {pf.world_size}")
    p = plan_from_dict(pf.plan)
    if not hasattr(p, "local_batch"):
        raise ConfigError(f"prepare() applies data-parallel plans (ddp, zero); this is a {p.strategy} plan: "
                          "train it with python -m hetsim.search.train")
    dev = pf.devices[rank]
    device = torch.device("cuda", dev.get("index", 0)) if dev.get("backend") == "cuda" else torch.device("cpu")
    model = model.to(device)
    ddp = None
    stage = getattr(p, "zero_stage", 0)
    if stage >= 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for child in model.children():
            fully_shard(child, mesh=mesh, reshard_after_forward=stage == 3)
        fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
        wrapped = model
        opt = optimizer(model.parameters())
    else:
        from torch.nn.parallel import DistributedDataParallel

        kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
        wrapped = ddp = DistributedDataParallel(model, **kw)
        opt = optimizer(ddp.parameters())
        if stage == 1:
            from hetsim.strategies.zero import zero1_optimizer

            opt = zero1_optimizer(ddp.parameters(), type(opt), **opt.defaults)
    sampler = PlanSampler(len(dataset), tuple(p.local_batch), rank, seed=seed)
    return Prepared(plan_file=pf, model=wrapped, optimizer=opt, sampler=sampler, dataset=dataset,
                    accum_steps=getattr(p, "accum_steps", 1), _ddp=ddp)
