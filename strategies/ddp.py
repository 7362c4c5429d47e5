"""`ddp`: data parallel with an uneven batch per device and gradient accumulation.

Real run: torch's DistributedDataParallel.  Each rank's loss is its per-sample
loss sum scaled by world_size / global_batch, so DDP's gradient average equals
the full-batch gradient whatever the split.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetsim.errors import InfeasiblePlanError
from hetsim.hardware.cluster import interchangeable_groups
from hetsim.model.memory import data_parallel_memory  # the memory model of ddp and zero
from hetsim.model.simulator import StepTiming, TaskGraph
from hetsim.types import MemoryBreakdown

from . import register
from ._common import apply_checkpointing, autocast, full_grads
from ._contrastive import GlobalBatchLoss
from ._coupled import check_chunks, choose_grad_cache, coupled_gather, coupled_terms
from ._dp_closed import buckets, data_parallel_timing, micro_sizes
from .base import Plan, SearchContext, Strategy, WorkerContext, batchnorm_warning

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel



@dataclass(frozen=True, kw_only=True)
class DDPPlan(Plan):
    strategy: str = "ddp"
    local_batch: tuple[int, ...]
    """Samples per optimizer step on each plan device (uneven on mismatched devices)."""
    accum_steps: int = 1
    """Gradient-accumulation micro-steps per optimizer step (no_sync on all but the last)."""
    grad_cache_chunks: int = 1
    """Batch-coupled (contrastive) losses only, in place of accumulation: the gradient cache's chunks
    per local batch (1: off).  The loss stays the whole global batch's; each chunk's activations
    live alone, at the cost of a second forward (hetsim.strategies._contrastive)."""

    @property
    def global_batch(self) -> int:
        return sum(self.local_batch)

    @property
    def chunks(self) -> int:
        """Micro-steps of a local batch: accumulation steps or gradient-cache chunks (one of them is 1)."""
        return self.accum_steps * self.grad_cache_chunks


def min_max_split(n: int, total: int, floor: int, time_of: Callable[[int, int], float],
                  fits: Callable[[int, int], bool] = lambda i, b: True) -> tuple[int, ...]:
    """Exact min-max split of `total` samples over `n` workers, each at least `floor`: each next
    sample goes to the worker that would finish it soonest (`time_of(i, b)`: worker i's time with
    b samples, non-decreasing in b).  Workers whose next sample would not fit (`fits`) take no more
    while that is possible; when it is not, memory is ignored (the caller's memory check refuses).

    A heap of (time with one more sample, position) keeps the greedy at O(total log n) time
    evaluations; ties go to the lowest position, as a linear scan would.  A worker that cannot fit
    one more sample never can later (its share no longer changes), so it leaves the heap for good.
    The search's batch split (`balance_batch`) and the rebalancing of `hetsim.train` both use it.
    """
    extra = total - floor * n
    for respect_memory in (True, False):
        local = [floor] * n
        heap = [(time_of(i, floor + 1), i) for i in range(n)]
        heapq.heapify(heap)
        placed = 0
        while placed < extra and heap:
            _, i = heapq.heappop(heap)
            if respect_memory and not fits(i, local[i] + 1):
                continue
            local[i] += 1
            placed += 1
            heapq.heappush(heap, (time_of(i, local[i] + 1), i))
        if placed == extra:
            break
    return tuple(local)


def balance_batch(cost: CostModel, devices: tuple[int, ...], global_batch: int, accum: int,
                  precision: str, ckpt: int, min_local: int, *,
                  memory_fn: Callable[[int, int], MemoryBreakdown] | None = None,
                  grad_cache: bool = False) -> tuple[int, ...]:
    """Exact min-max split: each next sample goes to the device that finishes it soonest.

    Per-device step time is non-decreasing in its batch, so this greedy is optimal for
    the slowest-device objective.  Memory caps bound each device's share when they can;
    `memory_fn(device, micro_batch)` gives a family's own memory model (default: plain DDP's).
    The greedy itself is `min_max_split`.
    `grad_cache`: `accum` counts gradient-cache chunks, each forwarded twice.
    """
    n = cost.facts.n_blocks
    floor = max(min_local, accum)
    if floor * len(devices) > global_batch:
        raise InfeasiblePlanError(
            f"global batch {global_batch} cannot give each of {len(devices)} devices at least {floor} samples "
            f"(min local batch {min_local}, {accum} accumulation steps); raise --global-batch or use fewer devices"
        )
    opt_params = cost.param_count()
    fit_memo: dict[tuple[int, int], bool] = {}

    def compute_time(d: int, b: int) -> float:
        t = sum(cost.fwd_s(d, 0, n, m, precision) * (2 if grad_cache else 1) + cost.bwd_s(d, 0, n, m, precision)
                + cost.recompute_s(d, 0, n, m, precision, ckpt) + cost.overhead_s(d, m) * (2 if grad_cache else 1)
                for m in micro_sizes(b, accum))
        return t + cost.opt_s(d, opt_params)

    def step_time(i: int, b: int) -> float:
        d = devices[i]
        return cost.memo(("ddp_step", d, b, accum, precision, ckpt, grad_cache), lambda: compute_time(d, b))

    def fits(i: int, b: int) -> bool:
        d = devices[i]
        micro = -(-b // accum)
        key = (d, micro)
        if key not in fit_memo:
            m = memory_fn(d, micro) if memory_fn else data_parallel_memory(cost, d, micro, precision, ckpt)
            fit_memo[key] = m.total_bytes <= cost.device(d).memory_bytes
        return fit_memo[key]

    return min_max_split(len(devices), global_batch, floor, step_time, fits)


def choose_devices(trial, ctx: SearchContext) -> tuple[int, ...]:
    """Which devices take part, in index order: one suggestion per group of interchangeable devices.

    A device like no other is a yes/no, `use_dev{i}` (as before groups existed, so a study over
    mismatched devices samples exactly as it did).  A group of k identical devices is a count
    0..k, `count_dev{first}`, and takes the group's first devices: which ones cannot change a
    prediction.  On 64 devices of 4 kinds that is 4 counts instead of 64 coins, which TPE handles
    far faster and which reaches any subset size with fair odds (64 coins almost always pick ~32).
    """
    cost = ctx.cost
    if cost.n_devices == 1:
        return (0,)
    groups = cost.memo(("interchangeable_groups",), lambda: interchangeable_groups(cost.cluster))
    used: list[int] = []
    for g in groups:
        if len(g) == 1:
            if trial.suggest_categorical(f"use_dev{g[0]}", [True, False]):
                used.append(g[0])
        else:
            used.extend(g[: trial.suggest_int(f"count_dev{g[0]}", 0, len(g))])
    if not used:
        raise InfeasiblePlanError(
            "the trial chose no device (every use_dev* is False and every count_dev* is 0); "
            "a plan needs at least one device"
        )
    return tuple(sorted(used))


def choose_common(trial, ctx: SearchContext, devices: tuple[int, ...]) -> tuple[str, int]:
    cost = ctx.cost
    precs = [p for p in ctx.precisions if all(_precision_ok(cost, d, p) for d in devices)] or ["fp32"]
    precision = trial.suggest_categorical("precision", list(ctx.precisions))
    if precision not in precs:
        raise InfeasiblePlanError(f"precision {precision} is not supported by every chosen device")
    n = cost.facts.n_blocks
    ckpt = trial.suggest_categorical("checkpoint_blocks", [0, n // 2, n]) if ctx.checkpointing else 0
    return precision, ckpt


def choose_accum(trial, ctx: SearchContext) -> int:
    """Gradient-accumulation steps (always 1 where the loss couples the samples: there the
    gradient cache, `choose_grad_cache`, takes its place)."""
    if ctx.cost.facts.batch_coupled:
        return 1
    return trial.suggest_categorical("accum_steps", [a for a in (1, 2, 4) if a <= ctx.max_accum])


def local_floor(ctx: SearchContext, accum: int) -> int:
    """Fewest samples a device's local batch may have: BatchNorm needs two in every micro-batch,
    not just in every local batch."""
    return max(DDP.min_local(ctx), accum * (2 if ctx.cost.facts.has_batchnorm else 1))


def uniform_split(global_batch: int, n: int) -> tuple[int, ...]:
    """The same local batch on n devices (the first ones take the remainder)."""
    return tuple(micro_sizes(global_batch, n))


def uneven_split(global_batch: int, n: int) -> tuple[int, ...]:
    """An example uneven split: device 0 takes what the others, at gb // (n + 1) each, leave."""
    if n == 1:
        return (global_batch,)
    rest = global_batch // (n + 1)
    return tuple([global_batch - rest * (n - 1)] + [rest] * (n - 1))


