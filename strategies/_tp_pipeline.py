"""PP x TP plans of the `tp` family: pipeline stages that are tensor groups (and data-parallel
replicas of such a pipeline: DP x PP x TP, the shape Megatron and Sailor search).

Rank r = (replica x stages + stage) x tp_size + position runs on plan.devices[r].  Every tensor
group holds the same shards (position p: heads[p] heads and hidden[p] MLP units of each layer of
its stage), so the ranks of one position talk to the same position of the next stage (one pipeline
process group per position and replica) and sum gradients with the same position of the other
replicas.  Which device goes where: the chosen devices form tensor groups (`_tp_shards.tensor_groups`:
like devices together, or every group one device of each speed tier), fastest group first, and
group g becomes stage g // dp of replica g % dp, so replicas get alike stages and the fast
groups the early stages; the stage boundaries are the exact DP of `_pipeline_bounds.min_sum_plus_max`
over the tensor groups' lockstep times, then each replica's batch the min-max greedy split.

Simulation: torch's schedule (GPipe or 1F1B, `_pipeline_sched.rank_actions`) per stage, each
action expanded as `tp_graph` expands a micro-step (a layer: two segments per rank, each followed
by an all-reduce over the tensor group), activations and gradients sent position to position,
then each position's gradient all-reduce over the replicas and every rank's optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from hetsim.errors import InfeasiblePlanError
from hetsim.model.batchsplit import min_max_split
from hetsim.model.memory import loss_kept_bytes
from hetsim.model.simulator import Resource, TaskGraph, TaskKind
from hetsim.types import MemoryBreakdown

from ._pipeline_bounds import check_boundaries, min_sum_plus_max
from ._pipeline_memory import replicas_memory, stage_state
from ._pipeline_sched import action_term, inflight_counts, rank_actions, replica_allreduce_s
from ._tp_shards import TransformerDims, even_split

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel

    from .tp import TPPlan

PIPELINE_SCHEDULES = ("GPipe", "1F1B")
"""Schedules of PP x TP plans: one stage per rank (torch's looped and zero-bubble schedules are not
offered with tensor groups yet)."""


def schedule_for(stages: int, microbatches: int) -> str:
    """1F1B where every stage gets a micro-batch in flight (m >= stages), else GPipe."""
    return "1F1B" if microbatches >= stages else "GPipe"


def stage_groups(plan: TPPlan) -> list[list[tuple[int, ...]]]:
    """[replica][stage] -> the devices of that stage's tensor group, by position."""
    t, P = plan.tp_size, plan.stages
    return [[plan.devices[(i * P + s) * t:(i * P + s + 1) * t] for s in range(P)] for i in range(plan.dp)]


def stage_params(cost: CostModel, dims: TransformerDims, heads: int, hidden: int, lo: int, hi: int | None) -> int:
    """Parameters a rank holding `heads` heads and `hidden` units of every layer keeps of blocks
    lo..hi (hi None: the whole model, counted once where weights are tied)."""
    d, u = dims.d_model, dims.hidden
    attn = (3 * d * d + 3 * d + d * d) * (1 - heads / dims.n_head)
    mlp = (2 * d * u + u) * (1 - hidden / u)
    layers = sum(1 for k in dims.layer_blocks if lo <= k and (hi is None or k < hi))
    return int(cost.param_count(lo, hi) - layers * (attn + mlp))


def position_params(cost: CostModel, dims: TransformerDims, heads: int, hidden: int) -> int:
    """Parameters a rank holds with `heads` heads and `hidden` units of every layer."""
    return stage_params(cost, dims, heads, hidden, 0, None)


