"""`hybrid`: data-parallel replicas of one pipeline.

R replicas x P pipeline ranks: devices[i * P + r] is replica i's pipeline rank r.  Every
replica cuts the model at the same stage boundaries (a stage's gradients are all-reduced
across its replicas, so they must hold the same parameters); replicas get uneven batches
when they differ in speed.  Real runs: each replica is a torch.distributed.pipelining
pipeline on its own process group; after the schedule's step each rank all-reduces its
stages' gradients over the group of ranks holding the same stages (see _pipeline_run for
why not DDP).

Inner choices are solved, not sampled: for a batch split, the boundaries by the exact DP
of `_pipeline_bounds.solve_boundaries` (each stage timed on its slowest replica); for
boundaries, the batch split by an exact min-max greedy over whole micro-batch units.  The
two alternate from an even split until the split stops changing (at most 4 rounds), and
the best pair by the analytic step time is kept.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetsim.errors import InfeasiblePlanError
from hetsim.model.simulator import Resource, StepTiming, TaskGraph, TaskKind, run_steady
from hetsim.types import MemoryBreakdown

from . import register
from ._pipeline_bounds import (
    Lane,
    lane_class,
    solve_boundaries,
    step_elements,
)
from ._pipeline_memory import replicas_memory
from ._pipeline_run import PipelineExecutor
from ._pipeline_sched import (
    divisors,
    inflight_counts,
    rank_actions,
    replica_allreduce_s,
    replicas_graph,
    stage_devices,
    stage_rank,
)
from .base import Plan, SearchContext, Strategy, WorkerContext
from .helpers import choose_common, knobs_label, memo_solve, min_micro_batch
from .pipeline import (
    PipelineStages,
    check_common,
    choose_microbatches,
    choose_schedule,
    choose_stages_per_rank,
    ordered_devices,
    stages_label,
)

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel

@dataclass(frozen=True, kw_only=True)
class HybridPlan(PipelineStages, Plan):
    strategy: str = "hybrid"
    replicas: int
    """Data-parallel replicas; devices[i * P + r] is replica i's pipeline rank r (P = devices / replicas)."""
    boundaries: tuple[int, ...]
    """Stage s runs blocks boundaries[s] .. boundaries[s+1]-1, the same in every replica."""
    schedule: str = "1F1B"
    """Any of the pipeline family's schedules ('GPipe', '1F1B', 'Interleaved1F1B', 'ZBVZeroBubble', ...)."""
    microbatches: int = 1
    """Micro-batches per replica per step; divides every replica's batch."""
    replica_batch: tuple[int, ...]
    """Samples per step of each replica (uneven when replicas differ in speed)."""

    @property
    def global_batch(self) -> int:
        return sum(self.replica_batch)

    @property
    def pipeline_ranks(self) -> int:
        return len(self.devices) // max(1, self.replicas)

    def replica_devices(self, i: int) -> tuple[int, ...]:
        P = self.pipeline_ranks
        return self.devices[i * P:(i + 1) * P]

    def stage_device(self, replica: int, stage: int) -> int:
        return self.replica_devices(replica)[stage_rank(self.schedule, self.pipeline_ranks, stage)]


