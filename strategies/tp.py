"""`tp`: tensor parallelism (Megatron's column/row split of heads and MLP units), with shards sized
per device, and data-parallel replicas of tensor groups (DP x TP plans).

A plan is `dp` replicas of one tensor group shape: rank r = replica x tp_size + position runs on
devices[r]; position p of every replica holds `heads[p]` attention heads and `hidden[p]` MLP units
of every layer (the same slices, so DDP can average them over the replicas).  The search picks the
devices, the group size and which devices form a group; exact solvers pick the shard sizes (in
proportion to the devices' speed, clipped by memory) and each replica's share of the batch.

Simulation: per micro-step, every layer is two compute segments per rank, each followed by an
all-reduce of one activation (micro-batch x seq x d_model) over the group (forward: after the
row-parallel products; backward: the column-parallel input gradients); embedding and head in full
on every rank; with replicas, DDP's bucketed gradient all-reduce over the ranks that share a shard,
then the optimizer step over the rank's own parameters.  Every layer all-reduce also carries a
calibrated term of its tensor group, per MiB of the activation (`CostModel.tp_collective_s`: a real
run per realisation, `hetsim.search.calib_modelparallel.calibrate_tp`).  Plans that run through
DTensor may add Megatron's sequence parallelism (`sequence_parallel`): the norms on 1/tp of the
tokens, each all-reduce a reduce-scatter and an all-gather.  The real run is `_tp_run.TPExecutor`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hetsim.errors import InfeasiblePlanError
from hetsim.model.simulator import TaskGraph
from hetsim.types import MemoryBreakdown

from . import register
from ._dp_closed import buckets
from ._tp_memory import tp_memory
from ._tp_pipeline import (
    build_pipeline_plan,
    even_counterpart,
    pipeline_graph,
    pipeline_memory,
    position_params,
    validate_pipeline,
)
from ._tp_shards import (
    HIDDEN_GRANULE,
    REPLICATED_SHARE,
    TransformerDims,
    dims_from_spec,
    even_split,
    shard_split,
    tensor_groups,
)
from .base import Plan, SearchContext, Strategy, WorkerContext
from .helpers import choose_accum, choose_devices, min_max_split

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel

TP_SIZES = (2, 4, 8)
GROUPINGS = ("fast_links", "strided")
STAGES = (1, 2, 4)
"""Pipeline stages of tensor groups a search may choose (PP x TP), where the cluster has 2 x that."""
MICROBATCHES = (2, 4, 8)
"""Micro-batches per step of a PP x TP plan."""
@dataclass(frozen=True, kw_only=True)
class TPPlan(Plan):
    strategy: str = "tp"
    tp_size: int
    """Ranks per tensor group; devices[g * tp_size + p] is position p of replica g."""
    heads: tuple[int, ...]
    """Attention heads of every layer held by each position of the group."""
    hidden: tuple[int, ...]
    """MLP hidden units of every layer held by each position."""
    local_batch: tuple[int, ...]
    """Samples per optimizer step of each replica (every rank of a group sees the same batch)."""
    accum_steps: int = 1
    stages: int = 1
    """Pipeline stages (PP x TP); rank (replica x stages + stage) x tp_size + position runs on
    devices[rank], and every stage's tensor group holds the same shards (`_tp_pipeline`)."""
    boundaries: tuple[int, ...] = ()
    """With stages > 1: stage s runs blocks boundaries[s] .. boundaries[s+1]-1."""
    microbatches: int = 1
    """With stages > 1: micro-batches per replica per step (the pipeline's accumulation)."""
    schedule: str = "1F1B"
    """With stages > 1: torch's schedule, 'GPipe' or '1F1B'."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (DTensor plans only): norms and residuals split along the
    sequence, each layer all-reduce a reduce-scatter and an all-gather."""

    @property
    def global_batch(self) -> int:
        return sum(self.local_batch)

    @property
    def dp(self) -> int:
        return len(self.local_batch)

    @property
    def even(self) -> bool:
        return len(set(self.heads)) == 1 and len(set(self.hidden)) == 1

    @property
    def dtensor(self) -> bool:
        """Run through parallelize_module (even shards, one replica) rather than per-rank slices."""
        return self.even and self.dp == 1 and self.stages == 1

    @property
    def realisation(self) -> str:
        """How a real run shards: 'sp' (DTensor with sequence parallelism), 'dtensor' or 'slices'."""
        return "sp" if self.sequence_parallel else "dtensor" if self.dtensor else "slices"

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Every tensor group (of every replica and stage), in rank order."""
        t = self.tp_size
        return tuple(self.devices[g * t:(g + 1) * t] for g in range(len(self.devices) // t))


def stage_choices(n_devices: int) -> tuple[int, ...]:
    """The stage counts a search on `n_devices` offers (at least 2 devices a stage): the same for
    every trial of a study, as Optuna's categorical distributions need."""
    return tuple(s for s in STAGES if 2 * s <= n_devices)


