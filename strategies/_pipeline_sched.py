"""Pipeline schedules as data, shared by the `pipeline` and `hybrid` families.

A schedule is, per pipeline rank, an ordered list of `Action(stage, kind, microbatch)`
(printed `2F0`, parsed back by `Action.parse`).  The same lists are timed by the
simulator (`add_pipeline`), drive the memory estimate (`peak_inflight`, `_pipeline_memory`) and are what
the torch schedule class runs on each rank:

- GPipe and 1F1B (one stage per rank) are generated here, in the order that
  torch's `ScheduleGPipe` / `Schedule1F1B` `_step_microbatches` execute (torch's own
  `pipeline_order` for these classes is descriptive only and is off by one for 1F1B);
- multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
  ZBVZeroBubble) are read from the torch class's own `pipeline_order`, built with
  stand-in stages (no process group), so the simulated order is the executed order.

Only that last step imports torch, lazily and cached.  The stage-boundary solver is
`hetsim.strategies._pipeline_bounds`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from hetsim.errors import InfeasiblePlanError, UnknownNameError
from hetsim.model.simulator import Resource, TaskGraph, TaskKind

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel

SINGLE_STAGE = ("GPipe", "1F1B")
"""One stage per rank: stage s on rank s."""
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""v >= 2 stages per rank in loop placement: stage s on rank s % P."""
V_SHAPED = ("ZBVZeroBubble",)
"""Exactly 2 stages per rank in V placement: stage s on rank s (s < P) or 2P - 1 - s."""
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules that split backward into input-gradient (I) and weight-gradient (W) actions.
torch refuses them when a stage's output is a view (e.g. a stage ending in nn.Flatten)."""

INPUT_GRAD_FRACTION = 0.5
"""Share of a block's backward time spent on the input gradient (the rest on weight gradients)
when a zero-bubble schedule splits them: for convolutions and matmuls both are one product
of the forward's size."""


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: str
    """'F' forward, 'B' full backward, 'I' input-gradient backward, 'W' weight-gradient backward."""
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @staticmethod
    def parse(text: str) -> Action:
        m = _ACTION_RE.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"{text!r} is not a pipeline action; write STAGE KIND MICROBATCH, e.g. 2F0 or 1W3")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)))


_ACTION_RE = re.compile(r"(\d+)([FBIW])(\d+)")


def check_schedule(name: str) -> None:
    if name not in SCHEDULES:
        raise UnknownNameError("pipeline schedule", name, SCHEDULES)


def stages_per_rank_ok(schedule: str, v: int) -> bool:
    if schedule in SINGLE_STAGE:
        return v == 1
    if schedule in V_SHAPED:
        return v == 2
    return v >= 2


def stage_rank(schedule: str, n_ranks: int, stage: int) -> int:
    """The pipeline rank that runs `stage` (torch's placement for each schedule)."""
    if schedule in V_SHAPED:
        return stage if stage < n_ranks else 2 * n_ranks - 1 - stage
    return stage % n_ranks


def rank_stages(schedule: str, n_ranks: int, v: int, rank: int) -> tuple[int, ...]:
    """Stages held by `rank`, in the order torch's multi-stage schedules expect them."""
    return tuple(s for s in range(n_ranks * v) if stage_rank(schedule, n_ranks, s) == rank)


def stage_devices(schedule: str, devices: Sequence[int], n_stages: int) -> tuple[int, ...]:
    """The device of each stage when `devices` are a pipeline's ranks in order."""
    return tuple(devices[stage_rank(schedule, len(devices), s)] for s in range(n_stages))


MULTI_TERM_RUN = {"Interleaved1F1B": "Interleaved1F1B", "LoopedBFS": "Interleaved1F1B",
                  "InterleavedZeroBubble": "InterleavedZeroBubble", "ZBVZeroBubble": "ZBVZeroBubble"}
"""The multi-stage schedules and the schedule whose real calibration run gives each its per-action term
(`hetsim.search.calib_modelparallel.calibration_multi_stage_plans`)."""