def _precision_ok(cost: CostModel, dev: int, precision: str) -> bool:
    d = cost.device(dev)
    if precision == "bf16":
        return d.supports_bf16
    if precision == "fp16":
        return d.backend != "emulated"  # fp16 autocast with loss scaling is CUDA-only
    return True


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
    sizes = [micro_sizes(b, accum) if grad_cache else [b] for b in local_batch]
    gather = coupled_gather(g, cost, devices, sizes, grad_cache, precision)
    for i, d in enumerate(devices):
        res = f"dev{d}"
        micro = micro_sizes(local_batch[i], accum)
        for j, m in enumerate(micro):
            after = [gather] if j == 0 else []
            if gather is None or grad_cache:  # a plain coupled step ran its forward before the gather
                g.add(res, "F", cost.fwd_s(d, 0, n, m, precision) + cost.overhead_s(d, m), after, label=f"F{j}")
            last = j == len(micro) - 1
            for k in reversed(range(n)):
                dur = cost.bwd_s(d, k, k + 1, m, precision) + cost.recompute_s(d, k, k + 1, m, precision, ckpt)
                tid = g.add(res, "B", dur, after, label=f"B{j}.{k}")
                after = []
                if last:
                    bwd_done[(i, k)] = tid
    group = tuple(devices)
    comm = []
    for low, nbytes in buckets(cost):
        deps = [bwd_done[(i, low)] for i in range(len(devices))]
        comm.append(g.add("comm", "allreduce", cost.allreduce_s(nbytes, group), deps, label=f"allreduce {nbytes >> 20} MiB"))
    sync = cost.sync_residual_s(group)
    if sync and comm:
        comm.append(g.add("comm", "sync", sync, [comm[-1]], label="sync (calibrated)"))
    for i, d in enumerate(devices):
        deps = list(comm)
        if extra_before_opt is not None:
            deps += extra_before_opt(g, i, d)
        g.add(f"dev{d}", "opt", cost.opt_s(d, opt_params[i]), deps, label="opt")
    return g


