"""The data-parallel step (ddp, ZeRO-1) in closed form: what `data_parallel_graph` + `run_steady` give.

The event simulation of a data-parallel step is a short recurrence, so the search need not build and
run its task graph.  Each device runs its micro-steps' forward and backward tasks back to back with
no dependency on another device; one shared channel all-reduces the gradient buckets in order, each
once every device has finished the last backward of the bucket's lowest block; each device then
steps its optimizer after its own compute and the whole channel.  Two steps in a row (`run_steady`)
repeat that from each device's end of step 1.  Per device, only the time at which each bucket becomes
ready and the total compute depend on the plan; they are memoized in the cost model per (device,
local batch, accumulation, precision, checkpointing), so a plan costs O(devices x buckets).

On an emulated cluster each rank's core also runs its share of the all-reduces that start while it
computes (`rank_comm_cpu_s`): the graph's COMM_CPU task after its last backward, added here to its
compute.

`tests/unit/test_closed_form.py` checks it against the event simulator on every family's plans
(relative 1e-9: only the order of float additions differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import add
from typing import TYPE_CHECKING

from hetsim.model.batchsplit import split_evenly
from hetsim.model.simulator import StepTiming, TaskKind

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel

BUCKET_CAP_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
FIRST_BUCKET_BYTES = 1 * 2**20  # DDP's first (smallest) bucket


def buckets(cost: CostModel) -> list[tuple[int, int]]:
    """DDP gradient buckets as (lowest block, bytes), in the order they become ready (last block first)."""
    out: list[tuple[int, int]] = []
    cap, size, low = FIRST_BUCKET_BYTES, 0, None
    for k in reversed(range(cost.facts.n_blocks)):
        pb = cost.grad_bytes(k, k + 1)  # DDP buckets the gradients: frozen parameters have none
        if pb == 0:
            continue
        size += pb
        low = k
        if size >= cap:
            out.append((low, size))
            cap, size, low = BUCKET_CAP_BYTES, 0, None
    if size:
        out.append((low, size))  # type: ignore[arg-type]
    return out


@dataclass(frozen=True, slots=True)
class _DeviceStep:
    """One device's compute in a data-parallel step, from its own start (time 0)."""

    ready_s: tuple[float, ...]
    """When the device's last backward of each bucket's lowest block ends (bucket order)."""
    compute_s: float
    """End of its last backward task (all forward, backward and recompute)."""
    fwd_s: float
    bwd_s: float


def device_step(cost: CostModel, d: int, local: int, accum: int, precision: str, ckpt: int,
                lows: tuple[int, ...]) -> _DeviceStep:
    """The task durations `data_parallel_graph` gives device d, added in its program order."""
    n = cost.facts.n_blocks
    t = f_sum = b_sum = 0.0
    done: dict[int, float] = {}
    micro = split_evenly(local, accum)
    for j, m in enumerate(micro):
        f = max(0.0, float(cost.fwd_s(d, 0, n, m, precision) + cost.overhead_s(d, m, precision=precision)))
        t += f
        f_sum += f
        last = j == len(micro) - 1
        for k in reversed(range(n)):
            b = max(0.0, float(cost.bwd_s(d, k, k + 1, m, precision) + cost.recompute_s(d, k, k + 1, m, precision, ckpt)))
            t += b
            b_sum += b
            if last:
                done[k] = t
    return _DeviceStep(ready_s=tuple(done[k] for k in lows), compute_s=t, fwd_s=f_sum, bwd_s=b_sum)