def action_term(cost: CostModel, schedule: str, micro: float, chunks: int, precision: str = "fp32") -> float:
    """The calibrated per-action term (`CostModel.pipeline_action_s`) of a `schedule` pipeline at
    micro-batch `micro` (one-stage schedules) or with `chunks` = micro-batches x stages per rank
    (multi-stage schedules).

    One-stage-per-rank schedules (GPipe, 1F1B) carry the term fitted on GPipe and 1F1B runs: torch waits
    on their sends and receives at every action (1F1B fuses each send with the next receive and waits
    for both; GPipe waits for all forward sends before its first backward).  The multi-stage schedules
    run through torch's `_PipelineScheduleRuntime`, which posts receives ahead, waits on a receive only
    before the action that needs it and on its sends only at the end of the step, so that term does not
    carry over to them (fidelity bench of 2026-12-03 10:11, resnet18@64, replayed from both recordings:
    Interleaved1F1B m=2 +8.6 / +8.9 % and ZBVZeroBubble m=2 +13.5 / +13.3 % with it, +0.2 / +1.3 % and
    +1.0 / +2.0 % without).

    Each multi-stage schedule carries a term of its own, from a real run of its schedule
    (`MULTI_TERM_RUN`, `ModelProfile.pipe_action_multi_s`; 0 in recordings made before it), as they
    differ: without any, fresh main jobs (resnet50@64) read Interleaved1F1B -8.0 %, InterleavedZeroBubble
    v=2 -7.1 % and v=4 -12.9 %, ZBV -0.3 to -3.7 %, and vit's Interleaved1F1B -18.3 %; with Interleaved1F1B's
    term, InterleavedZeroBubble v=2 read +12.4 %; and bert's ZBV read -14.7 % without a term.

    A multi-stage term is read by `chunks`, not by micro-batch size: its calibration runs two shapes of
    each schedule (`hetsim.search.calib_modelparallel.calibration_multi_stage_plans`), and what they miss
    grows with the actions a rank runs.  gpt@tiny@64 on the default cluster, 2026-12-03, two interleaved
    runs of each plan, measured minus simulated without a term, per critical action:
    InterleavedZeroBubble -1.0 ms at 2 stages x 2 micro-batches, -0.1 at 2 x 4, +0.3 at 2 x 8, -0.1 at
    3 x 2 and +0.9 at 3 x 8 (that plan measured 0.235 s where one term from 2 x 2 said 0.169)."""
    if schedule in SINGLE_STAGE:
        return cost.pipeline_action_s(micro, precision=precision)
    run = MULTI_TERM_RUN.get(schedule)
    return cost.pipeline_action_s(chunks, schedule=run, precision=precision) if run else 0.0


# ----------------------------------------------------------------------------- action lists


@lru_cache(maxsize=4096)
def _single_stage_actions(schedule: str, n_ranks: int, m: int) -> tuple[tuple[Action, ...], ...]:
    out = []
    for s in range(n_ranks):
        if schedule == "GPipe":
            acts = [Action(s, "F", j) for j in range(m)] + [Action(s, "B", j) for j in range(m)]
        else:  # 1F1B: stage s runs min(m, P - s) forwards, then alternates one backward, one forward.
            warm = min(m, n_ranks - s)
            acts = [Action(s, "F", j) for j in range(warm)]
            f = warm
            for b in range(m):
                acts.append(Action(s, "B", b))
                if f < m:
                    acts.append(Action(s, "F", f))
                    f += 1
        out.append(tuple(acts))
    return tuple(out)


