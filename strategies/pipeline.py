"""`pipeline`: non-uniform stages on chosen devices in a chosen order, torch's schedules.

Optuna picks the devices, their order, the schedule, the stages per rank and the
number of micro-batches; the stage boundaries that minimise the step time under
every device's memory cap are then computed exactly by dynamic programming
(`_pipeline_bounds.solve_boundaries`).  Model parallelism as people write it by hand
is the one-micro-batch case (GPipe, m = 1), and its label says "model parallel".

Simulation times the per-rank action lists the executor's torch schedule runs;
real runs use `torch.distributed.pipelining` (`PipelineStage` + schedule class).

Batch-coupled (contrastive) losses: torch's schedules call the loss once per micro-batch on the
last stage and backpropagate each micro-batch's loss on its own, so an InfoNCE over the whole batch
exists only with one micro-batch: such workloads get one micro-batch per pipeline (model
parallelism; the outputs come out of the last stage, where `hybrid` replicas also gather each
other's).  A gradient cache through a pipeline would need a schedule of its own and is not offered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetsim.errors import InfeasiblePlanError
from hetsim.hardware.cluster import interchangeable_groups
from hetsim.model.simulator import TaskGraph
from hetsim.types import MemoryBreakdown

from . import register
from ._pipeline_bounds import (
    Lane,
    check_boundaries,
    optimizer_tail,
    solve_boundaries,
)
from ._pipeline_memory import replicas_memory
from ._pipeline_run import PipelineExecutor
from ._pipeline_sched import (
    SINGLE_STAGE,
    V_SHAPED,
    available_schedules,
    check_actions,
    check_schedule,
    divisors,
    inflight_counts,
    rank_actions,
    replicas_graph,
    stage_devices,
    stage_rank,
)
from .base import Plan, SearchContext, Strategy, WorkerContext
from .helpers import ParamName, choose_common, knobs_label, memo_solve, min_micro_batch, settled

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel


class PipelineStages:
    """What the plans of the pipeline families (pipeline, hybrid) derive from their `boundaries`
    and `pipeline_ranks`."""

    @property
    def n_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def stages_per_rank(self) -> int:
        return self.n_stages // max(1, self.pipeline_ranks)


@dataclass(frozen=True, kw_only=True)
class PipelinePlan(PipelineStages, Plan):
    strategy: str = "pipeline"
    boundaries: tuple[int, ...]
    """Stage s runs blocks boundaries[s] .. boundaries[s+1]-1: from 0 to the model's block count,
    strictly rising.  Stages are placed on `devices` (rank order) as the schedule places them:
    stage s on rank s for GPipe/1F1B, s % ranks for looped schedules, V-shaped for ZBVZeroBubble."""
    schedule: str = "1F1B"
    """'GPipe', '1F1B', 'Interleaved1F1B', 'LoopedBFS', 'InterleavedZeroBubble' or 'ZBVZeroBubble'."""
    microbatches: int = 1
    """Micro-batches per step (1 = plain model parallelism); must divide `batch`."""
    batch: int
    """Samples per optimizer step."""

    @property
    def global_batch(self) -> int:
        return self.batch

    @property
    def pipeline_ranks(self) -> int:
        return len(self.devices)

    @property
    def micro_batch(self) -> int:
        return self.batch // self.microbatches

    def stage_device(self, stage: int) -> int:
        return self.devices[stage_rank(self.schedule, len(self.devices), stage)]


# ----------------------------------------------------------------------------- search helpers (shared with hybrid)


def ordered_devices(trial, ctx: SearchContext, name: ParamName, count: int | None = None) -> tuple[int, ...]:
    """`count` devices (asked for when None) in an order: a random key per group of interchangeable
    devices (`order_dev{first}`; a device like no other is its own group), the group's devices
    together in index order, the `count` first in key order.  Every trial gets a valid choice (one
    yes/no per device wasted trials on choosing none, or a count no shape divides).  Identical devices
    side by side lose nothing a prediction can see, and 64 devices of 4 kinds are 4 keys, not 64."""

    cost = ctx.cost
    n = cost.n_devices
    if count is None:
        count = trial.suggest_int(name("n_devices"), 1, n) if n > 1 else 1
    if n == 1:
        return (0,)
    groups = cost.memo(("interchangeable_groups",), lambda: interchangeable_groups(cost.cluster))
    keys = {g[0]: trial.suggest_float(name(f"order_dev{g[0]}"), 0.0, 1.0) for g in groups}
    order = [d for g in sorted(groups, key=lambda g: (keys[g[0]], g[0])) for d in g]
    return tuple(order[:count])


def choose_microbatches(trial, ctx: SearchContext, name: ParamName, schedule: str, ranks: int, v: int,
                        replicas: int = 1) -> int:
    """A micro-batch count the schedule accepts on `ranks` x `v` stages and that leaves every one of
    `replicas` replicas enough samples per micro-batch: `microbatches` is drawn from every count that
    divides the global batch (one distribution under one name, as Optuna wants), and the nearest
    count (by ratio; the smaller of two) that this shape accepts is taken.  A search that steps to
    a neighbouring shape keeps its micro-batch count (a name per shape made it draw a new one)."""
    floor = min_micro_batch(ctx) * replicas
    ok = []
    for m in micro_choices(ctx, 1):
        if ctx.global_batch // m < floor:
            continue
        try:
            check_actions(schedule, ranks, m, v)
        except InfeasiblePlanError:
            continue
        ok.append(m)
    if not ok:
        raise InfeasiblePlanError(
            f"no micro-batch count of the global batch {ctx.global_batch} suits {schedule} on {ranks} rank(s) x {v} "
            f"stage(s) with {replicas} replica(s) of >= {min_micro_batch(ctx)} samples per micro-batch"
        )
    want = trial.suggest_categorical(name("microbatches"), micro_choices(ctx, 1))
    return settled(trial, name("microbatches"), min(ok, key=lambda m: (abs(math.log(m / want)), m)))


def choose_schedule(trial, ctx: SearchContext, name: ParamName, ranks: int) -> str:
    """A schedule whose stage count fits the model on `ranks` ranks (multi-stage ones need 2 blocks per
    rank): `schedule` is drawn from every offered schedule (one name for every rank count, so a
    search that steps to a neighbouring shape keeps its schedule), and one that does not fit is
    replaced by the first that does."""
    offered = list(ctx.extra.get("pipeline_schedules", available_schedules()))
    if ranks == 1 and "GPipe" in offered:
        # One device: every schedule computes the same thing (ZBVZeroBubble only costs more memory):
        # offer one, so that the top candidates are not the same run under several names.
        return trial.suggest_categorical(name("schedule_r1"), ["GPipe"])
    fits = [s for s in offered if s in SINGLE_STAGE or 2 * ranks <= ctx.cost.facts.n_blocks] or offered
    want = trial.suggest_categorical(name("schedule"), offered)
    return settled(trial, name("schedule"), want if want in fits else fits[0])


def choose_stages_per_rank(trial, name: ParamName, schedule: str, ranks: int = 1, n_blocks: int = 1 << 30) -> int:
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    fits = [v for v in (2, 3, 4) if v * ranks <= n_blocks] or [2]
    v = min(trial.suggest_categorical(name("stages_per_rank"), [2, 3, 4]), max(fits))  # one name, as above
    return settled(trial, name("stages_per_rank"), v)


def micro_choices(ctx: SearchContext, min_micro: int) -> list[int]:
    """Micro-batch counts that divide the global batch and leave >= min_micro samples each."""
    if ctx.cost.facts.batch_coupled:
        return [1]  # a coupled loss (InfoNCE) over micro-batches would change the objective
    return [m for m in divisors(ctx.global_batch) if ctx.global_batch // m >= min_micro]




def check_common(cost: CostModel, boundaries, n_ranks: int, schedule: str, microbatches: int,
                 batches: tuple[int, ...], precision: str) -> None:
    """Checks shared by `pipeline` and `hybrid`; each message names the value and the limit."""
    check_schedule(schedule)
    check_boundaries(boundaries, cost.facts.n_blocks)
    n_stages = len(boundaries) - 1
    if n_stages % n_ranks:
        raise InfeasiblePlanError(
            f"{n_stages} stages do not spread evenly over {n_ranks} pipeline ranks; "
            f"give a multiple of {n_ranks} stages"
        )
    for b in batches:
        if microbatches < 1 or b % microbatches:
            raise InfeasiblePlanError(
                f"batch {b} does not divide into {microbatches} micro-batches; choose a divisor of {b}"
            )
    if cost.facts.batch_coupled and microbatches > 1:
        raise InfeasiblePlanError(
            f"the workload's loss couples every sample of the batch; {microbatches} micro-batches would "
            "change what is optimised (torch's schedules take a loss per micro-batch): use 1 micro-batch"
        )
    if precision == "fp16":
        raise InfeasiblePlanError("fp16 needs loss scaling, which pipelined runs here do not do; use bf16 or fp32")
    check_actions(schedule, n_ranks, microbatches, n_stages // n_ranks)


def stages_label(plan, devices_of_stage) -> str:
    b = plan.boundaries
    return " ".join(f"[{b[s]}:{b[s + 1]}]@dev{devices_of_stage(s)}" for s in range(len(b) - 1))


# ----------------------------------------------------------------------------- the family


@register
class Pipeline(Strategy):
    name = "pipeline"
    plan_type = PipelinePlan
    display_name = "pipeline / model parallel"
    param_prefix = ""  # bare Optuna names until results/golden is re-recorded (see Strategy.param_prefix)

    def unavailable(self, ctx: SearchContext) -> str | None:
        if ctx.cost.facts.n_blocks < 2:
            return ("needs a model of at least 2 blocks to cut between; this model is one block (see the note on "
                    "how it was split)")
        return None

    def space(self, trial, ctx: SearchContext) -> PipelinePlan:
        devices = ordered_devices(trial, ctx, self.param)
        schedule = choose_schedule(trial, ctx, self.param, len(devices))
        v = choose_stages_per_rank(trial, self.param, schedule, len(devices), ctx.cost.facts.n_blocks)
        m = choose_microbatches(trial, ctx, self.param, schedule, len(devices), v)
        precision, ckpt = choose_common(trial, ctx, devices, self.param)
        return memo_solve(ctx.cost, ("pipeline", devices, schedule, v, m, ctx.global_batch, precision, ckpt),
                          lambda: self.solve(ctx.cost, devices, schedule=schedule, stages_per_rank=v, microbatches=m,
                                             batch=ctx.global_batch, precision=precision, checkpoint_blocks=ckpt))

    def solve(self, cost: CostModel, devices: tuple[int, ...], *, schedule: str, stages_per_rank: int = 1,
              microbatches: int, batch: int, precision: str = "fp32", checkpoint_blocks: int = 0) -> PipelinePlan:
        """The plan with the best stage boundaries for these outer choices (exact DP)."""
        n_ranks = len(devices)
        n_stages = n_ranks * stages_per_rank
        nb = cost.facts.n_blocks
        if n_stages > nb:
            raise InfeasiblePlanError(f"{n_stages} stages need at least {n_stages} blocks; the model has {nb}")
        if microbatches < 1 or batch % microbatches:
            raise InfeasiblePlanError(f"batch {batch} does not divide into {microbatches} micro-batches")
        acts = rank_actions(schedule, n_ranks, microbatches, stages_per_rank)
        stage_devs = stage_devices(schedule, devices, n_stages)
        bounds = solve_boundaries(cost, [Lane(stage_devs, batch // microbatches)], n_stages, microbatches,
                                  precision, checkpoint_blocks, inflight_counts(acts, n_stages),
                                  schedule=schedule, tail_s=optimizer_tail(cost))
        return PipelinePlan(devices=devices, boundaries=bounds, schedule=schedule, microbatches=microbatches,
                            batch=batch, precision=precision, checkpoint_blocks=checkpoint_blocks)

    def examples(self, ctx: SearchContext) -> list[PipelinePlan]:
        cost, gb = ctx.cost, ctx.global_batch
        devs = tuple(range(cost.n_devices))
        P, nb = len(devs), cost.facts.n_blocks
        builders = [lambda: self.baseline(ctx)]  # hand-written model parallelism (GPipe, one micro-batch)
        ms = [m for m in divisors(gb) if m >= P and gb // m >= min_micro_batch(ctx)]
        if ms and not cost.facts.batch_coupled:
            m = ms[0]
            builders += [
                lambda: self.solve(cost, devs, schedule="1F1B", microbatches=m, batch=gb, checkpoint_blocks=nb // 2),
                lambda: self.solve(cost, devs[::-1], schedule="GPipe", microbatches=m, batch=gb),
            ]
            have = available_schedules()
            if 2 * P <= nb:
                builders += [
                    lambda sched=sched: self.solve(cost, devs, schedule=sched, stages_per_rank=2, microbatches=m,
                                                   batch=gb)
                    for sched in ("Interleaved1F1B", "ZBVZeroBubble") if sched in have
                ]
        # A tight cluster (memory caps, more devices than blocks) gives fewer examples, never an error.
        return self.buildable(cost, builders)

    def baseline(self, ctx: SearchContext) -> PipelinePlan:
        """Model parallelism as written by hand: every device in order, equal block counts, one micro-batch."""
        n = ctx.cost.n_devices
        nb = ctx.cost.facts.n_blocks
        P = min(n, nb)
        bounds = tuple(round(k * nb / P) for k in range(P + 1))
        return PipelinePlan(devices=tuple(range(P)), boundaries=bounds, schedule="GPipe", microbatches=1,
                            batch=ctx.global_batch)

    def validate(self, plan: PipelinePlan, cost) -> None:
        super().validate(plan, cost)
        check_common(cost, plan.boundaries, len(plan.devices), plan.schedule, plan.microbatches, (plan.batch,),
                     plan.precision)

    def label(self, plan: PipelinePlan) -> str:
        if plan.microbatches == 1:
            head = "model parallel" + ("" if plan.schedule == "GPipe" else f" {plan.schedule}")
        else:
            head = f"pipeline {plan.schedule} m={plan.microbatches}"
        return f"{head} {stages_label(plan, plan.stage_device)}{knobs_label(plan)}"

    def graph(self, plan: PipelinePlan, cost) -> TaskGraph:
        return replicas_graph(cost, [plan.devices], plan.boundaries, plan.schedule, plan.microbatches,
                              [plan.micro_batch], plan.precision, plan.checkpoint_blocks)

    def memory(self, plan: PipelinePlan, cost) -> tuple[MemoryBreakdown, ...]:
        return replicas_memory(cost, plan.schedule, len(plan.devices), plan.boundaries, plan.microbatches,
                               [plan.micro_batch], plan.precision, plan.checkpoint_blocks)

    def executor(self, plan: PipelinePlan, ctx: WorkerContext):

        return PipelineExecutor(ctx, schedule=plan.schedule, boundaries=plan.boundaries,
                                microbatches=plan.microbatches, precision=plan.precision,
                                checkpoint_blocks=plan.checkpoint_blocks, replica_batches=(plan.batch,),
                                pipeline_ranks=len(plan.devices))


__all__ = ["Pipeline", "PipelinePlan"]
