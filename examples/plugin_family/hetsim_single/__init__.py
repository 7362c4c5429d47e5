"""`single`: an example third-party hetsim family that trains the whole global batch on one device.

It shows the plugin contract (hetsim.strategies.base) end to end in one short file: a frozen
plan, a search space whose parameters carry the family's prefix (`single.device`), a task graph
on the device's resource, the memory of one replica, and a real run with PyTorch's own autocast,
checkpointing and optimizer.  Registered through the `hetsim.strategies` entry-point group
(see pyproject.toml); `python -m pytest --pyargs hetsim.testing` checks it like any built-in family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hetsim.strategies.base import (
    Plan,
    Resource,
    SearchContext,
    Strategy,
    TaskGraph,
    TaskKind,
    WorkerContext,
)
from hetsim.strategies.helpers import (
    apply_checkpointing,
    autocast,
    choose_accum,
    choose_common,
    grads_of_one_pass,
    min_micro_batch,
    split_evenly,
    train_step,
)

from hetsim.errors import InfeasiblePlanError
from hetsim.model.memory import data_parallel_memory

__all__ = ["Single", "SinglePlan"]


@dataclass(frozen=True, kw_only=True)
class SinglePlan(Plan):
    strategy: str = "single"
    batch: int
    """Samples per optimizer step, all on devices[0]."""
    accum_steps: int = 1
    """Gradient-accumulation micro-steps per optimizer step."""

    @property
    def global_batch(self) -> int:
        return self.batch


class Single(Strategy):
    name = "single"
    plan_type = SinglePlan
    display_name = "one device (the whole batch)"
    contract_workloads = ("gn_resnet@32", "mlp")

    def space(self, trial, ctx: SearchContext) -> SinglePlan:
        device = trial.suggest_categorical(self.param("device"), list(range(ctx.cost.n_devices)))
        precision, ckpt = choose_common(trial, ctx, (device,), self.param)
        accum = choose_accum(trial, ctx, self.param)
        if ctx.global_batch // accum < min_micro_batch(ctx):
            raise InfeasiblePlanError(f"{accum} accumulation steps leave micro-batches below {min_micro_batch(ctx)}")
        return SinglePlan(devices=(device,), batch=ctx.global_batch, accum_steps=accum, precision=precision,
                          checkpoint_blocks=ckpt)

    def examples(self, ctx: SearchContext) -> list[SinglePlan]:
        fastest = max(range(ctx.cost.n_devices), key=lambda d: ctx.cost.device(d).speed)
        return self.buildable(ctx.cost, [
            lambda: SinglePlan(devices=(fastest,), batch=ctx.global_batch, accum_steps=2),
            lambda: SinglePlan(devices=(fastest,), batch=ctx.global_batch, checkpoint_blocks=1),
        ])

    def baseline(self, ctx: SearchContext) -> SinglePlan:
        """The first device, the whole batch at once."""
        return SinglePlan(devices=(0,), batch=ctx.global_batch)

    def validate(self, plan: SinglePlan, cost) -> None:
        super().validate(plan, cost)
        if len(plan.devices) != 1:
            raise InfeasiblePlanError(f"a single plan runs on one device, not {list(plan.devices)}")
        if not 1 <= plan.accum_steps <= plan.batch:
            raise InfeasiblePlanError(f"accum_steps {plan.accum_steps} must be in 1..batch ({plan.batch})")

    def label(self, plan: SinglePlan) -> str:
        extra = f" accum {plan.accum_steps}" if plan.accum_steps > 1 else ""
        return f"single {plan.batch} on dev {plan.devices[0]}{extra}"

    def graph(self, plan: SinglePlan, cost) -> TaskGraph:
        d, n = plan.devices[0], cost.facts.n_blocks
        res = Resource.device(d)
        g = TaskGraph()
        for j, m in enumerate(split_evenly(plan.batch, plan.accum_steps)):
            g.add(res, TaskKind.FORWARD, cost.fwd_s(d, 0, n, m, plan.precision) + cost.overhead_s(d, m), label=f"F{j}")
            bwd = cost.bwd_s(d, 0, n, m, plan.precision)
            g.add(res, TaskKind.BACKWARD, bwd + cost.recompute_s(d, 0, n, m, plan.precision, plan.checkpoint_blocks),
                  label=f"B{j}")
        g.add(res, TaskKind.OPTIMIZER, cost.opt_s(d, cost.param_count()), label="opt")
        return g

    def memory(self, plan: SinglePlan, cost):
        micro = -(-plan.batch // plan.accum_steps)
        return (data_parallel_memory(cost, plan.devices[0], micro, plan.precision, plan.checkpoint_blocks),)

    def executor(self, plan: SinglePlan, ctx: WorkerContext) -> SingleExecutor:
        return SingleExecutor(plan, ctx)


class SingleExecutor:
    """The whole batch on this (only) rank; `model` and `opt` let hetsim attribute its memory."""

    def __init__(self, plan: SinglePlan, ctx: WorkerContext):
        self.plan, self.ctx = plan, ctx
        self.model = ctx.workload.model().to(ctx.device)
        if ctx.emulator is not None:
            ctx.emulator.attach(self.model.children())
        apply_checkpointing(self.model, plan.checkpoint_blocks)
        self.opt = ctx.workload.make_optimizer(self.model.parameters())
        if ctx.emulator is not None:
            ctx.emulator.wrap_optimizer(self.opt)
        self.scaler = torch.amp.GradScaler("cuda") if plan.precision == "fp16" else None
        x, y = ctx.workload.make_batch(plan.batch, ctx.seed)
        sizes = split_evenly(plan.batch, plan.accum_steps)
        self.micro = [(a.to(ctx.device), b.to(ctx.device)) for a, b in zip(x.split(sizes), y.split(sizes))]

    def _forward_backward(self) -> float:
        total = 0.0
        for x, y in self.micro:
            with autocast(self.ctx.device, self.plan.precision):
                out = self.model(x)
            loss = self.ctx.workload.loss_sum(out.float(), y) / self.plan.batch
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += float(loss.detach())
        return total

    def step(self) -> float:
        return train_step(self.opt, self._forward_backward, self.scaler)

    def compute_grads(self) -> dict[str, torch.Tensor]:
        return grads_of_one_pass(self.opt, self._forward_backward, [self.model])