def tp_dims(cost: CostModel) -> TransformerDims | None:
    return cost.memo(("tp_dims",), lambda: dims_from_spec(cost.base_profile.model, [b.name for b in cost.base_profile.blocks]))


def _dims(cost: CostModel) -> TransformerDims:
    dims = tp_dims(cost)
    if dims is None:
        raise InfeasiblePlanError(f"tensor parallelism needs a gpt workload (attention heads and MLP units to "
                                  f"split); this model is {cost.base_profile.model!r}: use --model gpt")
    return dims


def speeds(cost: CostModel, dims: TransformerDims) -> list[float]:
    """Relative speed of every device on one transformer layer (1 / its forward + backward time at 8 samples)."""
    k, mb = dims.layer_blocks[0], 8  # a fitted time at one sample can be ~0 (a negative intercept)

    def layer_s(d: int) -> float:
        return max(1e-12, cost.fwd_s(d, k, k + 1, mb) + cost.bwd_s(d, k, k + 1, mb))

    return [1.0 / layer_s(d) for d in range(cost.n_devices)]


def segment_s(cost: CostModel, dims: TransformerDims, d: int, k: int, mb: float, forward: bool, attn: bool,
              frac: float, seq_split: int = 1) -> float:
    """Time of one layer segment on device d for a rank holding `frac` of its heads (or units); with
    sequence parallelism over `seq_split` ranks, its norm and residual on 1/seq_split of the tokens."""
    t = cost.fwd_s(d, k, k + 1, mb) if forward else cost.bwd_s(d, k, k + 1, mb)
    share = dims.attn_share if attn else 1.0 - dims.attn_share
    return t * share * (REPLICATED_SHARE / seq_split + (1.0 - REPLICATED_SHARE) * frac)


def _replicated(cost: CostModel, dims: TransformerDims) -> tuple[range, range]:
    n = cost.facts.n_blocks
    return range(0, dims.layer_blocks[0]), range(dims.layer_blocks[-1] + 1, n)


def layer_collective_s(cost: CostModel, dims: TransformerDims, group, m: int, realisation: str) -> float:
    """One of a layer's four collectives over the group for a micro-batch of m: an all-reduce of its
    activation (with sequence parallelism, 'sp', the reduce-scatter and the all-gather that replace
    it: the same bytes over the same ring, and on gloo here 1.2-1.6x the all-reduce's time, which
    the calibrated term takes), plus the group's calibrated term for that realisation, which is per
    MiB of the activation: measured on gpt@tiny@64 over two ranks, the realisations' extra time
    beyond the model grew with the data, not with the count of collectives (accumulating 2 and 4
    micro-batches, twice and four times the collectives at 1/2 and 1/4 the size, stepped +28 and
    +51 % (DTensor) where a per-collective term said +42 and +128 %)."""
    nbytes = dims.activation_bytes(m)
    return cost.allreduce_s(nbytes, group) + cost.tp_collective_s(group, realisation) * nbytes / 2**20


