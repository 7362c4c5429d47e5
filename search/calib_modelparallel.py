"""Calibration terms of the model-parallel families (`hetsim.search.calibrate` runs them): the
per-action overhead of two real pipelines over the whole cluster and the per-all-reduce overhead of
real tensor-parallel steps, each the residual that makes the simulated step equal the measured one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hetsim.strategies._pipeline_sched import MULTI_TERM_RUN, V_SHAPED, available_schedules
from hetsim.strategies.pipeline import Pipeline

from hetsim.errors import InfeasiblePlanError
from hetsim.hardware.cluster import Cluster
from hetsim.model.costmodel import CostModel
from hetsim.names import CALIB_REPEATS, min_samples_per_micro_batch
from hetsim.profiling.hostspeed import profile_ref
from hetsim.profiling.obtain import Say
from hetsim.profiling.store import (
    ProfileSet,
    group_key,
    model_profile_path,
    multi_stage_key,
    precision_action_key,
    save,
)
from hetsim.types import Fit

from .calib_dataparallel import record
from .realruns import robust_step_s, taken_in_turn


def fit_action_residual(points: list[tuple[float, float, float]]) -> Fit:
    """Per-action residual vs micro-batch from (micro-batch size, actions on the critical path, step
    residual) of real runs: each run's residual spread over its critical actions; then, from two or
    more micro-batch sizes, those values as knots (read by `Fit.residual`: piece by piece between
    them, flat beyond) beside the line through the smallest and largest (a constant from one size).

    Knots rather than one line: the residual is not linear in the micro-batch.  vit@64 on the default
    cluster, 2026-12-03: -2.2 ms per action at 32 samples (model parallelism), +0.2 ms at 8 (1F1B,
    4 micro-batches); the line through them gave 1F1B with 2 micro-batches of 16 -0.6 ms, and that
    plan measured 12 % slower than predicted in two searches (-12.1 and -12.5 %)."""
    by_mb: dict[float, list[float]] = {}
    for mb, n, r in points:
        if n > 0:
            by_mb.setdefault(float(mb), []).append(r / n)
    per = sorted((mb, sum(v) / len(v)) for mb, v in by_mb.items())
    if not per:
        return Fit(intercept=0.0, slope=0.0)
    if len(per) == 1:
        return Fit(intercept=per[0][1], slope=0.0)
    (m1, e1), (m2, e2) = per[0], per[-1]
    b = (e2 - e1) / (m2 - m1)
    return Fit(intercept=e1 - b * m1, slope=b, knots=tuple(per))


def describe_action_residual(fit: Fit, at: str = "micro-batch {:g}") -> str:
    """What `fit_action_residual` gave, for the calibration's log (`at` names where each knot was measured)."""
    if fit.knots:
        return "; ".join(f"{e * 1e3:+.1f} ms at {at.format(x)}" for x, e in fit.knots) + " per compute action"
    return f"{fit.intercept * 1e3:+.1f} ms per compute action"


def preferred_order(cost, **shape):
    """The pipeline of this shape (`Pipeline.solve`'s keywords) over every device, in order or in reverse,
    whichever simulates faster: the one the search would pick, so that each calibration run measures
    the order the search's plans take.  What a term misses depends on the order: bert@tiny@64,
    2026-12-03, interleaved runs after the loss was throttled, InterleavedZeroBubble 2 x 2 missed -0.1
    to -0.7 ms an action from the fast device and +0.8 to +2.2 ms from the slow one, which the
    simulation put 24 % faster (measured: 13 %); a term from the fast-first run left the slow-first
    plans that the gpt search then executed 14-24 % fast."""
    pipe = Pipeline()
    P = len(cost.cluster.devices)
    best, best_s = None, float("inf")
    for devices in dict.fromkeys((tuple(range(P)), tuple(reversed(range(P))))):
        try:
            plan = pipe.solve(cost, devices, **shape)
        except InfeasiblePlanError:
            continue
        step = pipe.predict(plan, cost)[0].step_time_s
        if step < best_s:
            best, best_s = plan, step
    if best is None:
        raise InfeasiblePlanError("no device order fits this calibration pipeline")
    return best