class _Shards:
    """A plan's shard fractions and the all-reduce of one activation on a tensor group."""

    def __init__(self, cost: CostModel, dims: TransformerDims, heads, hidden):
        self.cost, self.dims = cost, dims
        self.fa = [h / dims.n_head for h in heads]
        self.fb = [u / dims.hidden for u in hidden]

    def allreduce_s(self, group: tuple[int, ...], m: int) -> float:
        from .tp import layer_collective_s

        return layer_collective_s(self.cost, self.dims, group, m, "slices")

    def block_s(self, group: tuple[int, ...], k: int, m: int) -> float:
        """Forward + backward of block k on the group in lockstep (a layer: the slowest position of
        each of its four segments and four all-reduces; any other block whole on every rank), its
        compute scaled by the group's calibrated `tp_pipeline_scale`."""
        from .tp import segment_s

        cost, dims = self.cost, self.dims
        scale = 1.0 + cost.tp_pipeline_scale(group)
        if k not in dims.layer_blocks:
            return scale * max(cost.fwd_s(d, k, k + 1, m) + cost.bwd_s(d, k, k + 1, m) for d in group)
        total = 0.0
        for fwd in (True, False):
            for attn, fr in ((True, self.fa), (False, self.fb)):
                total += max(segment_s(cost, dims, d, k, m, fwd, attn, fr[p]) for p, d in enumerate(group))
        return scale * total + 4 * self.allreduce_s(group, m)


def add_blocks(g: TaskGraph, sh: _Shards, group: tuple[int, ...], comm: str, blocks, m: int, forward: bool,
               deps: list[tuple[int, ...]], extra: float, label: str) -> list[int]:
    """The tasks of one pipeline action on a tensor group: blocks in order (forward) or reversed
    (backward), a layer as two segments per position each followed by an all-reduce on `comm`;
    `deps[p]` gate position p's first task, which also carries `extra` (the stage's per-action
    overhead); compute takes the group's calibrated `tp_pipeline_scale`.  Returns each position's
    last task."""
    from .tp import segment_s

    cost, dims = sh.cost, sh.dims
    kind = TaskKind.FORWARD if forward else TaskKind.BACKWARD
    cur = [list(d) for d in deps]
    first = [True] * len(group)
    scale = 1.0 + cost.tp_pipeline_scale(group)

    def add(p: int, dur: float, lbl: str) -> int:
        dur *= scale
        if first[p]:
            dur, first[p] = dur + extra, False
        return g.add(Resource.device(group[p]), kind, dur, cur[p], label=lbl)

    for k in (blocks if forward else reversed(blocks)):
        if k not in dims.layer_blocks:
            for p, d in enumerate(group):
                t = cost.fwd_s(d, k, k + 1, m) if forward else cost.bwd_s(d, k, k + 1, m)
                cur[p] = [add(p, t, f"{label}.{k}")]
            continue
        for attn in ((True, False) if forward else (False, True)):
            fr = sh.fa if attn else sh.fb
            tids = [add(p, segment_s(cost, dims, d, k, m, forward, attn, fr[p]), f"{label}.{k}{'a' if attn else 'm'}")
                    for p, d in enumerate(group)]
            ar = g.add(comm, TaskKind.ALLREDUCE, sh.allreduce_s(group, m), tids, label=f"allreduce {label}.{k}")
            cur = [[ar] for _ in group]
    return [c[0] for c in cur]


def in_dependency_order(actions_by_rank, n_stages: int) -> list:
    """Every rank's actions, each rank's in its own order, merged so that an action comes after the
    action on the next rank that feeds it (F of stage s after F of s - 1, B of s after B of s + 1,
    same micro-batch): the order in which `pipeline_graph` adds them, so a dependency always exists."""
    todo = [list(a) for a in actions_by_rank]
    seen: set[tuple[str, int, int]] = set()
    out = []
    while any(todo):
        progressed = False
        for acts in todo:
            while acts:
                a = acts[0]
                fwd = a.kind == "F"
                need = ("F", a.stage - 1, a.mb) if fwd and a.stage > 0 else (
                    ("B", a.stage + 1, a.mb) if not fwd and a.stage + 1 < n_stages else None)
                if need is not None and need not in seen:
                    break
                out.append(acts.pop(0))
                seen.add(("F" if fwd else "B", a.stage, a.mb))
                progressed = True
        if not progressed:
            raise InfeasiblePlanError(f"a pipeline schedule of {n_stages} stages deadlocks: {actions_by_rank}")
    return out


