"""A discrete-event simulation of a task graph: per-resource program order plus dependencies.

A strategy turns a plan into a `TaskGraph` whose tasks sit on resources (a
device's compute stream, a communication channel) in program order — for a
pipeline, exactly the per-rank action lists its schedule runs.  `run_graph`
starts each task when its resource is free and its dependencies are done;
`run_steady` runs two training steps back to back, as a real run repeats them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from hetsim.errors import HetsimError
from hetsim.types import TimelineEvent


class TaskKind:
    """What a task does: the names a family's task graph uses (plain strings, so that graphs,
    timelines and breakdowns stay JSON as they are; a family may add its own kinds)."""

    FORWARD = "F"
    BACKWARD = "B"
    """The whole backward of a block range (input and weight gradients; recomputation included)."""
    WEIGHT_GRAD = "W"
    """Zero-bubble schedules: the weight-gradient half of a backward, split from the input half."""
    OPTIMIZER = "opt"
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    REDUCESCATTER = "reducescatter"
    SYNC = "sync"
    """Calibrated gradient-synchronisation residual (what the bucket model misses)."""
    P2P = "p2p"
    """A pipeline activation or gradient transfer between two devices."""
    COMM_CPU = "comm cpu"
    """An emulated CPU rank's own core running its share of the gradient all-reduces
    (`strategies/_dp_closed.rank_comm_cpu_s`): device time, not compute."""
    COMPUTE = frozenset({FORWARD, BACKWARD, WEIGHT_GRAD, OPTIMIZER})
    """The kinds that keep a device busy (the bubble fraction is the rest of its step)."""


class Resource:
    """Where a task runs: a device's compute stream, a shared communication channel, a link.
    Tasks on one resource run one at a time, in program order."""

    DEVICE_PREFIX = "dev"
    COMM = "comm"
    """The collective channel of the plan's whole device group."""

    @staticmethod
    def device(index: int) -> str:
        """The compute stream of cluster device `index`."""
        return f"{Resource.DEVICE_PREFIX}{index}"

    @staticmethod
    def is_device(resource: str) -> bool:
        return resource.startswith(Resource.DEVICE_PREFIX)

    @staticmethod
    def link(src: int, dst: int) -> str:
        """The directed point-to-point link from cluster device `src` to `dst`."""
        return f"link{src}->{dst}"

    @staticmethod
    def group(index: int) -> str:
        """The collective channel of the `index`-th data-parallel group of a plan (hybrid stages)."""
        return f"dp{index}"


@dataclass(slots=True)
class Task:
    tid: int
    resource: str
    """A `Resource` name: 'dev0', 'comm', 'link0->1', 'dp0'."""
    kind: str
    """A `TaskKind`: 'F', 'B', 'W' (weight grad), 'opt', 'allreduce', 'p2p', ..."""
    label: str
    duration_s: float
    deps: tuple[int, ...]


@dataclass(slots=True)
class TaskGraph:
    tasks: list[Task] = field(default_factory=list)

    def add(self, resource: str, kind: str, duration_s: float, deps=(), label: str = "") -> int:
        tid = len(self.tasks)
        self.tasks.append(Task(tid, resource, kind, label or kind, max(0.0, float(duration_s)), tuple(d for d in deps if d is not None)))
        return tid


@dataclass(frozen=True, slots=True)
class Schedule:
    start_s: tuple[float, ...]
    end_s: tuple[float, ...]
    makespan_s: float

    def busy_s(self, graph: TaskGraph, resource: str, kinds: set[str] | None = None) -> float:
        return sum(
            self.end_s[t.tid] - self.start_s[t.tid]
            for t in graph.tasks
            if t.resource == resource and (kinds is None or t.kind in kinds)
        )

    def busy_by_resource(self, graph: TaskGraph, kinds: set[str] | None = None) -> dict[str, float]:
        """`busy_s` of every resource at once (one pass over the tasks)."""
        out: dict[str, float] = {}
        for t in graph.tasks:
            if kinds is None or t.kind in kinds:
                out[t.resource] = out.get(t.resource, 0.0) + (self.end_s[t.tid] - self.start_s[t.tid])
        return out

    def timeline(self, graph: TaskGraph) -> list[TimelineEvent]:
        return [
            TimelineEvent(resource=t.resource, kind=t.kind, label=t.label, start_s=self.start_s[t.tid], end_s=self.end_s[t.tid])
            for t in graph.tasks
        ]


class DeadlockError(HetsimError):
    pass