def tp_graph(plan: TPPlan, cost: CostModel) -> TaskGraph:
    dims = _dims(cost)
    g = TaskGraph()
    pre, post = _replicated(cost, dims)
    fa = [h / dims.n_head for h in plan.heads]
    fb = [u / dims.hidden for u in plan.hidden]
    split = plan.tp_size if plan.sequence_parallel else 1
    done: dict[tuple[int, int], int] = {}  # (position, block) -> last task of its backward, over replicas
    for gi, group in enumerate(plan.groups()):
        comm = f"tp{gi}"
        micro = even_split(plan.local_batch[gi], plan.accum_steps)
        for j, m in enumerate(micro):
            ar_s = layer_collective_s(cost, dims, group, m, plan.realisation)
            dep = None
            for d in group:
                g.add(f"dev{d}", "F", cost.fwd_s(d, pre.start, pre.stop, m) + cost.overhead_s(d, m), label=f"F{j} embed")
            for k in dims.layer_blocks:
                for attn in (True, False):
                    tids = [g.add(f"dev{d}", "F", segment_s(cost, dims, d, k, m, True, attn, (fa if attn else fb)[p], split),
                                  [dep], label=f"F{j}.{k}{'a' if attn else 'm'}") for p, d in enumerate(group)]
                    dep = g.add(comm, "allreduce", ar_s, tids, label=f"allreduce F{j}.{k}")
            for p, d in enumerate(group):
                t = cost.fwd_s(d, post.start, post.stop, m) + cost.bwd_s(d, post.start, post.stop, m)
                head = g.add(f"dev{d}", "B", t, [dep], label=f"F/B{j} head")
                if j == len(micro) - 1:
                    for k in post:
                        done[(gi * plan.tp_size + p, k)] = head
            for k in reversed(dims.layer_blocks):
                for attn in (False, True):
                    tids = [g.add(f"dev{d}", "B", segment_s(cost, dims, d, k, m, False, attn, (fa if attn else fb)[p], split),
                                  [dep], label=f"B{j}.{k}{'a' if attn else 'm'}") for p, d in enumerate(group)]
                    dep = g.add(comm, "allreduce", ar_s, tids, label=f"allreduce B{j}.{k}")
                    if j == len(micro) - 1:
                        for p in range(len(group)):
                            done[(gi * plan.tp_size + p, k)] = dep
            for p, d in enumerate(group):
                tid = g.add(f"dev{d}", "B", cost.bwd_s(d, pre.start, pre.stop, m), [dep], label=f"B{j} embed")
                if j == len(micro) - 1:
                    for k in pre:
                        done[(gi * plan.tp_size + p, k)] = tid
    _data_parallel_sync(g, plan, cost, dims, done)
    return g


def _data_parallel_sync(g: TaskGraph, plan: TPPlan, cost: CostModel, dims: TransformerDims,
                        done: dict[tuple[int, int], int]) -> None:
    """DDP's bucketed all-reduce over the ranks sharing a shard, then every rank's optimizer step."""
    full = cost.param_count()
    for p in range(plan.tp_size):
        count = position_params(cost, dims, plan.heads[p], plan.hidden[p])
        members = tuple(plan.devices[gi * plan.tp_size + p] for gi in range(plan.dp))
        comm = []
        if plan.dp > 1:
            for low, nbytes in buckets(cost):
                deps = [done[(gi * plan.tp_size + p, low)] for gi in range(plan.dp)]
                comm.append(g.add(f"dp{p}", "allreduce", cost.allreduce_s(nbytes * count / full, members), deps,
                                  label=f"ddp allreduce pos {p}"))
        for d in members:
            g.add(f"dev{d}", "opt", cost.opt_s(d, count), comm, label="opt")


