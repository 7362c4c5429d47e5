"""What a strategy is: a family of plans with three faces (search space, simulation, real run)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from hetsim.errors import InfeasiblePlanError
from hetsim.model.simulator import (
    BUSY_KINDS,
    Schedule,
    SteadyRun,
    StepTiming,
    TaskGraph,
    run_steady,
)
from hetsim.types import MemoryBreakdown, Prediction

if TYPE_CHECKING:  # torch and optuna stay out of the simulation path
    import optuna
    import torch

    from hetsim.model.costmodel import CostModel
    from hetsim.workloads.builtin import Workload

PRECISIONS = ("fp32", "bf16", "fp16")
BN_MIN_MICRO_BATCH = 8
"""BatchNorm's batch statistics get noisy below about 8 samples per device and hurt accuracy
(the Group Normalization paper, Wu and He 2018, measured it); hetsim warns there, it does not refuse."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Base of every plan: the knobs every family accepts."""

    strategy: str
    devices: tuple[int, ...]
    """Cluster device indices, in rank order (rank r runs on devices[r])."""
    precision: str = "fp32"
    """'fp32', 'bf16' or 'fp16' (autocast; fp16 with loss scaling, CUDA only)."""
    checkpoint_blocks: int = 0
    """Activation checkpointing on the first k blocks of the model (0: none)."""

    @property
    def global_batch(self) -> int:
        raise NotImplementedError


@dataclass
class SearchContext:
    """What a strategy's search space may look at."""

    cost: CostModel
    global_batch: int
    precisions: tuple[str, ...] = ("fp32",)
    checkpointing: bool = True
    min_local_batch: int = 1
    max_accum: int = 4
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkerContext:
    """What a strategy's real run gets on one rank."""

    rank: int
    world_size: int
    device: torch.device
    workload: Workload
    global_batch: int
    seed: int = 0
    emulator: Any = None
    """hetsim.execution.emulation.Emulator: throttles compute, accounts memory (None on real GPUs)."""
    backend: str = "gloo"


class Executor(Protocol):
    def step(self) -> float | None:
        """One full training step (forward, backward, optimizer); returns this rank's loss if it has one."""

    def compute_grads(self) -> dict[str, torch.Tensor]:
        """Forward and backward on the fixed batch, no optimizer step: full gradients of the
        parameters this rank holds, by name in the unwrapped model."""