def shapes(n_devices: int, n_blocks: int) -> list[tuple[int, int]]:
    """(replicas, pipeline ranks) with at least 2 of each that fit the cluster and the model's blocks."""
    return [(r, p) for p in range(2, min(n_devices, n_blocks) + 1) for r in range(2, n_devices // p + 1)]


def choose_shape(trial, name, n_devices: int, n_blocks: int) -> tuple[int, int]:
    """(replicas, pipeline ranks) from two numbers: `pipeline_ranks` P and `hybrid_devices` D on a log
    scale; the plan has D // P replicas (at least 2, at most what P leaves).  A search steps to a
    neighbouring shape by one knob (one categorical over the ~1,500 shapes of 512 devices could
    only be re-drawn), and a step in P keeps the device count (18 x 7 -> 21 x 6); the log scale
    gives 4-32 devices the odds of 64-512."""
    P = trial.suggest_int(name("pipeline_ranks"), 2, max(2, min(n_devices // 2, n_blocks)))
    D = trial.suggest_int(name("hybrid_devices"), 4, max(4, n_devices), log=True) if n_devices > 4 else 4
    return max(2, min(D // P, n_devices // P)), P


def _tail(cost: CostModel, group: tuple[int, ...]):
    """Stage 0 ends the step: its gradient all-reduce across replicas, then its optimizer step."""

    def tail(s: int, lo: int, hi: int, dev: int) -> float:
        if s:
            return 0.0
        return replica_allreduce_s(cost, cost.grad_bytes(lo, hi), group) + cost.opt_s(dev, cost.trainable_count(lo, hi))

    return tail


def replica_time(cost: CostModel, stage_devs: tuple[int, ...], bounds: tuple[int, ...], micro: int, m: int, schedule: str,
                 precision: str, ckpt: int, inflight, tail) -> float:
    """Analytic step time of one replica (the DP's objective); inf when a stage does not fit."""
    n_stages = len(bounds) - 1
    elem = step_elements(cost, [Lane(stage_devs, micro)], n_stages, precision, ckpt, inflight, tail, schedule, m)
    total, worst = 0.0, 0.0
    for s in range(n_stages):
        e = elem(s, bounds[s], bounds[s + 1])
        if e is None:
            return math.inf
        total += e[0]
        worst = max(worst, e[1])
    return total + (m - 1) * worst


def balance_replicas(cost: CostModel, lanes_devs: list[tuple[int, ...]], bounds: tuple[int, ...], global_batch: int,
                     m: int, schedule: str, precision: str, ckpt: int, inflight, tail, min_micro_size: int) -> tuple[int, ...]:
    """Exact min-max split of the batch over replicas in units of m samples (one per micro-batch).

    A replica's step time does not fall when its micro-batches grow, so giving each next unit to
    the replica that finishes it soonest minimises the slowest replica.
    """
    R = len(lanes_devs)
    units = global_batch // m
    if units < R * min_micro_size:
        raise InfeasiblePlanError(
            f"global batch {global_batch} gives {units} samples per micro-batch slot to share among {R} replicas "
            f"(at least {min_micro_size} each); raise the batch or use fewer micro-batches or replicas"
        )
    k = [min_micro_size] * R
    # Replicas of one class (same device classes and links) take the same time at the same size.
    klass = [lane_class(cost, Lane(devs, 0)) for devs in lanes_devs]
    times: dict[tuple[tuple, int], float] = {}

    def t(i: int, micro: int) -> float:
        key = (klass[i], micro)
        if key not in times:
            times[key] = replica_time(cost, lanes_devs[i], bounds, micro, m, schedule, precision, ckpt, inflight, tail)
        return times[key]

    # The greedy's min over replicas of (time at one more unit, index), kept in a heap: only the
    # replica that took the unit changes its entry.
    heap = [(t(i, k[i] + 1), i) for i in range(R)]
    heapq.heapify(heap)
    for _ in range(units - sum(k)):
        _, best = heapq.heappop(heap)
        k[best] += 1
        heapq.heappush(heap, (t(best, k[best] + 1), best))
    return tuple(x * m for x in k)


@register
class Hybrid(Strategy):
    name = "hybrid"
    plan_type = HybridPlan
    display_name = "data-parallel pipelines"
    param_prefix = ""  # bare Optuna names until results/golden is re-recorded (see Strategy.param_prefix)

    def unavailable(self, ctx: SearchContext) -> str | None:
        if not shapes(ctx.cost.n_devices, ctx.cost.facts.n_blocks):
            return (f"needs at least 4 devices (2 replicas x 2 pipeline ranks) and 2 blocks; the cluster has "
                    f"{ctx.cost.n_devices} device(s) (one replica is `pipeline`, one rank per replica is `ddp`)")
        return None

    def space(self, trial, ctx: SearchContext) -> HybridPlan:
        # The shape first, from the shapes the cluster allows, then exactly R x P devices: every
        # trial is a real hybrid (a yes/no per device and a free rank count mostly were not).
        if not ctx.cost.memo(("hybrid_shapes",), lambda: shapes(ctx.cost.n_devices, ctx.cost.facts.n_blocks)):
            raise InfeasiblePlanError(f"hybrid {self.unavailable(ctx)}")
        R, P = choose_shape(trial, self.param, ctx.cost.n_devices, ctx.cost.facts.n_blocks)
        devices = ordered_devices(trial, ctx, self.param, count=R * P)
        schedule = choose_schedule(trial, ctx, self.param, P)
        v = choose_stages_per_rank(trial, self.param, schedule, P, ctx.cost.facts.n_blocks)
        m = choose_microbatches(trial, ctx, self.param, schedule, P, v, replicas=R)
        precision, ckpt = choose_common(trial, ctx, devices, self.param)
        floor = min_micro_batch(ctx)
        key = ("hybrid", devices, R, schedule, v, m, ctx.global_batch, precision, ckpt, floor)
        return memo_solve(ctx.cost, key, lambda: self.solve(
            ctx.cost, devices, replicas=R, schedule=schedule, stages_per_rank=v, microbatches=m,
            global_batch=ctx.global_batch, precision=precision, checkpoint_blocks=ckpt, min_micro_size=floor))

    def solve(self, cost: CostModel, devices: tuple[int, ...], *, replicas: int, schedule: str,
              stages_per_rank: int = 1, microbatches: int, global_batch: int, precision: str = "fp32",
              checkpoint_blocks: int = 0, min_micro_size: int = 1) -> HybridPlan:
        R, m, v = replicas, microbatches, stages_per_rank
        if R < 1 or len(devices) % R:
            raise InfeasiblePlanError(f"{len(devices)} devices do not split into {R} equal replicas")
        P = len(devices) // R
        n_stages = P * v
        if n_stages > cost.facts.n_blocks:
            raise InfeasiblePlanError(f"{n_stages} stages need at least {n_stages} blocks; the model has "
                                      f"{cost.facts.n_blocks}")
        if global_batch % m:
            raise InfeasiblePlanError(f"global batch {global_batch} does not divide into {m} micro-batches")
        acts = rank_actions(schedule, P, m, v)
        inflight = inflight_counts(acts, n_stages)
        lanes_devs = [stage_devices(schedule, devices[i * P:(i + 1) * P], n_stages) for i in range(R)]
        tail = _tail(cost, tuple(devices[i * P] for i in range(R)))
        units = global_batch // m
        split = tuple(m * (units // R + (1 if i < units % R else 0)) for i in range(R))
        best: tuple[float, tuple[int, ...], tuple[int, ...]] | None = None
        for _ in range(4):
            lanes = [Lane(lanes_devs[i], split[i] // m) for i in range(R)]
            try:
                bounds = solve_boundaries(cost, lanes, n_stages, m, precision, checkpoint_blocks, inflight, schedule, tail)
            except InfeasiblePlanError:
                if best is None:
                    raise
                break
            new = balance_replicas(cost, lanes_devs, bounds, global_batch, m, schedule, precision, checkpoint_blocks,
                                   inflight, tail, min_micro_size)
            score = max(replica_time(cost, lanes_devs[i], bounds, new[i] // m, m, schedule, precision, checkpoint_blocks,
                                     inflight, tail) for i in range(R))
            if best is None or score < best[0]:
                best = (score, bounds, new)
            if new == split:
                break
            split = new
        assert best is not None
        return HybridPlan(devices=devices, replicas=R, boundaries=best[1], schedule=schedule, microbatches=m,
                          replica_batch=best[2], precision=precision, checkpoint_blocks=checkpoint_blocks)

    def examples(self, ctx: SearchContext) -> list[HybridPlan]:
        cost, gb = ctx.cost, ctx.global_batch
        n, nb = cost.n_devices, cost.facts.n_blocks
        devs = tuple(range(n))
        mm = min_micro_batch(ctx)
        builders = []
        if n >= 4 and n % 2 == 0:  # the real thing: 2 replicas x n/2 pipeline ranks
            m4 = next((k for k in divisors(gb) if k >= n // 2 and gb // k >= 2 * mm), 1)
            builders.append(lambda: self.solve(cost, devs, replicas=2, schedule="1F1B" if m4 >= n // 2 else "GPipe",
                                               microbatches=m4, global_batch=gb, min_micro_size=mm))
        if n >= 2:
            # Degenerate shapes that still run every piece on two ranks: replicas of a one-stage
            # pipeline (gradient all-reduce over the stage group, uneven batch), and one replica of a two-stage
            # pipeline (pipeline groups, per-stage groups of one).
            coupled = cost.facts.batch_coupled  # one micro-batch keeps a coupled loss exact
            m2 = 2 if gb % 2 == 0 and gb // 2 >= 2 * mm and not coupled else 1
            builders.append(lambda: self.solve(cost, devs[:2], replicas=2, schedule="GPipe", microbatches=m2,
                                               global_batch=gb, min_micro_size=mm))
            uneven = (gb - 3 * gb // 8, 3 * gb // 8)  # 5/3 of 8: the fast device takes more
            if min(uneven) >= mm:
                builders.append(lambda: HybridPlan(devices=devs[:2], replicas=2, boundaries=(0, nb), schedule="GPipe",
                                                   microbatches=1, replica_batch=uneven, checkpoint_blocks=nb // 2))
            if nb >= 2 and gb % 2 == 0:
                builders.append(lambda: self.solve(cost, devs[:2], replicas=1, schedule="1F1B",
                                                   microbatches=1 if coupled else 2, global_batch=gb,
                                                   min_micro_size=mm))
        # On a tight cluster the solver may find no boundaries that fit: that example is left out.
        return self.buildable(cost, builders)

    def validate(self, plan: HybridPlan, cost) -> None:
        super().validate(plan, cost)
        if plan.replicas < 1 or len(plan.devices) % plan.replicas:
            raise InfeasiblePlanError(
                f"{len(plan.devices)} devices do not split into replicas({plan.replicas}) equal pipelines"
            )
        if len(plan.replica_batch) != plan.replicas:
            raise InfeasiblePlanError(
                f"hybrid plan has {len(plan.replica_batch)} replica batches for replicas({plan.replicas}); give one each"
            )
        check_common(cost, plan.boundaries, plan.pipeline_ranks, plan.schedule, plan.microbatches,
                     plan.replica_batch, plan.precision)

    def label(self, plan: HybridPlan) -> str:
        reps = "; ".join(
            f"{b}: {stages_label(plan, lambda s, i=i: plan.stage_device(i, s))}"
            for i, b in enumerate(plan.replica_batch)
        )
        return (f"hybrid {plan.replicas}x{plan.pipeline_ranks} {plan.schedule} m={plan.microbatches} "
                f"{{{reps}}}{knobs_label(plan)}")

    def graph(self, plan: HybridPlan, cost) -> TaskGraph:
        return replicas_graph(cost, [plan.replica_devices(i) for i in range(plan.replicas)], plan.boundaries,
                              plan.schedule, plan.microbatches, [b // plan.microbatches for b in plan.replica_batch],
                              plan.precision, plan.checkpoint_blocks)

    def step_timing(self, plan: HybridPlan, cost) -> StepTiming:
        """The event simulation of one replica per class (replicas whose devices are alike, with
        alike links between their stages, and the same batch step alike, task for task): the
        all-reduces are timed over every replica and wait for the representatives, which finish
        when their whole class does.  The same numbers as the full graph's, at a fraction of its
        size (a 127 x 3 plan on 512 devices of four types: one or two replicas instead of 127)."""
        m, n_stages = plan.microbatches, len(plan.boundaries) - 1
        every = [plan.replica_devices(i) for i in range(plan.replicas)]
        reps: dict[tuple, int] = {}  # class -> representative replica
        rep_of = []
        for i, devs in enumerate(every):
            lane = Lane(stage_devices(plan.schedule, devs, n_stages), plan.replica_batch[i] // m)
            rep_of.append(reps.setdefault(lane_class(cost, lane), i))
        chosen = sorted(set(rep_of))
        g = replicas_graph(cost, [every[i] for i in chosen], plan.boundaries, plan.schedule, m,
                           [plan.replica_batch[i] // m for i in chosen], plan.precision, plan.checkpoint_blocks,
                           all_replicas=every)
        steady = run_steady(g, cost.step_barrier)
        busy_of = steady.step.busy_by_resource(g, TaskKind.COMPUTE)
        weight: dict[str, int] = {}  # a representative's resources stand for its whole class
        for i in chosen:
            n_alike = rep_of.count(i)
            for d in every[i]:
                weight[Resource.device(d)] = n_alike
            for a in every[i]:
                for b in every[i]:
                    weight[Resource.link(a, b)] = n_alike
        breakdown: dict[str, float] = {}
        for t in g.tasks:
            dt = (steady.step.end_s[t.tid] - steady.step.start_s[t.tid]) * weight.get(t.resource, 1)
            breakdown[t.kind] = breakdown.get(t.kind, 0.0) + dt
        busy = tuple(busy_of.get(Resource.device(every[rep_of[i]][r]), 0.0)
                     for i in range(plan.replicas) for r in range(plan.pipeline_ranks))
        return StepTiming(period_s=steady.period_s, busy_s=busy, breakdown_s=breakdown)

    def memory(self, plan: HybridPlan, cost) -> tuple[MemoryBreakdown, ...]:
        return replicas_memory(cost, plan.schedule, plan.pipeline_ranks, plan.boundaries, plan.microbatches,
                               [b // plan.microbatches for b in plan.replica_batch], plan.precision,
                               plan.checkpoint_blocks)

    def executor(self, plan: HybridPlan, ctx: WorkerContext):

        return PipelineExecutor(ctx, schedule=plan.schedule, boundaries=plan.boundaries,
                                microbatches=plan.microbatches, precision=plan.precision,
                                checkpoint_blocks=plan.checkpoint_blocks, replica_batches=plan.replica_batch,
                                pipeline_ranks=plan.pipeline_ranks)
