"""The simulated step of the `zero` family: ZeRO-1 as DDP plus a parameter broadcast, ZeRO-2/3 as FSDP2's per-block collectives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hetsim.model.batchsplit import split_evenly
from hetsim.model.memory import fsdp_gather_bytes, zero1_owned_counts
from hetsim.model.simulator import Resource, TaskGraph, TaskKind

from .ddp import data_parallel_graph

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel

    from .zero import ZeROPlan


def zero1_graph(plan: ZeROPlan, cost: CostModel) -> TaskGraph:
    """DDP's step with each rank stepping only the parameters it owns, then the owners broadcast them."""
    owned = zero1_owned_counts(cost, len(plan.devices))
    g = data_parallel_graph(cost, plan.devices, plan.local_batch, plan.chunks, plan.precision,
                            plan.checkpoint_blocks, [float(c) for c in owned], grad_cache=plan.grad_cache_chunks > 1)
    opts = [t.tid for t in g.tasks if t.kind == TaskKind.OPTIMIZER]
    # ZeroRedundancyOptimizer broadcasts every owner's parameters: all-gather volume of the whole model,
    # plus the calibrated ZeRO-1 term (what the bucketed broadcasts cost beyond it; calibrate_zero1).
    group = tuple(plan.devices)
    g.add(Resource.COMM, TaskKind.ALLGATHER, cost.allgather_s(cost.param_bytes(), group) + cost.zero_residual_s(1, group),
          opts, label="param broadcast")
    return g


@dataclass
class _Sharded:
    """One FSDP2 step under construction: the plan, its group, and the tasks later ones wait for."""

    plan: ZeROPlan
    cost: CostModel
    g: TaskGraph = field(default_factory=TaskGraph)
    fwd_start: dict[tuple[int, int], int] = field(default_factory=dict)
    """(position, block) -> that block's forward task on that device."""
    rs_prev: int | None = None
    """The last reduce-scatter issued (a blocking rank's next micro-step waits for it)."""
    last_rs: list[int] = field(default_factory=list)
    """The reduce-scatters of the last micro-step (the optimizer waits for them)."""

    def __post_init__(self) -> None:
        self.devs = tuple(self.plan.devices)
        self.shards = len(self.devs)
        self.wbytes = fsdp_gather_bytes(self.cost, self.plan.precision)
        # On CUDA FSDP2 overlaps its collectives with compute through streams; on CPU (emulated devices)
        # streams do nothing and every all-gather and reduce-scatter blocks the rank that issues it.
        self.blocking = any(self.cost.device(d).backend == "emulated" for d in self.devs)

    def gather_s(self, param_bytes: float) -> float:
        return self.cost.allgather_s(param_bytes * self.wbytes / 4, self.devs)


def sharded_graph(plan: ZeROPlan, cost: CostModel) -> TaskGraph:
    """FSDP2: per-block all-gather before forward (and before backward for ZeRO-3), per-block
    reduce-scatter after backward, on one shared communication channel; the optimizer steps
    the local shard (on the host with offload).  A batch-coupled loss adds the all-gather of every
    rank's outputs: after a no-graph pass over every chunk (gradient cache), or between each
    forward and its backward."""
    st = _Sharded(plan, cost)
    coupled = cost.facts.batch_coupled
    grad_cache = plan.grad_cache_chunks > 1
    gather = None
    if coupled and grad_cache:  # the no-graph pass over every chunk, then the outputs' gather
        prev: list[int | None] = [None] * st.shards
        for j in range(plan.chunks):
            prev = _sharded_forward(st, f"N{j}", _chunk_sizes(plan, j), prev, {})
        gather = _gather_outputs(st, prev, moves=1)
    for j in range(plan.chunks):
        sizes = _chunk_sizes(plan, j)
        # A blocking rank starts the next micro-step's forward after its last reduce-scatter.
        prev_f: list[int | None] = [st.rs_prev if st.blocking else None] * st.shards
        if gather is not None and j == 0:
            prev_f = [gather] * st.shards
        prev_f = _sharded_forward(st, str(j), sizes, prev_f, st.fwd_start)
        if coupled and not grad_cache:  # every rank's outputs, for the loss, before any backward
            prev_f = [_gather_outputs(st, prev_f, moves=2)] * st.shards
        _sharded_backward(st, j, sizes, prev_f)
    _sharded_optimizer(st)
    return st.g


