"""`ddp`: data parallel with an uneven batch per device and gradient accumulation.

Real run: torch's DistributedDataParallel.  Each rank's loss is its per-sample
loss sum scaled by world_size / global_batch, so DDP's gradient average equals
the full-batch gradient whatever the split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetsim.errors import InfeasiblePlanError
from hetsim.model.memory import data_parallel_memory  # the memory model of ddp and zero
from hetsim.model.simulator import Resource, StepTiming, TaskGraph, TaskKind
from hetsim.types import MemoryBreakdown

from . import register
from ._contrastive import GlobalBatchLoss
from ._coupled import check_chunks, choose_grad_cache, coupled_gather, coupled_terms
from ._dp_closed import buckets, comm_plan, data_parallel_timing, device_steps, step_terms
from .base import Plan, SearchContext, Strategy, WorkerContext
from .helpers import (
    ParamName,
    apply_checkpointing,
    autocast,
    balance_batch,
    batchnorm_warning,
    choose_accum,
    choose_common,
    choose_devices,
    grads_of_one_pass,
    knobs_label,
    local_floor,
    min_micro_batch,
    own_micro_batches,
    scaled_loss,
    split_evenly,
    train_step,
    uneven_split,
)

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel



class LocalBatches:
    """What the plans of the data-parallel families (ddp, zero) derive from their fields
    `local_batch`, `accum_steps` and `grad_cache_chunks`."""

    @property
    def global_batch(self) -> int:
        return sum(self.local_batch)

    @property
    def chunks(self) -> int:
        """Micro-steps of a local batch: accumulation steps or gradient-cache chunks (one of them is 1)."""
        return self.accum_steps * self.grad_cache_chunks

    def micro_batches(self) -> tuple[int, ...]:
        """Largest micro-batch of each device (what its activations and BatchNorm see)."""
        return tuple(-(-b // self.chunks) for b in self.local_batch)


@dataclass(frozen=True, kw_only=True)
class DDPPlan(LocalBatches, Plan):
    strategy: str = "ddp"
    local_batch: tuple[int, ...]
    """Samples per optimizer step on each plan device (uneven on mismatched devices)."""
    accum_steps: int = 1
    """Gradient-accumulation micro-steps per optimizer step (no_sync on all but the last)."""
    grad_cache_chunks: int = 1
    """Batch-coupled (contrastive) losses only, in place of accumulation: the gradient cache's chunks
    per local batch (1: off).  The loss stays the whole global batch's; each chunk's activations
    live alone, at the cost of a second forward (hetsim.strategies._contrastive)."""


def choose_local_batches(trial, ctx: SearchContext, name: ParamName, devices: tuple[int, ...], precision: str, ckpt: int,
                         memory_of: Callable[[int, int, object], MemoryBreakdown]) -> tuple[int, int, tuple[int, ...]]:
    """(accumulation steps, gradient-cache chunks, each device's local batch) of a ddp or zero plan:
    the two knobs suggested, then the exact min-max batch split under the memory caps, where
    `memory_of(device, micro-batch, coupled terms)` is the family's memory model."""
    accum = choose_accum(trial, ctx, name)
    gc = choose_grad_cache(trial, ctx, name)
    chunks = accum * gc
    cost = ctx.cost

    def memory_fn(dev: int, micro: int) -> MemoryBreakdown:
        return memory_of(dev, micro, coupled_terms(cost, ctx.global_batch, micro * chunks, gc > 1))

    local = balance_batch(cost, devices, ctx.global_batch, chunks, precision, ckpt, local_floor(ctx, chunks),
                          memory_fn=memory_fn, grad_cache=gc > 1)
    return accum, gc, local


def check_local_batches(plan: DDPPlan, cost, family: str) -> None:
    """A ddp or zero plan gives one local batch per device, each at least accum_steps, and its
    accumulation or gradient-cache chunks suit the workload."""
    if len(plan.local_batch) != len(plan.devices):
        raise InfeasiblePlanError(
            f"{family} plan has {len(plan.local_batch)} local batches for {len(plan.devices)} devices; give one per device"
        )
    if plan.accum_steps < 1 or min(plan.local_batch) < plan.accum_steps:
        raise InfeasiblePlanError(
            f"{family} plan local batches {list(plan.local_batch)} must each be >= accum_steps ({plan.accum_steps})"
        )
    check_chunks(plan, cost, family)


def local_batches_label(plan: DDPPlan) -> str:
    """The end of a ddp or zero plan's label: accumulation, gradient cache, precision, checkpointing."""
    s = ""
    if plan.accum_steps > 1:
        s += f" accum {plan.accum_steps}"
    if plan.grad_cache_chunks > 1:
        s += f" grad-cache {plan.grad_cache_chunks}"
    return s + knobs_label(plan)


def data_parallel_graph(cost: CostModel, devices: tuple[int, ...], local_batch: tuple[int, ...], accum: int,
                        precision: str, ckpt: int, opt_params: list[float],
                        extra_before_opt=None, grad_cache: bool = False) -> TaskGraph:
    """Per-device micro-steps, DDP bucketed all-reduce after the last backward, optimizer step.

    A batch-coupled loss gathers every rank's outputs between the forward and the backward (one
    all-gather of the padded outputs; without the gradient cache its backward moves them back):
    every rank's backward waits for the slowest forward.  `grad_cache`: `accum` counts chunks, all
    forwarded once without a graph before the gather, then again, each with its backward."""
    n = cost.facts.n_blocks
    g = TaskGraph()
    bwd_done: dict[tuple[int, int], int] = {}
    sizes = [split_evenly(b, accum) if grad_cache else [b] for b in local_batch]
    gather = coupled_gather(g, cost, devices, sizes, grad_cache, precision)
    group = tuple(devices)
    if gather is None:
        cpu_comm, sync = step_terms(cost, group, device_steps(cost, group, local_batch, accum, precision, ckpt),
                                    comm_plan(cost, group)[1], precision)
    else:  # a coupled step's backward waits for the gather: the uniform term, no core share
        cpu_comm, sync = (0.0,) * len(devices), cost.sync_residual_s(group, precision=precision)
    for i, d in enumerate(devices):
        res = Resource.device(d)
        micro = split_evenly(local_batch[i], accum)
        for j, m in enumerate(micro):
            after = [gather] if j == 0 else []
            if gather is None or grad_cache:  # a plain coupled step ran its forward before the gather
                g.add(res, TaskKind.FORWARD, cost.fwd_s(d, 0, n, m, precision) + cost.overhead_s(d, m, grad_cache, precision), after,
                      label=f"F{j}")
            last = j == len(micro) - 1
            for k in reversed(range(n)):
                dur = cost.bwd_s(d, k, k + 1, m, precision) + cost.recompute_s(d, k, k + 1, m, precision, ckpt)
                tid = g.add(res, TaskKind.BACKWARD, dur, after, label=f"B{j}.{k}")
                after = []
                if last:
                    bwd_done[(i, k)] = tid
        if cpu_comm[i]:
            g.add(res, TaskKind.COMM_CPU, cpu_comm[i], [], label="all-reduce on this core (emulated)")
    comm = []
    for low, nbytes in buckets(cost):
        deps = [bwd_done[(i, low)] for i in range(len(devices))]
        comm.append(g.add(Resource.COMM, TaskKind.ALLREDUCE, cost.allreduce_s(nbytes, group), deps, label=f"allreduce {nbytes >> 20} MiB"))
    if sync and comm:
        comm.append(g.add(Resource.COMM, TaskKind.SYNC, sync, [comm[-1]], label="sync (calibrated)"))
    for i, d in enumerate(devices):
        deps = list(comm)
        if extra_before_opt is not None:
            deps += extra_before_opt(g, i, d)
        g.add(Resource.device(d), TaskKind.OPTIMIZER, cost.opt_s(d, opt_params[i]), deps, label="opt")
    return g


@register
class DDP(Strategy):
    name = "ddp"
    plan_type = DDPPlan
    display_name = "data parallel (uneven batch)"
    param_prefix = ""  # bare Optuna names until results/golden is re-recorded (see Strategy.param_prefix)

    def space(self, trial, ctx: SearchContext) -> DDPPlan:
        devices = choose_devices(trial, ctx, self.param)
        precision, ckpt = choose_common(trial, ctx, devices, self.param)

        def memory_of(dev: int, micro: int, coupled) -> MemoryBreakdown:
            return data_parallel_memory(ctx.cost, dev, micro, precision, ckpt, coupled=coupled)

        accum, gc, local = choose_local_batches(trial, ctx, self.param, devices, precision, ckpt, memory_of)
        return DDPPlan(devices=devices, local_batch=local, accum_steps=accum, grad_cache_chunks=gc,
                       precision=precision, checkpoint_blocks=ckpt)

    def examples(self, ctx: SearchContext) -> list[DDPPlan]:
        n = ctx.cost.n_devices
        devs = tuple(range(n))
        uneven = uneven_split(ctx.global_batch, n)
        # A batch-coupled loss splits its batch with the gradient cache where others accumulate.
        split = {"grad_cache_chunks": 2} if ctx.cost.facts.batch_coupled else {"accum_steps": 2}
        return self.buildable(ctx.cost, [
            lambda: self.baseline(ctx),
            lambda: DDPPlan(devices=devs, local_batch=uneven, **split),
            lambda: DDPPlan(devices=devs, local_batch=uneven, checkpoint_blocks=ctx.cost.facts.n_blocks // 2),
        ])

    def baseline(self, ctx: SearchContext) -> DDPPlan:
        """What a user runs by default: every device, the same local batch, fp32, no accumulation."""
        n = ctx.cost.n_devices
        return DDPPlan(devices=tuple(range(n)), local_batch=tuple(split_evenly(ctx.global_batch, n)))

    def validate(self, plan: DDPPlan, cost) -> None:
        super().validate(plan, cost)
        check_local_batches(plan, cost, "ddp")

    def label(self, plan: DDPPlan) -> str:
        return f"ddp {'/'.join(map(str, plan.local_batch))} on dev {','.join(map(str, plan.devices))}" + local_batches_label(plan)

    def warnings(self, plan: DDPPlan, cost) -> tuple[str, ...]:
        msg = batchnorm_warning(cost, plan.devices, plan.micro_batches())
        return (msg,) if msg else ()

    def step_timing(self, plan: DDPPlan, cost) -> StepTiming | None:
        if cost.facts.batch_coupled:  # the outputs' gather and the gradient cache: event simulation only
            return None
        count = float(cost.trainable_count())
        return data_parallel_timing(cost, plan.devices, plan.local_batch, plan.accum_steps, plan.precision,
                                    plan.checkpoint_blocks, (count,) * len(plan.devices))

    def graph(self, plan: DDPPlan, cost) -> TaskGraph:
        count = cost.trainable_count()
        return data_parallel_graph(cost, plan.devices, plan.local_batch, plan.chunks, plan.precision,
                                   plan.checkpoint_blocks, [count] * len(plan.devices),
                                   grad_cache=plan.grad_cache_chunks > 1)

    def why_never_fits(self, ctx: SearchContext) -> str | None:
        """When no device can hold even the smallest data-parallel footprint (the whole training state,
        one smallest micro-batch, every block checkpointed): which device, how many bytes over; else None."""
        cost = ctx.cost
        micro = min_micro_batch(ctx)
        n = cost.facts.n_blocks
        parts = []
        for d in range(cost.n_devices):
            m = data_parallel_memory(cost, d, micro, "fp32", n if ctx.checkpointing else 0)
            cap = cost.device(d).memory_bytes
            if m.total_bytes <= cap:
                return None
            mib = 2**20
            parts.append(
                f"device {d} needs {m.total_bytes / mib:.0f} MiB, capacity {cap / mib:.0f} MiB "
                f"({(m.total_bytes - cap) / mib:.0f} MiB over: params {m.params_bytes / mib:.0f} + grads "
                f"{m.grads_bytes / mib:.0f} + {cost.optimizer} state {m.optim_bytes / mib:.0f} MiB before "
                f"{(m.activations_bytes + m.other_bytes) / mib:.0f} MiB of activations and temporaries)"
            )
        return ("ddp infeasible: every data-parallel replica holds the whole training state, and even with "
                f"{micro} sample(s) per micro-batch{' and every block checkpointed' if ctx.checkpointing else ''}, "
                + "; ".join(parts) + ". Split the state: pipeline stages or ZeRO/FSDP sharding")

    def memory(self, plan: DDPPlan, cost) -> tuple[MemoryBreakdown, ...]:
        # Bytes depend on the local batch, not on the device: each distinct batch once.
        chunks, gb, cache = plan.chunks, plan.global_batch, plan.grad_cache_chunks > 1
        by_batch = {b: data_parallel_memory(cost, 0, -(-b // chunks), plan.precision, plan.checkpoint_blocks,
                                            coupled=coupled_terms(cost, gb, b, cache))
                    for b in set(plan.local_batch)}
        return tuple([by_batch[b] for b in plan.local_batch])

    def executor(self, plan: DDPPlan, ctx: WorkerContext):
        return DDPExecutor(plan, ctx)


class DataParallelExecutor:
    """Batch slicing, loss scaling, the micro-step and the optimizer step shared by the
    data-parallel executors (DDP, ZeRO-1, FSDP2).  Subclasses set model, stepper, opt and
    _forward_backward."""

    def __init__(self, plan: DDPPlan, ctx: WorkerContext):
        self.plan, self.ctx = plan, ctx
        x, y = ctx.workload.make_batch(plan.global_batch, ctx.seed)
        lo = sum(plan.local_batch[: ctx.rank])
        hi = lo + plan.local_batch[ctx.rank]
        sizes = split_evenly(hi - lo, plan.accum_steps * plan.grad_cache_chunks)
        # A batch-coupled loss (InfoNCE) is taken over every rank's outputs, gathered (_contrastive).
        self.coupled = (GlobalBatchLoss(ctx.workload, plan.local_batch, ctx.rank, ctx.device, plan.precision)
                        if ctx.workload.batch_coupled else None)
        self.micro = own_micro_batches(x, y, lo, hi, sizes, ctx.device)
        # DDP and FSDP average over ranks: scaling each rank's loss sum by world/global gives the
        # full-batch mean gradient whatever the split (FACTS: FSDP averages like DDP).
        self.scale = ctx.world_size / plan.global_batch
        self.scaler = None

    def load_batch(self, x, y, global_size: int) -> None:
        """Train on this rank's samples (x, y) of a global batch of `global_size` next (hetsim.search.train):
        split into the plan's micro-steps, the loss scaled for the new global size."""
        sizes = split_evenly(len(x), min(self.plan.accum_steps, len(x)))
        self.micro = own_micro_batches(x, y, 0, len(x), sizes, self.ctx.device)
        self.scale = self.ctx.world_size / global_size

    def _build_model(self):

        model = self.ctx.workload.model().to(self.ctx.device)
        if self.ctx.emulator is not None:
            self.ctx.emulator.attach(model.children())
        apply_checkpointing(model, self.plan.checkpoint_blocks)
        return model

    def _micro_step(self, module, x, y, low_precision: bool) -> float:
        import contextlib


        if self.coupled is not None:  # the global batch's loss; the gather's backward needs no scaling
            loss = self.coupled.plain(module, x, y, low_precision)
        else:
            with autocast(self.ctx.device, self.plan.precision) if low_precision else contextlib.nullcontext():
                out = module(x)
            loss = self._loss(out, y)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return float(loss.detach())

    def _loss(self, out, y):
        return scaled_loss(self.ctx, out, y, self.scale)

    def step(self) -> float:
        return train_step(self.stepper, self._forward_backward, self.scaler)

    def compute_grads(self):
        return grads_of_one_pass(self.stepper, self._forward_backward, [self.model])



class DDPExecutor(DataParallelExecutor):
    def __init__(self, plan: DDPPlan, ctx: WorkerContext):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(plan, ctx)
        self.model = self._build_model()
        kw = {"device_ids": [ctx.device.index]} if ctx.device.type == "cuda" else {}
        self.ddp = DistributedDataParallel(self.model, gradient_as_bucket_view=True, **kw)
        self.stepper, self.opt = self._make_optimizer()
        if ctx.emulator is not None:
            ctx.emulator.wrap_optimizer(self.opt)
        if plan.precision == "fp16":
            self.scaler = torch.amp.GradScaler("cuda")

    def _make_optimizer(self):
        """(what steps, what holds the state)."""
        opt = self.ctx.workload.make_optimizer(self.ddp.parameters())
        return opt, opt

    def _forward_backward(self) -> float:
        low = self.plan.precision != "fp32"
        if self.plan.grad_cache_chunks > 1:
            return self.coupled.grad_cache(self.model, self.ddp, self.micro, self.ddp.no_sync, low,
                                           self.ctx.world_size)
        total = 0.0
        for j, (x, y) in enumerate(self.micro):
            sync = j == len(self.micro) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                total += self._micro_step(self.ddp, x, y, self.plan.precision != "fp32")
        return total