def _add_replica(g: TaskGraph, plan: TPPlan, sh: _Shards, i: int, groups, last: dict[int, int]) -> None:
    """Replica i's schedule: each action on its stage's tensor group (`add_blocks`), each stage's
    output (input gradient) sent position to position; `last[d]`: each device's last task."""
    cost, P, m, b = sh.cost, plan.stages, plan.microbatches, plan.boundaries
    micro = plan.local_batch[i] // m
    extra = action_term(cost, plan.schedule, micro, m)
    tag = f"r{i}:" if plan.dp > 1 else ""
    sent: dict[tuple[bool, int, int], list[int]] = {}  # (forward, from stage, mb) -> per position transfer
    done: dict[tuple[bool, int, int], list[int]] = {}  # (forward, stage, mb) -> per position last task
    for a in in_dependency_order(rank_actions(plan.schedule, P, m, 1), P):
        s, j, fwd = a.stage, a.mb, a.kind == "F"
        grp = groups[s]
        src = (s - 1 if fwd else s + 1)
        into = sent.get((fwd, src, j))
        deps = [((into[p],) if into else ()) + (() if fwd else (done[(True, s, j)][p],)) for p in range(len(grp))]
        overhead = max(cost.stage_overhead_s(d, b[s], b[s + 1], micro) for d in grp) if fwd else 0.0
        ends = add_blocks(g, sh, grp, f"tp{i}.{s}", list(range(b[s], b[s + 1])), micro, fwd, deps, extra + overhead,
                          f"{tag}{'F' if fwd else 'B'}{s}.{j}")
        done[(fwd, s, j)] = ends
        last.update(zip(grp, ends))
        nxt = s + 1 if fwd else s - 1
        if 0 <= nxt < P:
            nbytes = cost.blocks()[b[s + 1] - 1 if fwd else b[s] - 1].out_bytes_per_sample * micro
            sent[(fwd, s, j)] = [g.add(Resource.link(d, groups[nxt][p]), TaskKind.P2P,
                                       cost.p2p_s(nbytes, d, groups[nxt][p]), [ends[p]],
                                       label=f"{'act' if fwd else 'grad'} {s}->{nxt} mb{j}")
                                 for p, d in enumerate(grp)]


def pipeline_graph(plan: TPPlan, cost: CostModel, dims: TransformerDims) -> TaskGraph:
    """Every replica's schedule, then each stage position's gradient all-reduce over the replicas
    (one flat sum, as `hybrid`) and every rank's optimizer step over its own parameters."""
    g = TaskGraph()
    sh = _Shards(cost, dims, plan.heads, plan.hidden)
    last: dict[int, int] = {}
    every = stage_groups(plan)
    for i, groups in enumerate(every):
        _add_replica(g, plan, sh, i, groups, last)
    b = plan.boundaries
    for s in range(plan.stages):
        for p in range(plan.tp_size):
            members = tuple(every[i][s][p] for i in range(plan.dp))
            count = stage_params(cost, dims, plan.heads[p], plan.hidden[p], b[s], b[s + 1])
            reduced = []
            if plan.dp > 1:
                reduced.append(g.add(f"dp{s}.{p}", TaskKind.ALLREDUCE,
                                     replica_allreduce_s(cost, 4 * count, members), [last[d] for d in members],
                                     label=f"allreduce stage {s} position {p}"))
            for d in members:
                g.add(Resource.device(d), TaskKind.OPTIMIZER, cost.opt_s(d, count), [last[d], *reduced], label="opt")
    return g