def _chunk_sizes(plan: ZeROPlan, j: int) -> list[int]:
    """Every rank's samples in micro-step (or gradient-cache chunk) j."""
    return [split_evenly(b, plan.chunks)[j] for b in plan.local_batch]


def _sharded_forward(st: _Sharded, tag: str, sizes: list[int], prev_f: list[int | None],
                     fwd_start: dict[tuple[int, int], int]) -> list[int | None]:
    """One forward over every block after `prev_f`: block k's all-gather is issued at block k's
    pre-forward; on CUDA the host runs ahead of the kernels, so it overlaps block k-1's compute; a
    blocking rank waits for it.  Returns each rank's last forward task."""
    plan, cost, g = st.plan, st.cost, st.g
    prev_f = list(prev_f)
    for k in range(cost.facts.n_blocks):
        pk = cost.param_bytes(k, k + 1)
        ag = None
        if pk:
            ahead = 1 if st.blocking else 2
            deps = [fwd_start.get((i, k - ahead)) for i in range(st.shards)]
            ag = g.add(Resource.COMM, TaskKind.ALLGATHER, st.gather_s(pk), deps, label=f"AG{tag}.{k}")
        for i, d in enumerate(st.devs):
            dur = cost.fwd_s(d, k, k + 1, sizes[i], plan.precision)
            if k == 0:
                dur += cost.overhead_s(d, sizes[i], plan.grad_cache_chunks > 1, plan.precision)
            if plan.offload and pk:
                dur += host_copy_s(cost, d, pk / st.shards)
            tid = g.add(Resource.device(d), TaskKind.FORWARD, dur, [ag, prev_f[i]], label=f"F{tag}.{k}")
            fwd_start[(i, k)] = tid
            prev_f[i] = tid
    return prev_f


def _gather_outputs(st: _Sharded, after: list[int | None], moves: int) -> int:
    """The batch-coupled loss's all-gather of every rank's (padded) outputs (`moves` 2: and its
    backward, which moves the gradients back)."""
    plan, cost = st.plan, st.cost
    padded = cost.base_profile.blocks[-1].out_bytes_per_sample * max(plan.local_batch) * st.shards
    return st.g.add(Resource.COMM, TaskKind.ALLGATHER, moves * cost.allgather_s(padded, st.devs), after,
                    label="gather outputs (global negatives)")