@lru_cache(maxsize=4096)
def _torch_actions(schedule: str, n_ranks: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """Read torch's own `pipeline_order` for a multi-stage schedule (stand-in stages, no group)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as torch_schedules

    cls = torch_schedules.get_schedule_class(schedule)
    stages = [SimpleNamespace(group_rank=0, group_size=n_ranks, num_stages=n_ranks * v, submod=None)
              for _ in range(v)]
    try:
        sched = cls(stages, m)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise InfeasiblePlanError(
            f"torch's {schedule} refuses {m} micro-batch(es) on {n_ranks} ranks x {v} stages: {e}"
        ) from None
    out = []
    for r in range(n_ranks):
        acts = []
        for a in sched.pipeline_order[r]:
            if a is None:
                continue
            text = str(a)
            if _ACTION_RE.fullmatch(text):
                acts.append(Action.parse(text))
            elif a.is_compute_op:  # e.g. an overlapped F+B pair: not a schedule this module offers
                raise InfeasiblePlanError(f"{schedule}: action {text} is not supported by the simulator")
        out.append(tuple(acts))
    return tuple(out)


def rank_actions(schedule: str, n_ranks: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, the compute actions in the order the rank runs them."""
    check_actions(schedule, n_ranks, m, v)
    if schedule in SINGLE_STAGE:
        return _single_stage_actions(schedule, n_ranks, m)
    return _torch_actions(schedule, n_ranks, m, v)


def check_actions(schedule: str, n_ranks: int, m: int, v: int) -> None:
    """InfeasiblePlanError unless `rank_actions` can list the schedule's actions (without listing
    GPipe's or 1F1B's, which a search asks about for every micro-batch count it may draw)."""
    check_schedule(schedule)
    if not stages_per_rank_ok(schedule, v):
        need = "1" if schedule in SINGLE_STAGE else ("2" if schedule in V_SHAPED else ">= 2")
        raise InfeasiblePlanError(f"schedule {schedule} needs {need} stage(s) per rank, the plan has {v}")
    if m < 1:
        raise InfeasiblePlanError(f"a pipeline needs at least 1 micro-batch, got {m}")
    if schedule == "1F1B" and m < n_ranks:
        raise InfeasiblePlanError(
            f"1F1B needs micro-batches ({m}) >= stages ({n_ranks}); use GPipe for fewer micro-batches "
            "(one micro-batch is plain model parallelism)"
        )
    if schedule not in SINGLE_STAGE:
        _torch_actions(schedule, n_ranks, m, v)  # torch's own checks (cached)


def peak_inflight(actions: Sequence[Action], stage_act_bytes: dict[int, float]) -> float:
    """Peak activation bytes a rank holds while running `actions`.

    A micro-batch's activations live from its forward to its full backward, or to its
    weight-gradient action when backward is split (the weight gradient needs the saved inputs).
    """
    split = any(a.kind == "W" for a in actions)
    held = peak = 0.0
    for a in actions:
        if a.kind == "F":
            held += stage_act_bytes[a.stage]
            peak = max(peak, held)
        elif a.kind == ("W" if split else "B"):
            held -= stage_act_bytes[a.stage]
    return peak


def inflight_counts(actions_by_rank: Sequence[Sequence[Action]], n_stages: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once."""
    out = [0] * n_stages
    for acts in actions_by_rank:
        for s in {a.stage for a in acts}:
            out[s] = int(round(peak_inflight([a for a in acts if a.stage == s], {s: 1.0})))
    return tuple(out)


# ----------------------------------------------------------------------------- simulation


@dataclass(frozen=True, slots=True)
class PipelineTasks:
    last_grad: dict[int, int]
    """Per stage, the task that finishes its gradients (last B or W)."""
    last: tuple[int, ...]
    """Per pipeline rank, its last compute task."""


def add_pipeline(g: TaskGraph, cost: CostModel, devices: Sequence[int], boundaries: Sequence[int], schedule: str,
                 m: int, micro: int, precision: str, ckpt: int, tag: str = "", alone: bool = False) -> PipelineTasks:
    """Add one pipeline's step (no optimizer) to `g`: the per-rank action lists as compute tasks on
    f"dev{d}", activation and gradient transfers as tasks on directed link resources.  `alone`: the
    whole plan is this one rank, which has no peer to send to, receive from or wait on, and carries no
    calibrated per-action term (that term is measured on pipelines across the cluster: a one-device
    GPipe m=2 of a 4-layer encoder, 2026-12-06, was predicted 29.2 % slow with it, 1.3 % without)."""
    n_ranks = len(devices)
    n_stages = len(boundaries) - 1
    v = n_stages // n_ranks
    acts = rank_actions(schedule, n_ranks, m, v)
    dev_of = [devices[stage_rank(schedule, n_ranks, s)] for s in range(n_stages)]
    extra = 0.0 if alone else action_term(cost, schedule, micro, m * v, precision)  # calib_modelparallel
    specs = _TaskSpecs(cost, boundaries, dev_of, micro, precision, ckpt, tag, extra)
    # Pass 1: every task as a spec with symbolic dependencies; ids are known before adding.
    for r, rank_acts in enumerate(acts):
        for a in rank_acts:
            specs.action(devices[r], a)

    # Pass 2: add them with resolved ids.
    key_of = specs.key_of
    base = len(g.tasks)
    for res, kind, dur, deps, label in specs.specs:
        g.add(res, kind, dur, [base + key_of[k] for k in deps], label=label)
    last_grad = {}
    for s in range(n_stages):
        # All of a stage's tasks sit on one rank in program order: the highest id finishes last.
        last_grad[s] = base + max(i for k, i in key_of.items() if k[0] in ("I", "W") and k[1] == s)
    last = tuple(base + max(key_of[_compute_key(a)] for a in rank_acts) for rank_acts in acts)
    return PipelineTasks(last_grad=last_grad, last=last)


class _TaskSpecs:
    """Pass 1 of `add_pipeline`: each action's compute task and outgoing transfer as a spec keyed
    (kind, stage, micro-batch), kinds 'F', 'I' (input gradient or full backward), 'W', 'xf'
    (activation sent on), 'xb' (gradient sent back); dependencies are keys."""

    def __init__(self, cost: CostModel, boundaries: Sequence[int], dev_of: Sequence[int], micro: int,
                 precision: str, ckpt: int, tag: str, extra: float):
        self.cost, self.boundaries, self.dev_of = cost, boundaries, dev_of
        self.micro, self.precision, self.ckpt, self.tag = micro, precision, ckpt, tag
        self.n_stages = len(boundaries) - 1
        self.extra = extra  # added to every compute action
        self.specs: list[tuple[str, str, float, tuple, str]] = []
        self.key_of: dict[tuple, int] = {}

    def _spec(self, key, res, kind, dur, deps, label) -> None:
        self.key_of[key] = len(self.specs)
        self.specs.append((res, kind, dur, deps, label))

    def _act_ready(self, s, j):  # the forward input of stage s for micro-batch j is there
        return ("xf", s - 1, j) if self.dev_of[s - 1] != self.dev_of[s] else ("F", s - 1, j)

    def _grad_ready(self, s, j):  # the output gradient of stage s for micro-batch j is there
        return ("xb", s + 1, j) if self.dev_of[s + 1] != self.dev_of[s] else ("I", s + 1, j)

    def action(self, d: int, a: Action) -> None:
        """The specs of action `a` on device d."""
        cost, micro, precision, dev_of, tag = self.cost, self.micro, self.precision, self.dev_of, self.tag
        res = Resource.device(d)
        s, j = a.stage, a.mb
        lo, hi = self.boundaries[s], self.boundaries[s + 1]
        lbl = f"{tag}{a}"
        if a.kind == "F":
            dur = max(0.0, cost.fwd_s(d, lo, hi, micro, precision) + cost.stage_overhead_s(d, lo, hi, micro, precision)
                      + self.extra)
            self._spec(("F", s, j), res, TaskKind.FORWARD, dur, (self._act_ready(s, j),) if s > 0 else (), lbl)
            if s + 1 < self.n_stages and dev_of[s + 1] != d:
                nbytes = cost.blocks()[hi - 1].boundary_bytes_per_sample(precision) * micro
                self._spec(("xf", s, j), Resource.link(d, dev_of[s + 1]), TaskKind.P2P,
                           cost.p2p_s(nbytes, d, dev_of[s + 1]), (("F", s, j),), f"{tag}act {s}->{s + 1} mb{j}")
        elif a.kind in ("B", "I"):
            bwd = cost.bwd_s(d, lo, hi, micro, precision)
            share = 1.0 if a.kind == "B" else INPUT_GRAD_FRACTION
            dur = max(0.0, share * bwd + cost.recompute_s(d, lo, hi, micro, precision, self.ckpt) + self.extra)
            deps = (("F", s, j),) + ((self._grad_ready(s, j),) if s + 1 < self.n_stages else ())
            self._spec(("I", s, j), res, TaskKind.BACKWARD, dur, deps, lbl)
            if s > 0 and dev_of[s - 1] != d:
                nbytes = cost.blocks()[lo - 1].boundary_bytes_per_sample(precision) * micro
                self._spec(("xb", s, j), Resource.link(d, dev_of[s - 1]), TaskKind.P2P,
                           cost.p2p_s(nbytes, d, dev_of[s - 1]), (("I", s, j),), f"{tag}grad {s}->{s - 1} mb{j}")
        else:  # W
            dur = max(0.0, (1.0 - INPUT_GRAD_FRACTION) * cost.bwd_s(d, lo, hi, micro, precision) + self.extra)
            self._spec(("W", s, j), res, TaskKind.WEIGHT_GRAD, dur, (("I", s, j),), lbl)


def _compute_key(a: Action) -> tuple:
    return ({"F": "F", "B": "I", "I": "I", "W": "W"}[a.kind], a.stage, a.mb)


def replica_allreduce_s(cost: CostModel, nbytes: float, group: tuple[int, ...]) -> float:
    """The all-reduce of `nbytes` of gradients across the replicas of a pipeline: the collective's
    model plus the data-parallel synchronisation term calibrated on a real uniform step
    (`CostModel.sync_residual_s`), in proportion to the share of the model's gradients it sums.
    Measured (resnet18@64, hybrid 2x1 on the default cluster, the rank that finishes its schedule
    last): the all-reduces of 46.8 MB took 0.09-0.12 s in the step where the collective model reads
    0.035 s, and that recording's data-parallel term was 0.066 s."""
    total = cost.memo(("grad_bytes",), cost.grad_bytes)
    share = nbytes / total if total > 0 else 1.0
    return cost.allreduce_s(nbytes, group) + cost.sync_residual_s(group) * share


def replicas_graph(cost: CostModel, replica_devices: Sequence[Sequence[int]], boundaries: Sequence[int],
                   schedule: str, m: int, micros: Sequence[int], precision: str, ckpt: int,
                   all_replicas: Sequence[Sequence[int]] | None = None) -> TaskGraph:
    """The step of data-parallel replicas of one pipeline (one replica: a plain pipeline), replica i
    on `replica_devices[i]` with micro-batches of `micros[i]`: each replica's actions (`add_pipeline`),
    then on each pipeline rank the all-reduce of its stages' gradients across the replicas (none for
    one replica) and every replica's optimizer step.

    `all_replicas`, when given, are the devices of every replica of the plan, of which
    `replica_devices` are representatives (one per class of replicas that step alike): the
    all-reduces are timed over the whole groups, and the graph holds only the representatives."""
    g = TaskGraph()
    R, P = len(replica_devices), len(replica_devices[0])
    everyone = replica_devices if all_replicas is None else all_replicas
    v = (len(boundaries) - 1) // max(1, P)
    tasks = [add_pipeline(g, cost, replica_devices[i], boundaries, schedule, m, micros[i], precision, ckpt,
                          tag=f"r{i}:" if R > 1 else "", alone=len(everyone) == 1 and P == 1)
             for i in range(R)]
    for r in range(P):
        # Each rank all-reduces its stages' gradients (one flat tensor) after its last action.
        group = tuple(devs[r] for devs in everyone)
        mine = rank_stages(schedule, P, v, r)
        count = sum(cost.trainable_count(boundaries[s], boundaries[s + 1]) for s in mine)
        reduced = []
        if len(everyone) > 1:
            nbytes = sum(cost.grad_bytes(boundaries[s], boundaries[s + 1]) for s in mine)
            reduced.append(g.add(Resource.group(r), TaskKind.ALLREDUCE, replica_allreduce_s(cost, nbytes, group),
                                 [tasks[i].last[r] for i in range(R)],
                                 label=f"allreduce stages {','.join(map(str, mine))}"))
        for i in range(R):
            d = replica_devices[i][r]
            g.add(Resource.device(d), TaskKind.OPTIMIZER, cost.opt_s(d, count), [tasks[i].last[r], *reduced], label="opt")
    return g


def divisors(n: int, cap: int = 64) -> list[int]:
    return [k for k in range(1, min(n, cap) + 1) if n % k == 0]


def available_schedules() -> tuple[str, ...]:
    """Schedules the installed torch provides (DualPipeV and friends are not offered)."""
    try:
        from torch.distributed.pipelining import schedules as torch_schedules
    except ImportError:  # pragma: no cover - torch without distributed
        return SINGLE_STAGE
    out = []
    for name in SCHEDULES:
        try:
            torch_schedules.get_schedule_class(name)
        except ValueError:
            continue
        out.append(name)
    return tuple(out)