@register
class DDP(Strategy):
    name = "ddp"
    plan_type = DDPPlan
    display_name = "data parallel (uneven batch)"

    def space(self, trial, ctx: SearchContext) -> DDPPlan:
        devices = choose_devices(trial, ctx)
        precision, ckpt = choose_common(trial, ctx, devices)
        accum = choose_accum(trial, ctx)
        gc = choose_grad_cache(trial, ctx)
        chunks = accum * gc
        cost = ctx.cost

        def memory_of(dev: int, micro: int) -> MemoryBreakdown:
            return data_parallel_memory(cost, dev, micro, precision, ckpt,
                                        coupled=coupled_terms(cost, ctx.global_batch, micro * chunks, gc > 1))

        local = balance_batch(cost, devices, ctx.global_batch, chunks, precision, ckpt, local_floor(ctx, chunks),
                              memory_fn=memory_of, grad_cache=gc > 1)
        return DDPPlan(devices=devices, local_batch=local, accum_steps=accum, grad_cache_chunks=gc,
                       precision=precision, checkpoint_blocks=ckpt)

    @staticmethod
    def min_local(ctx: SearchContext) -> int:
        # BatchNorm needs more than one value per channel in every micro-batch.
        return max(ctx.min_local_batch, 2 if ctx.cost.facts.has_batchnorm else 1)

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
        return DDPPlan(devices=tuple(range(n)), local_batch=uniform_split(ctx.global_batch, n))

    def validate(self, plan: DDPPlan, cost) -> None:
        super().validate(plan, cost)
        if len(plan.local_batch) != len(plan.devices):
            raise InfeasiblePlanError(
                f"ddp plan has {len(plan.local_batch)} local batches for {len(plan.devices)} devices; give one per device"
            )
        if plan.accum_steps < 1 or min(plan.local_batch) < plan.accum_steps:
            raise InfeasiblePlanError(
                f"ddp plan local batches {list(plan.local_batch)} must each be >= accum_steps ({plan.accum_steps})"
            )
        check_chunks(plan, cost, "ddp")

    def label(self, plan: DDPPlan) -> str:
        s = f"ddp {'/'.join(map(str, plan.local_batch))} on dev {','.join(map(str, plan.devices))}"
        if plan.accum_steps > 1:
            s += f" accum {plan.accum_steps}"
        if plan.grad_cache_chunks > 1:
            s += f" grad-cache {plan.grad_cache_chunks}"
        if plan.precision != "fp32":
            s += f" {plan.precision}"
        if plan.checkpoint_blocks:
            s += f" ckpt {plan.checkpoint_blocks}"
        return s

    def warnings(self, plan: DDPPlan, cost) -> tuple[str, ...]:
        micro = tuple(-(-b // plan.chunks) for b in plan.local_batch)
        msg = batchnorm_warning(cost, plan.devices, micro)
        return (msg,) if msg else ()

    def step_timing(self, plan: DDPPlan, cost) -> StepTiming | None:
        if cost.facts.batch_coupled:  # the outputs' gather and the gradient cache: event simulation only
            return None
        count = float(cost.param_count())
        return data_parallel_timing(cost, plan.devices, plan.local_batch, plan.accum_steps, plan.precision,
                                    plan.checkpoint_blocks, (count,) * len(plan.devices))

    def graph(self, plan: DDPPlan, cost) -> TaskGraph:
        count = cost.param_count()
        return data_parallel_graph(cost, plan.devices, plan.local_batch, plan.chunks, plan.precision,
                                   plan.checkpoint_blocks, [count] * len(plan.devices),
                                   grad_cache=plan.grad_cache_chunks > 1)

    def why_never_fits(self, ctx: SearchContext) -> str | None:
        """When no device can hold even the smallest data-parallel footprint (the whole training state,
        one smallest micro-batch, every block checkpointed): which device, how many bytes over; else None."""
        cost = ctx.cost
        micro = max(ctx.min_local_batch, 2 if cost.facts.has_batchnorm else 1)
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
        return tuple(
            data_parallel_memory(cost, d, -(-b // plan.chunks), plan.precision, plan.checkpoint_blocks,
                                 coupled=coupled_terms(cost, plan.global_batch, b, plan.grad_cache_chunks > 1))
            for d, b in zip(plan.devices, plan.local_batch)
        )

    def executor(self, plan: DDPPlan, ctx: WorkerContext):
        return DDPExecutor(plan, ctx)


class DataParallelExecutor:
    """Batch slicing, loss scaling, the micro-step and the optimizer step shared by the
    data-parallel executors (DDP, ZeRO-1, FSDP2).  Subclasses set model, stepper, opt and
    _forward_backward."""

    def __init__(self, plan: DDPPlan, ctx: WorkerContext):
        import torch

        self.plan, self.ctx = plan, ctx
        x, y = ctx.workload.make_batch(plan.global_batch, ctx.seed)
        lo = sum(plan.local_batch[: ctx.rank])
        hi = lo + plan.local_batch[ctx.rank]
        sizes = micro_sizes(hi - lo, plan.accum_steps * plan.grad_cache_chunks)
        # A batch-coupled loss (InfoNCE) is taken over every rank's outputs, gathered (_contrastive).
        self.coupled = (GlobalBatchLoss(ctx.workload, plan.local_batch, ctx.rank, ctx.device, plan.precision)
                        if ctx.workload.batch_coupled else None)
        self.micro = [(a.to(ctx.device), b.to(ctx.device)) for a, b in zip(torch.split(x[lo:hi], sizes),
                                                                         torch.split(y[lo:hi], sizes))]
        # DDP and FSDP average over ranks: scaling each rank's loss sum by world/global gives the
        # full-batch mean gradient whatever the split (FACTS: FSDP averages like DDP).
        self.scale = ctx.world_size / plan.global_batch
        self.scaler = None

    def load_batch(self, x, y, global_size: int) -> None:
        """Train on this rank's samples (x, y) of a global batch of `global_size` next (hetsim.train):
        split into the plan's micro-steps, the loss scaled for the new global size."""
        import torch

        sizes = micro_sizes(len(x), min(self.plan.accum_steps, len(x)))
        dev = self.ctx.device
        self.micro = [(a.to(dev), b.to(dev)) for a, b in zip(torch.split(x, sizes), torch.split(y, sizes))]
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
            loss = self.ctx.workload.loss_sum(out.float(), y) * self.scale
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return float(loss.detach())

    def step(self) -> float:
        loss = self._forward_backward()
        if self.scaler:
            self.scaler.step(self.stepper)
            self.scaler.update()
        else:
            self.stepper.step()
        # Gradients stay allocated between steps (as ddp's): the measured peak holds them throughout.
        self.stepper.zero_grad(set_to_none=False)
        return loss

    def compute_grads(self):

        self.stepper.zero_grad(set_to_none=True)
        self._forward_backward()
        return full_grads(self.model)



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