def pipeline_memory(plan: TPPlan, cost: CostModel, dims: TransformerDims) -> tuple[MemoryBreakdown, ...]:
    """Per rank: the pipeline rank's memory model of its stage, with the parameter state scaled to
    the rank's own shards and the layers' sharded activations to its share (as `tp_memory`)."""
    from ._tp_memory import sharded_act_factor

    P, m, b = plan.stages, plan.microbatches, plan.boundaries
    base = replicas_memory(cost, plan.schedule, P, b, m, [x // m for x in plan.local_batch], "fp32", 0)
    out = []
    for r in range(len(plan.devices)):
        p, k = r % plan.tp_size, r // plan.tp_size  # k = replica x stages + stage
        s = k % P
        lo, hi = b[s], b[s + 1]
        mem = base[k]
        share = stage_params(cost, dims, plan.heads[p], plan.hidden[p], lo, hi) / max(1, cost.param_count(lo, hi))
        micro = plan.local_batch[k // P] // m
        act = sharded_act_factor(cost, dims, plan.heads[p], plan.hidden[p], lo, hi, micro)
        # The stage with the head computes the loss in full on every rank (the head is replicated):
        # the loss's saved tensors and its temporaries are not shards.  pp2 x tp2 on gpt@tiny@64, 16
        # samples a micro-batch: that stage measured 44.6 MiB a rank where scaling them predicted 33.8.
        loss = hi == cost.facts.n_blocks
        kept = min(mem.activations_bytes, loss_kept_bytes(cost, micro, plan.precision)) if loss else 0.0
        out.append(MemoryBreakdown(params_bytes=int(mem.params_bytes * share), grads_bytes=int(mem.grads_bytes * share),
                                   optim_bytes=int(mem.optim_bytes * share),
                                   activations_bytes=int((mem.activations_bytes - kept) * act + kept),
                                   other_bytes=int(mem.other_bytes * (1.0 if loss else act))))
    return tuple(out)


def _stage_elements(cost: CostModel, dims: TransformerDims, sh: _Shards, lanes, micros, m: int, schedule: str,
                    heads, hidden):
    """elem(stage, lo, hi) of `min_sum_plus_max` for tensor groups as stages: (per micro-batch
    forward + backward on the slowest replica's group, plus sends; its bottleneck), None when the
    stage's shards and in-flight activations do not fit a member."""
    P = len(lanes[0])
    inflight = inflight_counts(rank_actions(schedule, P, m, 1), P)
    nb = cost.facts.n_blocks
    prefix: dict[tuple, list[float]] = {}

    def pre(group, micro) -> list[float]:
        key = (tuple(cost.klass[d] for d in group), micro)
        if key not in prefix:
            acc = [0.0]
            for k in range(nb):
                acc.append(acc[-1] + sh.block_s(group, k, micro))
            prefix[key] = acc
        return prefix[key]

    def fits(group, lo, hi, micro, s) -> bool:
        p_b, g_b, o_b = stage_state(cost, lo, hi)
        whole = max(1, cost.param_count(lo, hi))
        for p, d in enumerate(group):
            share = stage_params(cost, dims, heads[p], hidden[p], lo, hi) / whole
            need = (p_b + g_b + o_b) * share + inflight[s] * cost.act_bytes(lo, hi, micro)
            if need > cost.device(d).memory_bytes:
                return False
        return True

    def elem(s: int, lo: int, hi: int):
        a_max = peak = 0.0
        for lane, micro in zip(lanes, micros):
            grp = lane[s]
            if not fits(grp, lo, hi, micro, s):
                return None
            acc = pre(grp, micro)
            c = (acc[hi] - acc[lo] + max(cost.stage_overhead_s(d, lo, hi, micro) for d in grp)
                 + 2 * action_term(cost, schedule, micro, m))
            link = 0.0
            if s + 1 < P:
                nbytes = cost.blocks()[hi - 1].out_bytes_per_sample * micro
                link = 2 * max(cost.p2p_s(nbytes, d, lane[s + 1][p]) for p, d in enumerate(grp))
            a_max = max(a_max, c + link)
            peak = max(peak, c, link)
        return a_max, peak

    return elem


def solve_pipeline(cost: CostModel, dims: TransformerDims, groups, dp: int, heads, hidden, global_batch: int,
                   microbatches: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(boundaries, samples per replica) for tensor groups groups[s * dp + i] as stage s of replica
    i: boundaries by the exact DP at an even batch split, then the min-max split of the batch over
    replicas in units of one sample per micro-batch."""
    P, m = len(groups) // dp, microbatches
    if P > cost.facts.n_blocks:
        raise InfeasiblePlanError(f"{P} pipeline stages need at least {P} blocks; the model has {cost.facts.n_blocks}")
    units = global_batch // m
    if global_batch % m or units < dp:
        raise InfeasiblePlanError(f"global batch {global_batch} does not give {dp} replica(s) {m} micro-batches of at "
                                  "least one sample each; change the batch or the micro-batch count")
    schedule = schedule_for(P, m)
    lanes = [[groups[s * dp + i] for s in range(P)] for i in range(dp)]
    sh = _Shards(cost, dims, heads, hidden)
    even = even_split(units, dp)
    elem = _stage_elements(cost, dims, sh, lanes, even, m, schedule, heads, hidden)
    _, bounds = min_sum_plus_max(P, cost.facts.n_blocks, elem, float(m - 1))

    def replica_s(i: int, u: int) -> float:
        if u <= 0:
            return 0.0
        e = _stage_elements(cost, dims, sh, [lanes[i]], [u], m, schedule, heads, hidden)
        parts = [e(s, bounds[s], bounds[s + 1]) for s in range(P)]
        if any(x is None for x in parts):
            return math.inf
        return sum(x[0] for x in parts) + (m - 1) * max(x[1] for x in parts)

    split = min_max_split(dp, units, 1, replica_s) if dp > 1 else (units,)
    return bounds, tuple(u * m for u in split)


def build_pipeline_plan(cost: CostModel, dims: TransformerDims, groups, dp: int, heads, hidden, global_batch: int,
                        microbatches: int) -> TPPlan:
    """The PP x TP plan of tensor groups `groups` (fastest first) and these shards, its boundaries and
    replica batches solved."""
    from .tp import TPPlan

    bounds, local = solve_pipeline(cost, dims, groups, dp, heads, hidden, global_batch, microbatches)
    P = len(groups) // dp
    order = [groups[s * dp + i] for i in range(dp) for s in range(P)]
    return TPPlan(devices=tuple(d for grp in order for d in grp), tp_size=len(groups[0]), heads=tuple(heads),
                  hidden=tuple(hidden), local_batch=local, stages=P, boundaries=bounds, microbatches=microbatches,
                  schedule=schedule_for(P, microbatches))


def even_counterpart(plan: TPPlan, cost: CostModel, dims: TransformerDims) -> TPPlan:
    """The same devices, groups and micro-batches with DTensor-like even shards, re-solved."""
    heads, hidden = even_split(dims.n_head, plan.tp_size), even_split(dims.hidden, plan.tp_size)
    groups = [grp for s in range(plan.stages) for grp in (row[s] for row in stage_groups(plan))]
    return replace(build_pipeline_plan(cost, dims, groups, plan.dp, heads, hidden, plan.global_batch,
                                       plan.microbatches), precision=plan.precision)


def validate_pipeline(plan: TPPlan, cost: CostModel) -> None:
    P = plan.stages
    if plan.schedule not in PIPELINE_SCHEDULES:
        raise InfeasiblePlanError(f"tp plan schedule {plan.schedule!r} with stages: use one of {list(PIPELINE_SCHEDULES)}")
    if len(plan.boundaries) != P + 1:
        raise InfeasiblePlanError(f"tp plan with {P} stages needs {P + 1} boundaries, got {list(plan.boundaries)}")
    check_boundaries(plan.boundaries, cost.facts.n_blocks)
    if plan.accum_steps != 1:
        raise InfeasiblePlanError(f"tp plan with stages: accum_steps {plan.accum_steps} must be 1 (the pipeline's "
                                  "micro-batches accumulate); set microbatches instead")
    if plan.microbatches < 1 or any(x % plan.microbatches or x < plan.microbatches for x in plan.local_batch):
        raise InfeasiblePlanError(f"tp plan local batches {list(plan.local_batch)} must each divide into "
                                  f"microbatches({plan.microbatches}) of at least one sample")