def run_graph(graph: TaskGraph) -> Schedule:
    """Event loop over resources; raises DeadlockError when program order and dependencies conflict."""
    n = len(graph.tasks)
    queues: dict[str, list[int]] = {}
    for t in graph.tasks:
        queues.setdefault(t.resource, []).append(t.tid)
    head = dict.fromkeys(queues, 0)
    free_at = dict.fromkeys(queues, 0.0)
    start = [0.0] * n
    end = [-1.0] * n
    waiting: dict[int, list[str]] = {}  # task id -> resources whose head waits for it
    events: list[tuple[float, int]] = []  # (end time, task id)
    done = 0

    def try_start(res: str) -> None:
        i = head[res]
        if i >= len(queues[res]):
            return
        t = graph.tasks[queues[res][i]]
        for d in t.deps:
            if end[d] < 0:
                waiting.setdefault(d, []).append(res)
                return
        s = max([free_at[res]] + [end[d] for d in t.deps])
        start[t.tid] = s
        e = s + t.duration_s
        end[t.tid] = e
        free_at[res] = e
        head[res] = i + 1
        heapq.heappush(events, (e, t.tid))

    for res in queues:
        try_start(res)
    while events:
        _, tid = heapq.heappop(events)
        done += 1
        res = graph.tasks[tid].resource
        try_start(res)
        for r in waiting.pop(tid, []):
            try_start(r)
    if done != n:
        stuck = [f"{r}@{graph.tasks[q[head[r]]].label}" for r, q in queues.items() if head[r] < len(q)]
        raise DeadlockError(f"task graph deadlocks: {done}/{n} tasks ran; stuck heads: {', '.join(stuck[:8])}")
    return Schedule(start_s=tuple(start), end_s=tuple(end), makespan_s=max(end) if end else 0.0)


@dataclass(frozen=True, slots=True)
class StepTiming:
    """What a prediction reads from a simulated step: the steady period, each plan device's busy time
    and the time per task kind.  `steady_timing` takes it from the event simulation; a family with a
    closed form (`Strategy.step_timing`) computes the same numbers without a task graph."""

    period_s: float
    busy_s: tuple[float, ...]
    """Per plan device: time in compute and optimizer tasks (F, B, W, opt, recompute) of one step."""
    breakdown_s: dict[str, float]
    """Summed task time per kind over one step, every resource."""




@dataclass(frozen=True, slots=True)
class SteadyRun:
    step: Schedule
    """The first step alone (what a timeline shows)."""
    period_s: float
    """Time from the end of one step to the end of the next (`run_steady`)."""


def run_steady(graph: TaskGraph, barrier: bool = False) -> SteadyRun:
    """Two copies of a step's graph, the second after the first on every resource in program order,
    as a real run repeats its step.  Without a barrier between steps a rank starts its next step once
    its own last task is done (a pipeline rank whose optimizer step is long overlaps it with its
    peers' next forward).  What ends a step on a shared resource with nothing after it
    (ZeroRedundancyOptimizer's parameter broadcast) is a collective every rank waits for: the next
    step's tasks start after it.

    The measured step of a real run is the period: from the end of the first step to the end of
    the second.  With `barrier` (every step starts together: an emulated cluster's runs, where rank 0
    times the host-speed probe alone while the other ranks wait, `hetsim.profiling.hostspeed.RunProbe`)
    it is one step's makespan instead.  Measured (resnet18@64, hybrid 2x1 GPipe m=2, 26 and 6
    samples on ranks x1 and x0.5): the ranks' steps took 0.48-0.49 and 0.54 s; one step alone
    simulates them ending at 0.46 and 0.51 s, the period without a barrier 0.47 s."""
    if barrier:
        one = run_graph(graph)
        return SteadyRun(step=one, period_s=one.makespan_s)
    n = len(graph.tasks)
    used = {d for t in graph.tasks for d in t.deps}
    shared_sinks = [t.tid for t in graph.tasks if t.tid not in used and not Resource.is_device(t.resource)]
    twice = TaskGraph(tasks=list(graph.tasks))
    first_on: set[str] = set()
    for t in graph.tasks:
        deps = [d + n for d in t.deps]
        if t.resource not in first_on:
            first_on.add(t.resource)
            deps += shared_sinks
        twice.add(t.resource, t.kind, t.duration_s, deps, label=t.label)
    both = run_graph(twice)
    first = Schedule(start_s=both.start_s[:n], end_s=both.end_s[:n], makespan_s=max(both.end_s[:n], default=0.0))
    second_end = max(both.end_s[n:], default=0.0)
    return SteadyRun(step=first, period_s=max(0.0, second_end - first.makespan_s))