def comm_plan(cost: CostModel, devices: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(lowest block of each bucket, each bucket's all-reduce time) on this group; memoized."""
    table = cost.memo_table("dp_comm")
    found = table.get(devices)
    if found is None:
        bs = buckets(cost)
        found = table[devices] = (tuple(low for low, _ in bs),
                                  tuple(max(0.0, float(cost.allreduce_s(nbytes, devices))) for _, nbytes in bs))
    return found


def device_steps(cost: CostModel, devices: tuple[int, ...], local_batch: tuple[int, ...], accum: int, precision: str,
                 ckpt: int) -> list[_DeviceStep]:
    """Each device's `device_step`, memoized per (device class, local batch, accumulation, precision,
    checkpointing): a device's compute is its class's, and the buckets' lowest blocks are the model's."""
    lows = comm_plan(cost, devices)[0]
    table = cost.memo_table("dp_device")
    klass = cost.klass
    steps = []
    for d, b in zip(devices, local_batch):
        key = (klass[d], b, accum, precision, ckpt)
        st = table.get(key)
        if st is None:
            st = table[key] = device_step(cost, d, b, accum, precision, ckpt, lows)
        steps.append(st)
    return steps


def compute_overlap(compute: list[float]) -> float:
    """How much of a data-parallel step all its devices compute together: the earliest device's
    compute end over the latest's, each from its own start (1: balanced; 0.5: one device idles for
    half the step).  `CostModel.sync_residual_s` reads its calibrated term at it."""
    return min(compute) / max(compute) if compute and max(compute) > 0 else 1.0


def data_parallel_compute(cost: CostModel, plan) -> list[float]:
    """Each device's compute end in a ddp or ZeRO-1 `plan`, from its own start (`device_step`)."""
    return [st.compute_s for st in device_steps(cost, plan.devices, plan.local_batch, plan.accum_steps,
                                                plan.precision, plan.checkpoint_blocks)]


def step_terms(cost: CostModel, devices: tuple[int, ...], steps: list[_DeviceStep],
               ar: tuple[float, ...], precision: str = "fp32") -> tuple[tuple[float, ...], float]:
    """(each device's `rank_comm_cpu_s`, the calibrated sync at the step's `compute_overlap`; 0 without
    buckets) of a data-parallel step whose devices compute `steps`: what the graph and the closed form
    both add."""
    compute = [st.compute_s for st in steps]
    cpu_comm = rank_comm_cpu_s(cost, devices, list(zip(*[st.ready_s for st in steps])), compute, ar)
    return cpu_comm, cost.sync_residual_s(devices, compute_overlap(compute), precision) if ar else 0.0


def rank_comm_cpu_s(cost: CostModel, devices: tuple[int, ...], ready: list[tuple[float, ...]],
                    compute: list[float], ar: tuple[float, ...]) -> tuple[float, ...]:
    """Per device: the time its own core spends on the gradient all-reduces that start while it still
    computes (emulated CPU ranks only; 0 elsewhere).  `ready`: per bucket, each device's ready time
    from its own start; `compute`: each device's compute end; `ar`: each bucket's all-reduce time.

    A gloo all-reduce runs on the rank's own CPU core: on an emulated rank it takes its time from the
    rank's real compute, where on a GPU the collective runs beside the kernels.  A throttled rank
    (speed s) spins for 1 - s of its busy time and the collective takes its core in those spins for
    free, so it loses s of the all-reduce.  Measured on resnet50@64 (emu:1.0@4G,0.5@2G, one recording,
    ten runs of five uneven and uniform ddp splits, two each, interleaved): step-time MAPE 13.2 %
    without this term (27/5, the search's best, -16 and -14 %; 22/10 -20 and -19 %) and 7.5 % with
    it (27/5 -1.5 and +0.7 %; 22/10 -15 and -13 %; the uniform 16/16 +10 and +3 %).  The chain of
    all-reduces is that of a step whose devices all start at 0 (the first step); the steady step
    adds the same time.
    """
    share = [d.speed if d.backend == "emulated" else 0.0 for d in (cost.device(i) for i in devices)]
    if not any(share) or len(devices) < 2:
        return (0.0,) * len(devices)
    stolen = [0.0] * len(devices)
    t = 0.0
    for r, dur in zip(ready, ar):
        t = max(t, max(r))
        for i, c in enumerate(compute):
            if t < c:
                stolen[i] += share[i] * dur
        t += dur
    return tuple(stolen)


def data_parallel_timing(cost: CostModel, devices: tuple[int, ...], local_batch: tuple[int, ...], accum: int,
                         precision: str, ckpt: int, opt_params: tuple[float, ...],
                         broadcast_bytes: float | None = None, broadcast_extra_s: float = 0.0) -> StepTiming:
    """The steady step of `data_parallel_graph` (then ZeRO-1's parameter broadcast of
    `broadcast_bytes` after every optimizer step, when given, plus its calibrated `broadcast_extra_s`),
    as `run_steady` times it."""
    ar = comm_plan(cost, devices)[1]
    steps = device_steps(cost, devices, local_batch, accum, precision, ckpt)
    opt_table = cost.memo_table("dp_opt")
    opts = opt_table.get((devices, opt_params))
    if opts is None:
        opts = opt_table[(devices, opt_params)] = [max(0.0, float(cost.opt_s(d, p))) for d, p in zip(devices, opt_params)]
    bcast = None if broadcast_bytes is None else max(0.0, float(cost.allgather_s(broadcast_bytes, devices)
                                                               + broadcast_extra_s))
    ready = list(zip(*[st.ready_s for st in steps]))  # per bucket: each device's time, from its start
    cpu_comm, sync = step_terms(cost, devices, steps, ar, precision)
    compute = [st.compute_s + x for st, x in zip(steps, cpu_comm)]  # the graph's COMM_CPU task after the last backward

    # Step 1: every device starts at 0.
    t = 0.0
    for r, dur in zip(ready, ar):
        t = max(t, max(r)) + dur
    if ar and sync:
        t += sync
    # Each optimizer step waits for its own compute and for every collective (no collective: no wait).
    ends1 = [max(c, t) + o for c, o in zip(compute, opts)] if ar else list(map(add, compute, opts))
    if bcast is not None:
        t = max(t, max(ends1)) + bcast
    comm1 = t
    makespan1 = max(max(ends1), comm1)
    if cost.step_barrier:  # every step starts together: the step is step 1's makespan
        period = makespan1
    else:
        # Step 2: each resource goes on from where it left step 1; ZeRO-1's broadcast ends step 1 for every rank.
        starts = [max(e, comm1) for e in ends1] if bcast is not None else ends1
        for r, dur in zip(ready, ar):
            t = max(t, max(map(add, starts, r))) + dur
        if ar and sync:
            t += sync
        compute2 = list(map(add, starts, compute))
        ends2 = [max(c, t) + o for c, o in zip(compute2, opts)] if ar else list(map(add, compute2, opts))
        if bcast is not None:
            t = max(t, max(ends2)) + bcast
        period = max(0.0, max(max(ends2), t) - makespan1)

    breakdown = {"F": sum([st.fwd_s for st in steps]), "B": sum([st.bwd_s for st in steps])}
    if any(cpu_comm):
        breakdown[TaskKind.COMM_CPU] = sum(cpu_comm)
    if ar:
        breakdown["allreduce"] = sum(ar)
        if sync:
            breakdown["sync"] = sync
    breakdown["opt"] = sum(opts)
    if bcast is not None:
        breakdown["allgather"] = bcast
    busy = map(add, [st.compute_s for st in steps], opts)  # the all-reduces' CPU time is not compute
    return StepTiming(period_s=period, busy_s=tuple(busy), breakdown_s=breakdown)