class Strategy(ABC):
    name: ClassVar[str]
    plan_type: ClassVar[type[Plan]]
    display_name: ClassVar[str] = ""

    @abstractmethod
    def space(self, trial: optuna.Trial, ctx: SearchContext) -> Plan:
        """Suggest the outer knobs with `trial`, solve the inner ones exactly, return a plan.
        Raise InfeasiblePlanError when no valid plan exists for these choices."""

    def unavailable(self, ctx: SearchContext) -> str | None:
        """Why this family has no plan at all on ctx's cluster (the search then skips it), or None."""
        return None

    @abstractmethod
    def graph(self, plan: Plan, cost: CostModel) -> TaskGraph:
        """The plan's step as tasks on per-device resources, in program order."""

    @abstractmethod
    def memory(self, plan: Plan, cost: CostModel) -> tuple[MemoryBreakdown, ...]:
        """Peak bytes per plan device."""

    @abstractmethod
    def executor(self, plan: Plan, ctx: WorkerContext) -> Executor:
        """Build the real run for this rank (inside an initialised process group)."""

    def label(self, plan: Plan) -> str:
        return f"{self.name} on {list(plan.devices)}"

    def validate(self, plan: Plan, cost: CostModel) -> None:
        """Raise InfeasiblePlanError with the value, the limit and what to do."""
        n = cost.n_devices
        devs = plan.devices
        bad = [d for d in devs if not 0 <= d < n] if not devs or min(devs) < 0 or max(devs) >= n else []
        if bad or not devs:
            raise InfeasiblePlanError(f"plan uses device(s) {bad or '[]'}; the cluster has devices 0..{n - 1}")
        if len(set(plan.devices)) != len(plan.devices):
            raise InfeasiblePlanError(f"plan lists a device twice: {list(plan.devices)}")
        precision = getattr(plan, "precision", "fp32")
        problem = cost.memo(("precision_problem", devs, precision), lambda: cost.precision_problem(devs, precision))
        if problem:
            raise InfeasiblePlanError(problem)

    def step_timing(self, plan: Plan, cost: CostModel) -> StepTiming | None:
        """The plan's step timing in closed form, equal to what `predict`'s event simulation gives
        (relative 1e-9); None where only the event simulation can tell (the default)."""
        return None

    def evaluate(self, plan: Plan, cost: CostModel) -> Prediction:
        """The plan's prediction, as `predict` gives it, by the closed form where the family has one:
        what the search calls per trial (no task graph, no schedule to show)."""
        self.validate(plan, cost)
        timing = self.step_timing(plan, cost)
        if timing is None:
            g = self.graph(plan, cost)
            steady = run_steady(g)
            timing = self._timing_of(plan, cost, g, steady)
        return self._prediction(plan, cost, timing)

    def predict(self, plan: Plan, cost: CostModel) -> tuple[Prediction, Schedule, TaskGraph]:
        """The plan's prediction from the event simulation (the reference), with the first step's
        schedule and task graph (what a timeline shows)."""
        self.validate(plan, cost)
        g = self.graph(plan, cost)
        steady = run_steady(g)
        return self._prediction(plan, cost, self._timing_of(plan, cost, g, steady)), steady.step, g

    def _timing_of(self, plan: Plan, cost: CostModel, g: TaskGraph, steady: SteadyRun) -> StepTiming:
        sched = steady.step
        busy = tuple(sched.busy_s(g, f"dev{d}", BUSY_KINDS) for d in plan.devices)
        return StepTiming(period_s=steady.period_s, busy_s=busy, breakdown_s=self.breakdown(plan, cost, g, sched))

    def _prediction(self, plan: Plan, cost: CostModel, timing: StepTiming) -> Prediction:
        mem = self.memory(plan, cost)
        caps = cost.memo(("capacity_bytes", plan.devices), lambda: tuple(cost.device(d).memory_bytes for d in plan.devices))
        peaks = tuple([m.total_bytes for m in mem])
        violations = []
        for i, (m, cap) in enumerate(zip(mem, caps)):
            if peaks[i] > cap:
                d = cost.device(plan.devices[i])
                violations.append(
                    f"device {plan.devices[i]} ({d.name}) needs {m.total_bytes / 2**20:.0f} MiB "
                    f"(params {m.params_bytes / 2**20:.0f}, grads {m.grads_bytes / 2**20:.0f}, "
                    f"optimizer {m.optim_bytes / 2**20:.0f}, activations {m.activations_bytes / 2**20:.0f}, "
                    f"other {m.other_bytes / 2**20:.0f}) > capacity {cap / 2**20:.0f} MiB, "
                    f"{(m.total_bytes - cap) / 2**20:.0f} MiB over"
                )
        host_need = sum(m.host_bytes for m in mem)
        host_cap = cost.cluster.host_memory_bytes
        if host_need and host_cap and host_need > host_cap:
            violations.append(f"host memory: offload needs {host_need / 2**30:.1f} GiB > {host_cap / 2**30:.1f} GiB of RAM")
        step = timing.period_s
        gb = plan.global_batch
        busy = timing.busy_s
        bubble = 1.0 - (sum(busy) / (len(busy) * step)) if step > 0 and busy else 0.0
        return Prediction(
            step_time_s=step,
            samples_per_s=gb / step if step > 0 else 0.0,
            peak_mem_bytes=peaks,
            memory=mem,
            capacity_bytes=caps,
            feasible=not violations,
            violations=tuple(violations),
            bubble_fraction=max(0.0, bubble),
            breakdown_s=timing.breakdown_s,
            warnings=self.warnings(plan, cost),
        )

    def warnings(self, plan: Plan, cost: CostModel) -> tuple[str, ...]:
        """Why a feasible plan may still train badly (shown beside its prediction)."""
        return ()

    def breakdown(self, plan: Plan, cost: CostModel, g: TaskGraph, sched: Schedule) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in g.tasks:
            out[t.kind] = out.get(t.kind, 0.0) + (sched.end_s[t.tid] - sched.start_s[t.tid])
        return out

    @abstractmethod
    def examples(self, ctx: SearchContext) -> list[Plan]:
        """A few representative valid plans on ctx's cluster (the contract suite runs them); fewer,
        or none, on a cluster where they cannot be built (never an exception: see `buildable`)."""

    def buildable(self, cost: CostModel, builders: Iterable[Callable[[], Plan | None]]) -> list[Plan]:
        """The plans of `builders` that can be built and pass `validate` on this cluster.

        Examples are best effort: on a tight cluster (small memory caps, fewer blocks than stages,
        a batch smaller than the devices) a solver finds no stage boundaries or a hand-written split
        leaves a device without samples.  That one example is left out instead of failing the
        whole list.  Memory feasibility is not checked: an example that does not fit is still a
        plan whose prediction says so.
        """
        out = []
        for build in builders:
            try:
                plan = build()
                if plan is None:
                    continue
                self.validate(plan, cost)
            except InfeasiblePlanError:
                continue
            out.append(plan)
        return out

    def baseline(self, ctx: SearchContext) -> Plan | None:
        """The plan a user would run by default with this family (None: no baseline)."""
        return None

    def counterparts(self, plan: Plan, cost: CostModel) -> list[Plan]:
        """Plans the search should also run when it runs `plan`, to show what its choices bought
        (tp: the even-shard plan of the same devices beside an uneven one).  Default: none."""
        return []

    def own_plans(self, ctx: SearchContext) -> list[Plan]:
        """The family's own plans: its baseline (when it has one), then its `examples`."""
        base = self.baseline(ctx)
        return ([] if base is None else [base]) + list(self.examples(ctx))


def memo_solve(cost: CostModel, key: tuple, solve: Callable[[], Plan]) -> Plan:
    """`solve()` once per key, its InfeasiblePlanError too: a search meets the same outer choices
    (the same ordered devices, schedule, micro-batches...) many times, and an exact inner solver
    (a pipeline's stage boundaries) is deterministic in them."""
    table = cost.memo_table("solve")
    found = table.get(key)
    if found is None:
        try:
            found = table[key] = solve()
        except InfeasiblePlanError as e:
            found = table[key] = e
    if isinstance(found, InfeasiblePlanError):
        raise InfeasiblePlanError(str(found))
    return found


def batchnorm_warning(cost: CostModel, devices: tuple[int, ...], micro_batches: tuple[int, ...]) -> str | None:
    """A warning when a BatchNorm model gets per-device micro-batches too small for its statistics."""
    if not cost.facts.has_batchnorm:
        return None
    small = [(d, b) for d, b in zip(devices, micro_batches) if b < BN_MIN_MICRO_BATCH]
    if not small:
        return None
    which = ", ".join(f"device {d}: {b}" for d, b in small)
    return (
        f"BatchNorm model with per-device micro-batches below {BN_MIN_MICRO_BATCH} ({which}): each device "
        "normalises with its own small-batch statistics, which can hurt accuracy; raise the global batch or "
        "--min-local-batch, use fewer accumulation steps, or a GroupNorm model"
    )
