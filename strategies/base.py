"""The plugin contract of a strategy family, in one file: its plan, its search space, its simulation and its real run.

A family is a `Strategy` subclass registered with `hetsim.strategies.register` (built in) or
through the entry-point group `hetsim.strategies` (third party; see examples/plugin_family).
It has three faces over one frozen `Plan` type:

- search: `space(trial, ctx)` suggests knobs with Optuna under names `self.param(knob)`
  (`"<family>.<knob>"`) and solves the rest exactly; `examples`/`baseline` name known plans;
- simulation: `graph(plan, cost)` is the step as tasks on resources (`Resource`, `TaskKind`),
  `memory(plan, cost)` the peak bytes per device; `predict` (not overridden) combines them into
  a `Predicted` (prediction, schedule, graph); `step_timing` may give the same step time in
  closed form, which `evaluate` (what the search calls per trial) then uses;
- real run: `executor(plan, ctx)` builds an `Executor` on each torchrun rank.

Shared rules (batch splits, search choices, autocast, checkpointing) are in `hetsim.strategies.helpers`;
the suite every family must pass is `hetsim.testing` (`python -m pytest --pyargs hetsim.testing`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

from hetsim.errors import InfeasiblePlanError
from hetsim.model.simulator import (
    Resource,
    Schedule,
    SteadyRun,
    StepTiming,
    TaskGraph,
    TaskKind,
    run_steady,
)
from hetsim.types import MemoryBreakdown, Prediction

if TYPE_CHECKING:  # torch and optuna stay out of the simulation path
    import optuna
    import torch

    from hetsim.model.costmodel import CostModel
    from hetsim.workloads.builtin import Workload

__all__ = [
    "Executor",
    "MeasuresOwnMemory",
    "MemoryBreakdown",
    "Plan",
    "Predicted",
    "Prediction",
    "Resource",
    "Schedule",
    "SearchContext",
    "Strategy",
    "TaskGraph",
    "TaskKind",
    "TracksMemory",
    "WorkerContext",
    "param",
]

MIB = 2**20


def param(family: str, knob: str) -> str:
    """The Optuna parameter name of `knob` in `family`'s search space: `"ddp.accum_steps"`.
    Each family owns its names, so two families never share (and so never steer) one distribution."""
    return f"{family}.{knob}" if family else knob


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
        """Samples per optimizer step over all devices (every family's plan defines it)."""
        raise NotImplementedError


@dataclass
class SearchContext:
    """What a strategy's search space may look at."""

    cost: CostModel
    """The calibrated cost model of the cluster (its devices, the workload's blocks and facts)."""
    global_batch: int
    """Samples per optimizer step every plan must train on."""
    precisions: tuple[str, ...] = ("fp32",)
    """Precisions the user allows ('fp32', 'bf16', 'fp16')."""
    checkpointing: bool = True
    """Whether plans may checkpoint activations."""
    min_local_batch: int = 1
    """Fewest samples per device micro-batch the user allows (`--min-local-batch`)."""
    max_accum: int = 4
    """Most gradient-accumulation steps a plan may take."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Family-specific options by name (e.g. 'pipeline_schedules')."""


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


@runtime_checkable
class Executor(Protocol):
    """A family's real run on one rank, built inside an initialised process group.

    Required: `step` and `compute_grads`.  Optional members, read with getattr by the per-rank loop
    (hetsim.execution.worker.run_job):

    - `model` (torch.nn.Module) and `opt` (torch.optim.Optimizer): the module and optimizer whose
      tensors hetsim.execution.memtrack attributes to params / grads / optimizer state / activations
      (`TracksMemory`);
    - `measure_memory(fn) -> MemoryBreakdown`: run `fn` (one training step) and say its peak, for
      executors whose step memtrack's per-module attribution cannot follow (`MeasuresOwnMemory`:
      pipeline schedules, host offload).  When present it is used instead of memtrack.
    """

    def step(self) -> float | None:
        """One full training step (forward, backward, optimizer); returns this rank's loss if it has one."""

    def compute_grads(self) -> dict[str, torch.Tensor]:
        """Forward and backward on the fixed batch, no optimizer step: full gradients of the
        parameters this rank holds, by name in the unwrapped model."""


@runtime_checkable
class TracksMemory(Protocol):
    """Optional executor members that let the per-rank loop attribute a step's memory."""

    model: Any
    """The torch.nn.Module this rank trains (wrapped or not)."""
    opt: Any
    """The torch.optim.Optimizer that holds this rank's optimizer state."""


@runtime_checkable
class MeasuresOwnMemory(Protocol):
    """Optional executor member: the executor measures the peak memory of one step itself."""

    def measure_memory(self, fn: Callable[[], None]) -> MemoryBreakdown:
        """Run `fn` (one training step) and return its peak memory by category."""


class Predicted(NamedTuple):
    """What `Strategy.predict` returns; a tuple, so `pred, sched, graph = ...` still unpacks."""

    prediction: Prediction
    schedule: Schedule
    """The first simulated step (what a timeline shows)."""
    graph: TaskGraph


class Strategy(ABC):
    """A strategy family.  Subclasses set `name`, `plan_type`, `display_name` and implement the
    abstract methods; `predict`, `validate`, `buildable` and `own_plans` are shared machinery."""

    name: ClassVar[str]
    """Registry name, also the `strategy` field of its plans and the prefix of its search parameters."""
    plan_type: ClassVar[type[Plan]]
    """The frozen Plan subclass this family builds (plans round-trip through JSON as this type)."""
    display_name: ClassVar[str] = ""
    """A short human description for reports."""
    contract_workloads: ClassVar[tuple[str, ...]] = ("gn_resnet@32", "gpt@tiny@16", "simclr@32", "clip@32")
    """Workload specs (hetsim.workloads.workload_from_spec) this family claims to train exactly:
    hetsim.testing checks its real-run gradient on each of them."""

    # ------------------------------------------------------------------ search

    param_prefix: ClassVar[str | None] = None
    """Prefix of this family's Optuna parameter names; None: the family's `name`.  The built-in
    families set "" (bare names) until results/golden is re-recorded: the names steer TPE (knobs
    that two families share pool their observations), so prefixing them changes which plans the
    golden searches find."""

    def param(self, knob: str) -> str:
        """The Optuna parameter name of `knob` in this family's space: `"<name>.<knob>"`."""
        return param(self.name if self.param_prefix is None else self.param_prefix, knob)

    @abstractmethod
    def space(self, trial: optuna.Trial, ctx: SearchContext) -> Plan:
        """Suggest the outer knobs with `trial` (names from `self.param`), solve the inner ones
        exactly, return a plan.  Raise InfeasiblePlanError when no valid plan exists for these choices."""

    def unavailable(self, ctx: SearchContext) -> str | None:
        """Why this family has no plan at all on ctx's cluster (the search then skips it), or None."""
        return None

    @abstractmethod
    def examples(self, ctx: SearchContext) -> list[Plan]:
        """A few representative valid plans on ctx's cluster (the contract suite runs them); fewer,
        or none, on a cluster where they cannot be built (never an exception: see `buildable`)."""

    def baseline(self, ctx: SearchContext) -> Plan | None:
        """The plan a user would run by default with this family (None: no baseline)."""
        return None

    def own_plans(self, ctx: SearchContext) -> list[Plan]:
        """The family's own plans: its baseline (when it has one), then its `examples`."""
        base = self.baseline(ctx)
        return ([] if base is None else [base]) + list(self.examples(ctx))

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

    # ------------------------------------------------------------------ real run

    @abstractmethod
    def executor(self, plan: Plan, ctx: WorkerContext) -> Executor:
        """Build the real run for this rank (inside an initialised process group): PyTorch's own
        machinery (DDP, FSDP2, torch.distributed.pipelining, ...), never a re-implementation."""

    # ------------------------------------------------------------------ simulation

    @abstractmethod
    def graph(self, plan: Plan, cost: CostModel) -> TaskGraph:
        """The plan's step as tasks on per-device resources (`Resource.device(d)`, links, `Resource.COMM`),
        in program order, with `TaskKind` kinds."""

    @abstractmethod
    def memory(self, plan: Plan, cost: CostModel) -> tuple[MemoryBreakdown, ...]:
        """Peak bytes per plan device, in plan order."""

    def counterparts(self, plan: Plan, cost: CostModel) -> list[Plan]:
        """Plans the search should also run when it runs `plan`, to show what its choices bought
        (tp: the even-shard plan of the same devices beside an uneven one).  Default: none."""
        return []

    def label(self, plan: Plan) -> str:
        """A one-line human label of the plan (reports, progress lines)."""
        return f"{self.name} on {list(plan.devices)}"

    def validate(self, plan: Plan, cost: CostModel) -> None:
        """Raise InfeasiblePlanError with the value, the limit and what to do.  Overrides call super()."""
        n = cost.n_devices
        devs = plan.devices
        bad = [d for d in devs if not 0 <= d < n] if not devs or min(devs) < 0 or max(devs) >= n else []
        if bad or not devs:
            raise InfeasiblePlanError(f"plan uses device(s) {bad or '[]'}; the cluster has devices 0..{n - 1}")
        if len(set(devs)) != len(devs):
            raise InfeasiblePlanError(f"plan lists a device twice: {list(devs)}")
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
            timing = self._timing_of(plan, cost, g, run_steady(g, cost.step_barrier))
        return self._prediction(plan, cost, timing)

    def predict(self, plan: Plan, cost: CostModel) -> Predicted:
        """The prediction from the event simulation (the reference: two steps back to back, memory
        against every device's capacity), with the first step's schedule and task graph."""
        self.validate(plan, cost)
        g = self.graph(plan, cost)
        steady = run_steady(g, cost.step_barrier)
        return Predicted(self._prediction(plan, cost, self._timing_of(plan, cost, g, steady)), steady.step, g)

    def _timing_of(self, plan: Plan, cost: CostModel, g: TaskGraph, steady: SteadyRun) -> StepTiming:
        sched = steady.step
        by_res = sched.busy_by_resource(g, TaskKind.COMPUTE)
        busy = tuple(by_res.get(Resource.device(d), 0.0) for d in plan.devices)
        return StepTiming(period_s=steady.period_s, busy_s=busy, breakdown_s=self.breakdown(plan, cost, g, sched))

    def _prediction(self, plan: Plan, cost: CostModel, timing: StepTiming) -> Prediction:
        mem = self.memory(plan, cost)
        caps = cost.memo(("capacity_bytes", plan.devices), lambda: tuple(cost.device(d).memory_bytes for d in plan.devices))
        peaks = tuple([m.total_bytes for m in mem])
        violations = memory_violations(plan, cost, mem, caps, peaks)
        step = timing.period_s
        busy = timing.busy_s
        bubble = 1.0 - (sum(busy) / (len(busy) * step)) if step > 0 and busy else 0.0
        return Prediction(
            step_time_s=step,
            samples_per_s=plan.global_batch / step if step > 0 else 0.0,
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
        """Seconds of the simulated step by task kind (summed over resources)."""
        out: dict[str, float] = {}
        for t in g.tasks:
            out[t.kind] = out.get(t.kind, 0.0) + (sched.end_s[t.tid] - sched.start_s[t.tid])
        return out


def memory_violations(plan: Plan, cost: CostModel, mem: tuple[MemoryBreakdown, ...],
                      caps: tuple[int, ...], peaks: tuple[int, ...] | None = None) -> list[str]:
    """Why the plan does not fit: each device over its capacity (by category), then host memory.
    `peaks`: each device's total bytes, when the caller has them."""
    out = []
    if peaks is None:
        peaks = tuple([m.total_bytes for m in mem])
    for i, (m, need, cap) in enumerate(zip(mem, peaks, caps)):
        if need > cap:
            d = cost.device(plan.devices[i])
            out.append(
                f"device {plan.devices[i]} ({d.name}) needs {need / MIB:.0f} MiB "
                f"(params {m.params_bytes / MIB:.0f}, grads {m.grads_bytes / MIB:.0f}, "
                f"optimizer {m.optim_bytes / MIB:.0f}, activations {m.activations_bytes / MIB:.0f}, "
                f"other {m.other_bytes / MIB:.0f}) > capacity {cap / MIB:.0f} MiB, "
                f"{(need - cap) / MIB:.0f} MiB over"
            )
    host_need = sum(m.host_bytes for m in mem)
    host_cap = cost.cluster.host_memory_bytes
    if host_need and host_cap and host_need > host_cap:
        out.append(f"host memory: offload needs {host_need / 2**30:.1f} GiB > {host_cap / 2**30:.1f} GiB of RAM")
    return out