def solve_shards(cost: CostModel, dims: TransformerDims, groups, micro: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Heads and hidden units per position: in proportion to speed (min-max exact), where a position's
    speed is its slowest replica's; within every member's memory."""
    sp = speeds(cost, dims)
    tp = len(groups[0])
    pos_speed = [min(sp[grp[p]] for grp in groups) for p in range(tp)]
    heads = shard_split(dims.n_head, pos_speed)

    def fits(p: int, units: int) -> bool:
        trial = TPPlan(devices=tuple(d for grp in groups for d in grp), tp_size=tp, heads=heads,
                       hidden=tuple(units if q == p else HIDDEN_GRANULE for q in range(tp)),
                       local_batch=(micro,) * len(groups))
        mem = tp_memory(trial, cost, dims)
        return all(mem[gi * tp + p].total_bytes <= cost.device(grp[p]).memory_bytes for gi, grp in enumerate(groups))

    hidden = shard_split(dims.hidden, pos_speed, granule=HIDDEN_GRANULE, fits=fits)
    return heads, hidden


def replica_time_s(cost: CostModel, dims: TransformerDims, group, heads, hidden, b: int, accum: int) -> float:
    """A replica's compute and all-reduce time for b samples (the slowest member of every segment)."""
    key = ("tp_replica_s", tuple(group), tuple(heads), tuple(hidden), b, accum)
    return cost.memo(key, lambda: _replica_time_s(cost, dims, group, heads, hidden, b, accum))


def _replica_time_s(cost: CostModel, dims: TransformerDims, group, heads, hidden, b: int, accum: int) -> float:
    pre, post = _replicated(cost, dims)
    total = 0.0
    for m in even_split(b, accum):
        if m <= 0:
            continue
        ar = cost.allreduce_s(dims.activation_bytes(m), group)
        total += 4 * dims.n_layer * ar
        total += max(cost.fwd_s(d, pre.start, pre.stop, m) + cost.bwd_s(d, pre.start, pre.stop, m)
                     + cost.fwd_s(d, post.start, post.stop, m) + cost.bwd_s(d, post.start, post.stop, m)
                     + cost.overhead_s(d, m) for d in group)
        for k in dims.layer_blocks:
            for fwd in (True, False):
                for attn in (True, False):
                    fr = [h / dims.n_head for h in heads] if attn else [u / dims.hidden for u in hidden]
                    total += max(segment_s(cost, dims, d, k, m, fwd, attn, fr[p]) for p, d in enumerate(group))
    return total


def balance_replicas(cost: CostModel, dims: TransformerDims, groups, heads, hidden, global_batch: int,
                     accum: int) -> tuple[int, ...]:
    """Samples per replica, min-max exact (each next sample to the replica that finishes it soonest)."""
    if accum * len(groups) > global_batch:
        raise InfeasiblePlanError(f"global batch {global_batch} cannot give each of {len(groups)} replicas "
                                  f"{accum} samples; use fewer replicas or accumulation steps")
    return min_max_split(len(groups), global_batch, accum,
                         lambda i, b: replica_time_s(cost, dims, groups[i], heads, hidden, b, accum))


def build_plan(cost: CostModel, devices, tp: int, grouping: str, global_batch: int, accum: int = 1,
               even: bool = False, stages: int = 1, microbatches: int = 1,
               sequence_parallel: bool = False) -> TPPlan:
    """The plan of these choices with its inner knobs solved (or DTensor's even shards); with
    stages > 1, tensor groups as pipeline stages (`_tp_pipeline`); with `sequence_parallel`, the
    even one-group plan under sequence parallelism."""
    dims = _dims(cost)
    if len(devices) % (tp * stages) or tp > dims.n_head:
        raise InfeasiblePlanError(f"tensor group size {tp} x {stages} stage(s) must divide the {len(devices)} devices "
                                  f"and the group be at most the {dims.n_head} heads")
    sp = speeds(cost, dims)
    link = (lambda a, b: cost.cluster.links[a][b].bandwidth_bps) if cost.cluster.links else (lambda a, b: 1.0)
    groups = tensor_groups(devices, tp, sp, link, grouping)
    if even:
        if dims.n_head % tp or dims.hidden % (tp * HIDDEN_GRANULE):
            raise InfeasiblePlanError(f"even shards need {tp} to divide the {dims.n_head} heads and hidden units")
        heads, hidden = even_split(dims.n_head, tp), even_split(dims.hidden, tp)
    else:
        heads, hidden = solve_shards(cost, dims, groups, max(1, global_batch // (len(groups) * accum * microbatches)))
    if stages > 1:
        return build_pipeline_plan(cost, dims, groups, len(groups) // stages, heads, hidden, global_batch, microbatches)
    local = balance_replicas(cost, dims, groups, heads, hidden, global_batch, accum)
    plan = TPPlan(devices=tuple(d for grp in groups for d in grp), tp_size=tp, heads=heads, hidden=hidden,
                  local_batch=local, accum_steps=accum)
    return with_sequence_parallel(plan, dims) if sequence_parallel else plan


def sequence_parallel_problem(plan: TPPlan, dims: TransformerDims) -> str | None:
    """Why this plan's shape cannot run under sequence parallelism, or None (whatever its own
    `sequence_parallel`)."""
    if not plan.dtensor:
        return ("sequence parallelism runs through DTensor: even shards, one tensor group, no pipeline "
                f"stages (this plan: {'even' if plan.even else 'uneven'} shards, {plan.dp} replica(s), "
                f"{plan.stages} stage(s)); use sequence_parallel false")
    if dims.seq_len % plan.tp_size:
        return (f"sequence parallelism splits the {dims.seq_len} tokens over the {plan.tp_size} ranks evenly; "
                "use a --seq-len that the tensor group size divides, or sequence_parallel false")
    return None


def with_sequence_parallel(plan: TPPlan, dims: TransformerDims) -> TPPlan:
    problem = sequence_parallel_problem(plan, dims)
    if problem:
        raise InfeasiblePlanError(problem)
    return replace(plan, sequence_parallel=True)


@register
class TP(Strategy):
    name = "tp"
    plan_type = TPPlan
    display_name = "tensor parallel (uneven shards), with data-parallel replicas"
    contract_workloads = ("gpt@tiny@16",)
    """Tensor parallelism splits attention heads and MLP units: the gpt is the workload it has plans on."""

    def unavailable(self, ctx: SearchContext) -> str | None:
        if tp_dims(ctx.cost) is None:
            return f"needs a gpt workload (heads and MLP units to split), not {ctx.cost.base_profile.model!r}"
        if ctx.cost.n_devices < 2:
            return "needs at least 2 devices"
        return None

    def space(self, trial, ctx: SearchContext) -> TPPlan:
        devices = choose_devices(trial, ctx, self.param)
        tp = trial.suggest_categorical(self.param("size"), list(TP_SIZES))
        if len(devices) % tp:
            raise InfeasiblePlanError(f"tensor group size {tp} does not divide the {len(devices)} chosen devices")
        grouping = trial.suggest_categorical(self.param("grouping"), list(GROUPINGS)) if len(devices) > tp else "fast_links"
        depths = stage_choices(ctx.cost.n_devices)
        stages = trial.suggest_categorical(self.param("stages"), list(depths)) if len(depths) > 1 else 1
        if stages == 1:
            accum = choose_accum(trial, ctx, self.param)
            plan = build_plan(ctx.cost, devices, tp, grouping, ctx.global_batch, accum)
            dims = _dims(ctx.cost)
            if sequence_parallel_problem(plan, dims) is None and trial.suggest_categorical(
                    self.param("sequence_parallel"), [False, True]):
                return with_sequence_parallel(plan, dims)
            return plan
        if len(devices) % (tp * stages):
            raise InfeasiblePlanError(f"{stages} stages of {tp}-device tensor groups do not divide the "
                                      f"{len(devices)} chosen devices")
        m = trial.suggest_categorical(self.param("microbatches"), list(MICROBATCHES))
        return build_plan(ctx.cost, devices, tp, grouping, ctx.global_batch, stages=stages, microbatches=m)

    def counterparts(self, plan: TPPlan, cost: CostModel) -> list[Plan]:
        """The even-shard plan of the same devices and groups (what DTensor alone would run); for a
        DTensor plan, its twin with sequence parallelism switched (where that can run)."""
        dims = _dims(cost)
        if plan.dtensor:
            twin = replace(plan, sequence_parallel=not plan.sequence_parallel)
            return [twin] if sequence_parallel_problem(plan, dims) is None else []
        if plan.even:
            return []
        if dims.n_head % plan.tp_size or dims.hidden % (plan.tp_size * HIDDEN_GRANULE):
            return []
        if plan.stages > 1:
            return [even_counterpart(plan, cost, dims)]
        even = replace(plan, heads=even_split(dims.n_head, plan.tp_size), hidden=even_split(dims.hidden, plan.tp_size))
        groups = even.groups()
        return [replace(even, local_batch=balance_replicas(cost, dims, groups, even.heads, even.hidden,
                                                           plan.global_batch, plan.accum_steps))]

    def examples(self, ctx: SearchContext) -> list[TPPlan]:
        cost, gb, n = ctx.cost, ctx.global_batch, ctx.cost.n_devices
        if self.unavailable(ctx) is not None:
            return []
        pair = (0, 1)
        builders = [lambda: build_plan(cost, pair, 2, "fast_links", gb, even=True),
                    lambda: build_plan(cost, pair, 2, "fast_links", gb, even=True, sequence_parallel=True),
                    lambda: build_plan(cost, pair, 2, "fast_links", gb)]
        if n >= 4:  # DP x TP: pairs of mixed speeds, and pairs of like devices; PP x TP: a pair per stage
            builders += [lambda g=g: build_plan(cost, tuple(range(4)), 2, g, gb) for g in ("strided", "fast_links")]
            builders += [lambda g=g: build_plan(cost, tuple(range(4)), 2, g, gb, stages=2, microbatches=2)
                         for g in ("fast_links", "strided")]
        plans = self.buildable(cost, builders)
        return [p for i, p in enumerate(plans) if p not in plans[:i]]  # on equal devices, solved = even

    def validate(self, plan: TPPlan, cost) -> None:
        super().validate(plan, cost)
        dims = _dims(cost)
        t, P = plan.tp_size, plan.stages
        if t < 2 or P < 1 or len(plan.devices) != t * P * plan.dp:
            raise InfeasiblePlanError(f"tp plan: {len(plan.devices)} devices != tp_size({t}) * stages({P}) * "
                                      f"replicas({plan.dp}); give tp_size >= 2 ranks per stage of each replica")
        if len(plan.heads) != t or sum(plan.heads) != dims.n_head or min(plan.heads) < 1:
            raise InfeasiblePlanError(f"tp plan heads {list(plan.heads)} must be {t} counts >= 1 summing to {dims.n_head}")
        if len(plan.hidden) != t or sum(plan.hidden) != dims.hidden or min(plan.hidden) < 1:
            raise InfeasiblePlanError(f"tp plan hidden {list(plan.hidden)} must be {t} counts >= 1 summing to "
                                      f"{dims.hidden}")
        if P > 1:
            validate_pipeline(plan, cost)
        if plan.sequence_parallel and (problem := sequence_parallel_problem(plan, dims)):
            raise InfeasiblePlanError(f"tp plan: {problem}")
        if plan.accum_steps < 1 or min(plan.local_batch) < plan.accum_steps:
            raise InfeasiblePlanError(f"tp plan local batches {list(plan.local_batch)} must each be >= accum_steps "
                                      f"({plan.accum_steps})")
        if plan.precision != "fp32" or plan.checkpoint_blocks:
            raise InfeasiblePlanError("tp plans run fp32 without activation checkpointing (not built yet); "
                                      "use precision 'fp32' and checkpoint_blocks 0")

    def label(self, plan: TPPlan) -> str:
        shards = "even" if plan.even else f"heads {'/'.join(map(str, plan.heads))} units {'/'.join(map(str, plan.hidden))}"
        s = f"tp{plan.tp_size} {shards}" + (" sp" if plan.sequence_parallel else "")
        if plan.stages > 1:
            bounds = "/".join(map(str, plan.boundaries))
            s = f"pp{plan.stages} x {s} {plan.schedule} m={plan.microbatches} blocks {bounds}"
        if plan.dp > 1:
            s = f"dp{plan.dp} x {s} batch {'/'.join(map(str, plan.local_batch))}"
        s += f" on dev {','.join(map(str, plan.devices))}"
        return s + (f" accum {plan.accum_steps}" if plan.accum_steps > 1 else "")

    def graph(self, plan: TPPlan, cost) -> TaskGraph:
        return pipeline_graph(plan, cost, _dims(cost)) if plan.stages > 1 else tp_graph(plan, cost)

    def memory(self, plan: TPPlan, cost) -> tuple[MemoryBreakdown, ...]:
        dims = _dims(cost)
        return pipeline_memory(plan, cost, dims) if plan.stages > 1 else tp_memory(plan, cost, dims)

    def executor(self, plan: TPPlan, ctx: WorkerContext):
        # DTensor's import (~1 s a rank) only where a tensor-parallel plan runs.
        if plan.stages > 1:
            from ._tp_pipeline_run import TPPipelineExecutor

            return TPPipelineExecutor(plan, ctx)
        from ._tp_run import TPExecutor

        return TPExecutor(plan, ctx)