def _sharded_backward(st: _Sharded, j: int, sizes: list[int], prev_f: list[int | None]) -> None:
    """Micro-step j's backward: ZeRO-3 gathers each block again, the next one while this one computes
    (FSDP2's backward prefetch: block k-1's all-gather is issued as block k's backward starts); every
    block's gradient is reduce-scattered after its backward."""
    plan, cost, g = st.plan, st.cost, st.g
    n = cost.facts.n_blocks
    prev_b: list[int | None] = list(prev_f)
    gathers: dict[int, int] = {}
    regather = plan.zero_stage == 3
    if regather and cost.param_bytes(n - 1, n):
        gathers[n - 1] = g.add(Resource.COMM, TaskKind.ALLGATHER, st.gather_s(cost.param_bytes(n - 1, n)),
                               list(prev_f), label=f"AGb{j}.{n - 1}")
    st.rs_prev = None
    for k in reversed(range(n)):
        pprev = cost.param_bytes(k - 1, k) if k else 0
        if regather and pprev:  # prev_b: block k+1's backward (or the forward) has ended
            gathers[k - 1] = g.add(Resource.COMM, TaskKind.ALLGATHER, st.gather_s(pprev), list(prev_b),
                                   label=f"AGb{j}.{k - 1}")
        waits = [gathers.get(k)]
        if st.blocking:
            waits += [gathers.get(k - 1), st.rs_prev]
        bids = []
        for i, d in enumerate(st.devs):
            dur = cost.bwd_s(d, k, k + 1, sizes[i], plan.precision)
            dur += cost.recompute_s(d, k, k + 1, sizes[i], plan.precision, plan.checkpoint_blocks)
            if plan.offload and k in gathers:  # the shard goes up again for the re-gather
                dur += host_copy_s(cost, d, cost.param_bytes(k, k + 1) / st.shards)
            tid = g.add(Resource.device(d), TaskKind.BACKWARD, dur, [*waits, prev_b[i]], label=f"B{j}.{k}")
            bids.append(tid)
            prev_b[i] = tid
        gk = cost.grad_bytes(k, k + 1)  # frozen parameters have no gradient to reduce-scatter
        if gk:
            rs = g.add(Resource.COMM, TaskKind.REDUCESCATTER, cost.allgather_s(gk, st.devs), bids, label=f"RS{j}.{k}")
            st.rs_prev = rs
            if j == plan.chunks - 1:
                st.last_rs.append(rs)


def _sharded_optimizer(st: _Sharded) -> None:
    """The calibrated group residuals, then each rank's optimizer step on its shard (on the host with offload)."""
    plan, cost, g = st.plan, st.cost, st.g
    # The calibrated contention of a data-parallel group (measured with DDP: ranks computing side
    # by side and gloo progressing on busy cores) applies to FSDP's group as well, once a step.
    # Plus the stage's own term, calibrated with a real uniform step of that stage, once a micro-step:
    # FSDP2 gathers and reduce-scatters every block in every micro-step (resnet18@64, default cluster,
    # one recording: a second micro-step cost 142-248 ms more where the simulation added 94-118 ms,
    # against a ZeRO-2 term of 54 ms and a ZeRO-3 one of 124 ms).
    fsdp = plan.chunks * cost.zero_residual_s(plan.zero_stage, st.devs)
    if plan.offload:
        # FSDP2 with CPU offload: the term measured on one device alone, the largest of the plan's ranks
        # (each rank steps its own shard on the host, side by side).  That one-device run also pays
        # FSDP2's per-block work, which a group's stage term already carries: the larger of the two.
        # bert@tiny@64, 2026-12-03: a zero2 offload 22/10 bf16 plan without it stepped 12.6 % slower
        # than simulated (27 ms; the term: 38 ms).  resnet18@64 zero3 offload 22/10, five fresh benches
        # of 2026-12-04/05 with both terms added: +8.7 to +13.5 % slow (the terms 24-54 and 59-144 ms).
        fsdp = max(fsdp, max(cost.offload_single_s(d) for d in st.devs))
    sync = cost.sync_residual_s(st.devs, precision=plan.precision) + fsdp
    last_rs = st.last_rs
    if sync and last_rs:
        last_rs = [g.add(Resource.COMM, TaskKind.SYNC, sync, list(last_rs), label="sync (calibrated)")]
    for d in st.devs:
        count = cost.trainable_count() / st.shards
        t = cost.host_opt_s(d, count) if plan.offload else cost.opt_s(d, count)
        if plan.offload:
            t += host_copy_s(cost, d, cost.grad_bytes() / st.shards)  # sharded gradients to the host
        g.add(Resource.device(d), TaskKind.OPTIMIZER, t, list(last_rs), label="opt")


def host_copy_s(cost: CostModel, dev: int, nbytes: float) -> float:
    """Host<->device copy of nbytes.  On an emulated CPU device FSDP2's `.to(device)` of an offloaded
    shard returns the same tensor (host and device memory are one), so nothing is copied."""
    if cost.device(dev).backend == "emulated":
        return 0.0
    return cost.host_transfer_s(dev, nbytes)
