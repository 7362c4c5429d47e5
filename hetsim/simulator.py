"""A discrete-event simulation of a task graph: per-resource program order plus dependencies.

A strategy turns a plan into a `TaskGraph` whose tasks sit on resources (a
device's compute stream, a communication channel) in program order — for a
pipeline, exactly the per-rank action lists its schedule runs.  `run_graph`
starts each task when its resource is free and its dependencies are done.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from hetsim.errors import HetsimError
from hetsim.types import TimelineEvent


@dataclass(slots=True)
class Task:
    tid: int
    resource: str
    kind: str
    """'F', 'B', 'W' (weight grad), 'opt', 'allreduce', 'send', 'recv', 'offload', ..."""
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