def calibration_pipeline_plans(cost, global_batch: int, min_micro: int, precision: str = "fp32") -> list:
    """The pipeline runs that calibrate the per-action term: every device in order or in reverse
    (`preferred_order`), one stage each, boundaries solved as the search would; one micro-batch (the
    largest micro-batch, model parallelism), then 1F1B with 2 micro-batches per rank and with one per
    rank where the batch allows (fill, steady state and drain all occur at a small micro-batch; the
    searches pick both)."""
    P = len(cost.cluster.devices)
    out = []
    ms = list(dict.fromkeys(m for m in (2 * P, P, 2) if global_batch % m == 0 and global_batch // m >= min_micro))
    # A batch-coupled loss is only ever pipelined with one micro-batch (more would change its objective).
    for m in [1] + ([] if cost.facts.batch_coupled else ms[:2]):
        try:
            out.append(preferred_order(cost, schedule="1F1B" if m >= P else "GPipe", microbatches=m,
                                       batch=global_batch, precision=precision))
        except InfeasiblePlanError:
            continue
    return out


def calibration_multi_stage_plans(cost, global_batch: int, min_micro: int, precision: str = "fp32") -> list:
    """The runs that calibrate the multi-stage schedules' per-action terms, two per schedule that gives a
    term (`MULTI_TERM_RUN`: Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble) over every device in
    order or in reverse (`preferred_order`), boundaries solved as the search would: two stages per rank
    with P micro-batches (2P when P do not divide the batch), and the most actions a rank runs in the
    search's space up to 4P micro-batches (the most stages per rank that the model's blocks allow, ZBV
    always 2; the most micro-batches that divide the batch with at least `min_micro` samples each).  The term is fitted in micro-batches x
    stages per rank (`_pipeline_sched.action_term`).  None when the model has fewer than 2P blocks or
    the loss is batch-coupled, and none for a schedule the installed torch lacks."""
    P = len(cost.cluster.devices)
    if cost.facts.batch_coupled or 2 * P > cost.facts.n_blocks:
        return []
    ms = [m for m in range(1, 4 * P + 1) if global_batch % m == 0 and global_batch // m >= min_micro]
    first = [m for m in (P, 2 * P) if m in ms]
    if not first:
        return []
    have = available_schedules()
    out = []
    for schedule in dict.fromkeys(MULTI_TERM_RUN.values()):
        if schedule not in have:
            continue
        v_most = 2 if schedule in V_SHAPED else max(v for v in (2, 3, 4) if v * P <= cost.facts.n_blocks)
        for v, m in dict.fromkeys([(2, first[0]), (v_most, ms[-1])]):
            try:
                out.append(preferred_order(cost, schedule=schedule, stages_per_rank=v, microbatches=m,
                                           batch=global_batch, precision=precision))
            except InfeasiblePlanError:
                continue
    return out


def calibrate_pipeline(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                       global_batch: int, repeats: int = CALIB_REPEATS, precisions: Sequence[str] = ()) -> ProfileSet:
    """Run short real pipelines on the whole cluster (each twice, more while no two agree:
    `robust_step_s`) and record the per-compute-action residual (per micro-batch size: `fit_action_residual`,
    like `calibrate_residual` per data-parallel micro-step) that makes their simulated steps equal the
    measured ones: torch.distributed.pipelining's per-action work, p2p waits, contention between ranks
    and small-micro-batch costs that isolated block timings miss.  One term for one-stage-per-rank
    schedules (up to three runs: `calibration_pipeline_plans`), one for each multi-stage schedule that
    gives a term (a run each: `calibration_multi_stage_plans`); each measured once per group.

    Each low precision in `precisions` gets terms of its own, from the same shapes of plan run in it,
    their boundaries solved in that precision as its searched plans' are (`precision_action_key`).
    With fp32's boundaries (before 2026-12-05), resnet50@64's bf16 InterleavedZeroBubble term came from
    a run whose slow device held the last three blocks, read -1.3 ms an action in two main jobs, and
    the bf16 interleaved pipelines those jobs then picked measured 14-19 % slower than predicted.
    resnet50@64 on the default cluster, a host with AVX-512 bf16, 2026-12-04:
    with the fp32 terms alone bf16 pipelines measured 27-34 % slower than simulated (1F1B m=2, three
    InterleavedZeroBubble m=2 plans; their fp32 twins +3.2 / -5.7 %), while one-rank bf16 pipelines and
    bf16 data parallelism were within 4 %: two ranks computing in bf16 side by side slow each other
    more than in fp32 (16/16 data parallelism on two full-speed ranks: bf16 took 0.86 of fp32's step,
    one rank alone 0.69)."""
    if len(next(iter(profiles.models.values())).blocks) < len(cluster.devices):
        return profiles  # fewer blocks than devices: no pipeline over the whole cluster
    group = group_key(cluster.devices)
    jobs = []
    for prec in ("fp32", *precisions):
        def in_prec(plans_for, prec=prec):  # boundaries solved in that precision, as its searched plans are
            return lambda cost, gb, mm: plans_for(cost, gb, mm, precision=prec)

        def by_schedule(plans, prec=prec) -> dict:
            out: dict = {}
            for p in plans:
                out.setdefault(precision_action_key(multi_stage_key(p.schedule, group), prec), []).append(p)
            return out

        jobs += [("pipe_action_s", _pending_actions(cluster, workload, profiles, global_batch, "pipe_action_s",
                                                    lambda plans, prec=prec: {precision_action_key(group, prec): plans},
                                                    in_prec(calibration_pipeline_plans)),
                  lambda plan: float(plan.micro_batch), "micro-batch {:g}"),
                 ("pipe_action_multi_s", _pending_actions(cluster, workload, profiles, global_batch,
                                                          "pipe_action_multi_s", by_schedule,
                                                          in_prec(calibration_multi_stage_plans)),
                  lambda plan: float(plan.microbatches * plan.stages_per_rank), "{:g} micro-batches x stages per rank")]
    pipe, ref = Pipeline(), profile_ref(profiles.models.values())
    every = [(pipe.label(p), p) for _, todo, _, _ in jobs for plans in todo.values() for p in plans]
    # Every pipeline's runs taken in turn first (each term solved on its own runs afterwards).
    with taken_in_turn(every, cluster=cluster, workload=workload, ref_probe_s=ref, steps=PIPELINE_STEPS, say=say,
                       repeats=repeats):
        for field_name, todo, at, at_label in jobs:
            profiles = _calibrate_actions(cluster, workload, profiles, root, say, repeats, ref, field_name, todo, at,
                                          at_label)
    return profiles


PIPELINE_STEPS = 6
"""Timed steps of every pipeline calibration run."""


def _pending_actions(cluster: Cluster, workload, profiles: ProfileSet, global_batch: int, field_name: str, keyed,
                     plans_for) -> dict:
    """The calibration runs of one field's terms that the model profiles lack, by the key of the term they
    fit: `plans_for` gives the runs, `keyed` groups them by key."""
    cost = CostModel(cluster, profiles, workload.optimizer, has_batchnorm=workload.has_batchnorm,
                     batch_coupled=workload.batch_coupled)
    todo = keyed(plans_for(cost, global_batch, min_samples_per_micro_batch(workload.has_batchnorm)))
    return {k: v for k, v in todo.items() if not all(k in getattr(m, field_name) for m in profiles.models.values())}


def _calibrate_actions(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say, repeats: int,
                       ref_probe_s: float, field_name: str, todo: dict, at, at_label: str) -> ProfileSet:
    """`calibrate_pipeline` for one field: `todo` holds the calibration runs by the key of the term they fit
    (`_pending_actions`), `at` gives the value a run's residual is fitted at (`fit_action_residual`);
    `ref_probe_s` is the profiles' host speed (`profile_ref`)."""
    def cost_with(terms: dict[str, Fit]) -> CostModel:
        models = {k: replace(p, **{field_name: {**getattr(p, field_name), **terms}}) for k, p in profiles.models.items()}
        return CostModel(cluster, replace(profiles, models=models), workload.optimizer,
                         has_batchnorm=workload.has_batchnorm, batch_coupled=workload.batch_coupled)

    zero = Fit(intercept=0.0, slope=0.0)
    pipe = Pipeline()
    fits = {}
    for key, plans in todo.items():
        cost0 = cost_with({key: zero})
        points = []
        for plan in plans:
            say(f"calibrating pipeline actions: a real {pipe.label(plan)} step on all {len(cluster.devices)} devices")
            m, real = robust_step_s(plan, cluster=cluster, workload=workload, ref_probe_s=ref_probe_s,
                                    steps=PIPELINE_STEPS, say=say, repeats=repeats)
            if real is None:
                say(f"pipeline calibration run failed ({m.status})")
                continue
            pred0 = pipe.predict(plan, cost0)[0].step_time_s
            delta = 1e-3  # actions on the critical path: how much 1 ms more per action lengthens the step
            n_crit = (pipe.predict(plan, cost_with({key: Fit(intercept=delta, slope=0.0)}))[0].step_time_s - pred0) / delta
            say(f"  measured {real:.3f} s, simulated {pred0:.3f} s over {n_crit:.0f} critical actions")
            points.append((at(plan), n_crit, real - pred0))
        if not points:
            say(f"pipeline actions ({key}) carry no calibrated overhead")
            continue
        fits[key] = fit_action_residual(points)
        say(f"pipeline calibration ({key}): {describe_action_residual(fits[key], at_label)}")
    if not fits:
        return profiles
    return record(profiles, root, workload,
                  lambda kind, prof: replace(prof, **{field_name: {**getattr(prof, field_name), **fits}}))


def _secant_term(step_at, real: float, pred0: float, n_crit: float, signed: bool, rounds: int = 3) -> float:
    """The per-collective (or per-action) term x with step_at(x) = real: the linear estimate from
    the critical collectives (actions) at x = 0, then secant steps, since a large term can move the
    critical path (a pipeline's stages hold different numbers of layers, so the bottleneck stage
    changes).  An unsigned term below 0 is left as is (it reads as 0, where the step no longer moves)."""
    x0, y0 = 0.0, pred0
    x = (real - pred0) / n_crit
    for _ in range(rounds):
        if x <= 0 and not signed:
            break
        y = step_at(x)
        if abs(y - real) <= 1e-6 * real or y == y0:
            break
        x0, y0, x = x, y, x + (real - y) * (x - x0) / (y - y0)
    return x


TP_FIELDS = {"tp_dtensor_collective_s": "dtensor", "tp_sp_collective_s": "sp", "tp_collective_s": "slices",
             "tp_pipeline_scale": "slices"}
"""Each tensor-parallel term and the realisation (`TPPlan.realisation`) of the runs that calibrate it."""
SIGNED_TP_FIELDS = ("tp_pipeline_scale",)
"""The relative compute change of tensor groups as pipeline stages, which may be negative (the other
terms are per all-reduce and read as 0 below 0)."""
PP_TP_MICROBATCHES = 2
"""Micro-batches of the PP x TP calibration runs (two stages, 1F1B)."""


def calibrate_tp(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say, global_batch: int,
                 delta: float = 1e-3, repeats: int = CALIB_REPEATS) -> ProfileSet:
    """Short real tensor-parallel steps, one per kind of tensor group the search can form (transformer
    workloads): over the whole cluster as one group (2, 4 or 8 devices), DTensor's even shards with
    and without sequence parallelism, and the solved per-rank slices; and, on 4 or 8 devices, each
    smaller group size: data-parallel replicas of its groups (solved slices, each grouping: 'strided'
    mixes speeds in every group, 'fast_links' groups like devices) and DTensor's even shards (with and
    without sequence parallelism) on the fastest devices alone; and, where the cluster
    holds two stages of such groups, a PP x TP run of each grouping, whose residual is a relative
    change of the stages' compute instead (`tp_pipeline_scale`, signed).  Each run stores the
    per-collective residual, per MiB of the collective's activation, that makes its simulated step
    equal the measured one: (measured - simulated) / the MiB of collectives on the critical path
    (found, like the pipeline term's actions, as how much 1 ms more per MiB lengthens the simulated
    step; secant steps where the critical path moves).  A run whose replicas form groups of
    different kinds gives all of its not yet calibrated groups the one term it measured.  On equal devices the solved shards are the even ones (DTensor's), so the
    slices term of the whole cluster stays uncalibrated (0)."""
    from hetsim.strategies.tp import GROUPINGS, TP, TP_SIZES, build_plan, tp_dims

    n = len(cluster.devices)

    def cost_with(field: str | None = None, keys=(), value: float = 0.0) -> CostModel:
        models = profiles.models if field is None else {
            k: replace(p, **{field: {**getattr(p, field), **dict.fromkeys(keys, value)}})
            for k, p in profiles.models.items()}
        return CostModel(cluster, replace(profiles, models=models), workload.optimizer,
                         has_batchnorm=workload.has_batchnorm, batch_coupled=workload.batch_coupled)

    cost0 = cost_with()
    if n < 2 or tp_dims(cost0) is None:
        return profiles
    every = tuple(range(n))

    def whole(field: str, group=every, t: int = n):
        """The calibration plan of `field` on `group` as one tensor group of t devices."""
        real = TP_FIELDS[field]
        return lambda: build_plan(cost0, group, t, "fast_links", global_batch, even=real != "slices",
                                  sequence_parallel=real == "sp")

    one_group = ("tp_dtensor_collective_s", "tp_sp_collective_s", "tp_collective_s")
    runs = [(field, whole(field)) for field in one_group] if n in TP_SIZES else []
    fastest = tuple(sorted(every, key=lambda d: (-cluster.devices[d].speed, d)))
    for t in (t for t in TP_SIZES if t < n and n % t == 0):
        runs += [("tp_collective_s", lambda t=t, g=g: build_plan(cost0, every, t, g, global_batch))
                 for g in sorted(GROUPINGS, reverse=True)]
        runs += [(field, whole(field, fastest[:t], t)) for field in one_group[:2]]
    for t in (t for t in TP_SIZES if n % (2 * t) == 0):  # tensor groups as 2 pipeline stages (and replicas)
        runs += [("tp_pipeline_scale",
                  lambda t=t, g=g: build_plan(cost0, every, t, g, global_batch, stages=2,
                                              microbatches=PP_TP_MICROBATCHES))
                 for g in sorted(GROUPINGS, reverse=True)]
    tp = TP()
    for field, make in runs:
        try:
            plan = make()
        except InfeasiblePlanError:
            continue
        if plan.realisation != TP_FIELDS[field]:
            continue
        keys = sorted({group_key([cluster.devices[d] for d in grp]) for grp in plan.groups()})
        keys = [k for k in keys if not any(k in getattr(m, field) or f"{field}:{k}" in m.calib_failed
                                           for m in profiles.models.values())]
        if not keys:
            continue
        pred0 = tp.predict(plan, cost_with(field, keys, 0.0))[0].step_time_s
        n_crit = (tp.predict(plan, cost_with(field, keys, delta))[0].step_time_s - pred0) / delta
        if n_crit <= 0:  # no all-reduce (action) on the critical path: nothing a run could attribute to them
            continue
        where = (f"{plan.stages} pipeline stages of {plan.tp_size}-device tensor groups" if plan.stages > 1
                 else f"{plan.tp_size} devices as one tensor group" if plan.dp == 1
                 else f"{plan.dp} replicas of {plan.tp_size}-device tensor groups")
        say(f"calibrating tensor parallelism: a real {tp.label(plan)} step on {where}")
        m, real = robust_step_s(plan, cluster=cluster, workload=workload, ref_probe_s=profile_ref(profiles.models.values()),
                                steps=6, say=say, repeats=repeats)
        failed = real is None
        if failed:
            say(f"tensor-parallel calibration run failed ({m.status}); its all-reduces carry no calibrated overhead")
        else:
            def step_at(x: float, plan=plan, field=field, keys=keys) -> float:
                return tp.predict(plan, cost_with(field, keys, x))[0].step_time_s

            per = _secant_term(step_at, real, pred0, n_crit, signed=field in SIGNED_TP_FIELDS)
            if field in SIGNED_TP_FIELDS:
                say(f"  measured {real:.3f} s, simulated {pred0:.3f} s over {n_crit:.3f} s of critical compute: "
                    f"{per * 100:+.1f} %")
            else:
                say(f"  measured {real:.3f} s, simulated {pred0:.3f} s over {n_crit:.1f} MiB of critical "
                    f"collectives: {per * 1e3:+.2f} ms per MiB")
        models = {}
        for kind, prof in profiles.models.items():
            if failed:
                prof = replace(prof, calib_failed={**prof.calib_failed, **{f"{field}:{k}": m.status for k in keys}})
            else:
                prof = replace(prof, **{field: {**getattr(prof, field), **dict.fromkeys(keys, per)}})
            save(prof, model_profile_path(root, kind, workload.spec))
            models[kind] = prof
        profiles = replace(profiles, models=models)
    return profiles
