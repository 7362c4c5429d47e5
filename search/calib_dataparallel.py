"""Calibration terms of the data-parallel families (`hetsim.search.calibrate` runs them): what a real
uniform data-parallel step on the whole cluster adds to the simulated gradient synchronisation, the
same at the split that balances the devices, what uniform ZeRO-3 (FSDP), ZeRO-2 and ZeRO-1 steps
add beyond it, and what FSDP2 with CPU offload adds on one device alone.  Each is one real plan
(`robust_step_s`) and a term recorded per model kind (`record`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hetsim.strategies._dp_closed import compute_overlap, data_parallel_compute
from hetsim.strategies.base import SearchContext
from hetsim.strategies.ddp import DDP, DDPPlan
from hetsim.strategies.helpers import balance_batch
from hetsim.strategies.zero import ZeRO, ZeROPlan

from hetsim.errors import InfeasiblePlanError
from hetsim.hardware.cluster import Cluster
from hetsim.model.costmodel import CostModel
from hetsim.names import CALIB_REPEATS
from hetsim.profiling.obtain import Say
from hetsim.profiling.store import (
    ModelProfile,
    ProfileSet,
    group_key,
    model_profile_path,
    precision_action_key,
    save,
)
from hetsim.types import Measurement

from .realruns import robust_step_s, taken_in_turn

SMALL_BATCH_PER_DEVICE = 4
"""Samples per device of a uniform calibration run when the search's global batch is predicted not to fit."""


def calibrate_dataparallel(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say, zero: bool,
                           repeats: int = CALIB_REPEATS, global_batch: int | None = None,
                           precisions: tuple[str, ...] = ()) -> ProfileSet:
    """Every whole-cluster data-parallel term these profiles lack: the uniform and balanced data-parallel
    steps and, with `zero`, the ZeRO-3, ZeRO-2, ZeRO-1 and one-device offload steps; then the uniform and
    balanced steps again in each low precision of `precisions` (its own terms, which its data-parallel and
    ZeRO plans read: `CostModel.sync_residual_s`).  Their runs are taken in turn first (`taken_in_turn`),
    then each term is solved in that order, each on the ones before it."""
    terms = [calibrate_sync, calibrate_sync_balanced]
    if zero:
        terms += [calibrate_sharded, calibrate_zero2, calibrate_zero1, calibrate_offload_single]
    for prec in precisions:
        terms += [functools.partial(calibrate_sync, precision=prec), functools.partial(calibrate_sync_balanced,
                                                                                      precision=prec)]
    with taken_in_turn(pending_plans(cluster, workload, profiles, global_batch, zero, precisions), cluster=cluster,
                       workload=workload, ref_probe_s=host_ref(profiles), steps=STEPS, say=say, repeats=repeats):
        for term in terms:
            profiles = term(cluster, workload, profiles, root, say, repeats=repeats, global_batch=global_batch)
    return profiles


def pending_plans(cluster: Cluster, workload, profiles: ProfileSet, global_batch: int | None,
                  zero: bool, precisions: tuple[str, ...] = ()) -> list[tuple[str, object]]:
    """(label, plan) of each term of `calibrate_dataparallel` that the profiles lack and that did not fail
    before, as its own function will choose it."""
    key = group_key(cluster.devices)

    def lacks(field: str, at: str = key) -> bool:
        return lacks_term(profiles, field, at)

    cost = CostModel(cluster, profiles, workload.optimizer, has_batchnorm=workload.has_batchnorm,
                     batch_coupled=workload.batch_coupled)
    ddp, zero_ = DDP(), ZeRO()
    out = []
    if lacks("sync_residual_s"):
        out.append(uniform_plan(ddp, cost, global_batch))
    if not workload.batch_coupled and lacks("sync_balanced_s"):
        found = _balanced_plan(cost, global_batch)  # batch_coupled is False here, as the term's own cost has it
        out.append(found[0] if found else None)
    if zero:
        for field, stage in (("shard_residual_s", None), ("zero2_residual_s", 2), ("zero1_residual_s", 1)):
            if lacks(field):
                out.append(uniform_plan(zero_, cost, global_batch, stage))
        dev = max(range(len(cluster.devices)), key=lambda i: cluster.devices[i].speed)
        if lacks("offload_single_s", group_key([cluster.devices[dev]])):
            out.append(_offload_single_plan(cost, dev, global_batch))
    for prec in precisions:
        low = precision_action_key(key, prec)
        if lacks("sync_residual_s", low):
            out.append(uniform_plan(ddp, cost, global_batch, precision=prec))
        if not workload.batch_coupled and lacks("sync_balanced_s", low):
            found = _balanced_plan(cost, global_batch, prec)
            out.append(found[0] if found else None)
    return [((ddp if isinstance(p, DDPPlan) else zero_).label(p), p) for p in out if p is not None]


STEPS = 10
"""Timed steps of every whole-cluster calibration run."""


def lacks_term(profiles: ProfileSet, field: str, key: str) -> bool:
    """Whether some model profile lacks the term `field` under `key` and no run of it failed before
    (`ModelProfile.calib_failed`)."""
    models = profiles.models.values()
    return not all(key in getattr(m, field) for m in models) and not any(f"{field}:{key}" in m.calib_failed
                                                                         for m in models)


def calibrate_sync(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                   repeats: int = CALIB_REPEATS, global_batch: int | None = None, precision: str = "fp32") -> ProfileSet:
    """Run the uniform data-parallel step on the whole cluster once and record what the simulated
    gradient synchronisation misses (contention between ranks, gloo progress), per model kind; a low
    `precision` runs the step in it and records its own term."""
    tag = "" if precision == "fp32" else f" in {precision}"
    return _calibrate_uniform(cluster, workload, profiles, root, say, DDP(), "sync_residual_s",
                              f"gradient synchronisation: a real uniform step{tag}",
                              "the simulated bucket all-reduce stands alone" if precision == "fp32"
                              else f"{precision} plans keep fp32's term", repeats=repeats, global_batch=global_batch,
                              precision=precision)


BALANCED_MIN_GAIN = 0.1
"""How much more compute overlap (`compute_overlap`) than the uniform step's a balanced split must have
for its own data-parallel run (identical devices: none)."""


def calibrate_sync_balanced(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                            repeats: int = CALIB_REPEATS, global_batch: int | None = None,
                            precision: str = "fp32") -> ProfileSet:
    """Run the data-parallel step at the split that balances the devices (the search's own solver,
    `balance_batch`, at the uniform plan's batch) and record its residual beside the uniform one's,
    with both steps' compute overlap (`ModelProfile.sync_balanced_s`): plans between them read the
    line through the two (`CostModel.sync_residual_s`).  Needs the uniform term; skipped where the
    balanced split overlaps barely more than the uniform one.  A low `precision`: the same in it, on its
    own uniform term."""
    key = precision_action_key(group_key(cluster.devices), precision)
    tag = f"sync_balanced_s:{key}"
    models = profiles.models.values()
    if (workload.batch_coupled or not lacks_term(profiles, "sync_balanced_s", key)
            or not all(key in m.sync_residual_s for m in models)):
        return profiles
    cost = CostModel(cluster, profiles, workload.optimizer, has_batchnorm=workload.has_batchnorm)
    found = _balanced_plan(cost, global_batch, precision)
    if found is None:
        return profiles
    plan, at_uniform, at_plan = found
    split = plan.local_batch

    def with_term(term: float) -> ProfileSet:
        return replace(profiles, models={k: replace(m, sync_balanced_s={**m.sync_balanced_s,
                                                                         key: (at_uniform, at_plan, term)})
                                         for k, m in profiles.models.items()})

    def predicted(term: float) -> float:
        return DDP().predict(plan, CostModel(cluster, with_term(term), workload.optimizer,
                                             has_batchnorm=workload.has_batchnorm))[0].step_time_s

    say(f"calibrating gradient synchronisation: a real balanced step on all {len(cluster.devices)} devices "
        f"({'/'.join(map(str, split))}{'' if precision == 'fp32' else ' ' + precision}; compute overlap "
        f"{at_plan:.2f}, uniform {at_uniform:.2f})")
    m, reals = whole_cluster_step(plan, cluster, workload, profiles, say, repeats)
    if reals is None:
        say(f"balanced data-parallel calibration failed ({m.status}); every split keeps the uniform term")
        return record(profiles, root, workload,
                       lambda kind, prof: replace(prof, calib_failed={**prof.calib_failed, tag: m.status}))
    return record(profiles, root, workload, lambda kind, prof: replace(
        prof, sync_balanced_s={**prof.sync_balanced_s, key: (at_uniform, at_plan, term_for(reals[kind], predicted))}))


def _balanced_plan(cost: CostModel, global_batch: int | None, precision: str = "fp32"):
    """(plan, the uniform plan's compute overlap, the plan's) of `calibrate_sync_balanced`: the uniform
    data-parallel plan (in `precision`) at the split `balance_batch` gives; None where there is none or it
    overlaps barely more (`BALANCED_MIN_GAIN`) or is predicted not to fit."""
    uniform = uniform_plan(DDP(), cost, global_batch, precision=precision)
    if uniform is None:
        return None
    try:
        split = balance_batch(cost, uniform.devices, uniform.global_batch, 1, uniform.precision, 0, 1)
    except InfeasiblePlanError:
        return None
    plan = replace(uniform, local_batch=split)
    at_uniform, at_plan = (compute_overlap(data_parallel_compute(cost, p)) for p in (uniform, plan))
    if at_plan < at_uniform + BALANCED_MIN_GAIN or not DDP().predict(plan, cost)[0].feasible:
        return None
    return plan, at_uniform, at_plan


def term_for(real: float, predicted: Callable[[float], float], tol: float = 1e-4) -> float:
    """The calibrated term x with `predicted(x)` = `real`, where `predicted` is non-decreasing in x and
    rises with slope 1 once the term is on the critical path (a sync after the all-reduces may be partly
    hidden behind a rank's own compute, so real minus predicted under-states it); below `predicted(0)`,
    the (negative) difference."""
    lo, hi = 0.0, max(real, 0.0)
    if predicted(lo) >= real:
        return real - predicted(lo)
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < real else (lo, mid)
    return (lo + hi) / 2


def calibrate_sharded(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                      repeats: int = CALIB_REPEATS, global_batch: int | None = None) -> ProfileSet:
    """Run the uniform FSDP (ZeRO-3) step on the whole cluster once and record what its simulation
    misses beyond the data-parallel synchronisation term (on CPU: gloo all-gathers that re-gather
    each block in backward while the peer rank computes; measured 26-40% slower than simulated)."""

    return _calibrate_uniform(cluster, workload, profiles, root, say, ZeRO(), "shard_residual_s",
                              "sharded data parallelism: a real uniform FSDP step",
                              "FSDP plans keep the data-parallel term alone", repeats=repeats,
                              global_batch=global_batch)


def calibrate_zero2(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                    repeats: int = CALIB_REPEATS, global_batch: int | None = None) -> ProfileSet:
    """Run the uniform ZeRO-2 step (FSDP2 keeping gathered parameters from forward to backward) on the
    whole cluster once and record what its simulation misses beyond the data-parallel term: on CPU
    ranks its per-block collectives cost about what ZeRO-3's do (vit@tiny@32 on the default cluster:
    predicted 22-36 % fast without it, where ddp, ZeRO-1 and ZeRO-3 were within 6-14 %)."""

    return _calibrate_uniform(cluster, workload, profiles, root, say, ZeRO(), "zero2_residual_s",
                              "gradient-sharded data parallelism: a real uniform ZeRO-2 step",
                              "ZeRO-2 plans keep the data-parallel term alone", zero_stage=2, repeats=repeats,
                              global_batch=global_batch)


def calibrate_zero1(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                    repeats: int = CALIB_REPEATS, global_batch: int | None = None) -> ProfileSet:
    """Run the uniform ZeRO-1 step (DDP + ZeroRedundancyOptimizer) on the whole cluster once and record
    what its simulation misses beyond the data-parallel term (bert@tiny@64: predicted 15-19 % fast without it,
    when ZeroRedundancyOptimizer still broadcast one tensor at a time)."""

    return _calibrate_uniform(cluster, workload, profiles, root, say, ZeRO(), "zero1_residual_s",
                              "optimizer-sharded data parallelism: a real uniform ZeRO-1 step",
                              "ZeRO-1 plans keep the data-parallel term alone", zero_stage=1, repeats=repeats,
                              global_batch=global_batch)


def calibrate_offload_single(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                             repeats: int = CALIB_REPEATS, global_batch: int | None = None) -> ProfileSet:
    """Run ZeRO-3 with CPU offload on the fastest device alone (the search's global batch, accumulated
    in 2 or 4 micro-steps where it does not fit at once) and record what its simulation misses
    (`ModelProfile.offload_single_s`), which every one-device ZeRO-2/3 offload plan on a device of that
    kind and speed carries (bert@tiny@64: both stages, at either accumulation, missed about the same)."""
    dev = max(range(len(cluster.devices)), key=lambda i: cluster.devices[i].speed)
    key = group_key([cluster.devices[dev]])
    if not lacks_term(profiles, "offload_single_s", key):
        return profiles
    cost = CostModel(cluster, profiles, workload.optimizer, has_batchnorm=workload.has_batchnorm,
                     batch_coupled=workload.batch_coupled)
    zero, plan = ZeRO(), _offload_single_plan(cost, dev, global_batch)
    if plan is None:
        return profiles
    say(f"calibrating offloaded sharding on one device: a real {zero.label(plan)} step")
    return _record_residual(plan, zero.predict(plan, cost)[0].step_time_s, "offload_single_s", key, cluster, workload,
                            profiles, root, say, repeats, "one-device offload",
                            "such plans keep the data-parallel step alone")


def _offload_single_plan(cost: CostModel, dev: int, global_batch: int | None) -> ZeROPlan | None:
    """`calibrate_offload_single`'s plan: ZeRO-3 with offload on `dev` alone at the search's global batch,
    in the fewest of 1, 2 or 4 micro-steps predicted to fit (None when none does)."""
    zero, gb = ZeRO(), global_batch or max(SMALL_BATCH_PER_DEVICE * cost.n_devices, 16)
    for accum in (1, 2, 4):
        cand = ZeROPlan(devices=(dev,), local_batch=(gb,), zero_stage=3, offload=True, accum_steps=accum)
        try:
            zero.validate(cand, cost)
            if zero.predict(cand, cost)[0].feasible:
                return cand
        except InfeasiblePlanError:
            continue
    return None


def _calibrate_uniform(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say, strat, field: str,
                       what: str, fallback: str, zero_stage: int | None = None, repeats: int = CALIB_REPEATS,
                       global_batch: int | None = None, precision: str = "fp32") -> ProfileSet:
    """Real runs of `strat`'s uniform plan (at `zero_stage` when given, in `precision`) on the whole cluster
    (`uniform_plan`); its measured minus simulated step is stored in each model profile's `field`
    under the cluster's group key (once per group; a low precision's under its own key, simulated with
    its term at 0, not fp32's in its place)."""
    key = precision_action_key(group_key(cluster.devices), precision)
    tag = f"{field}:{key}"
    if all(key in getattr(m, field) for m in profiles.models.values()):
        return profiles
    failed = next((m.calib_failed[tag] for m in profiles.models.values() if tag in m.calib_failed), None)
    if failed is not None:
        say(f"{what.split(':')[0]} calibration failed before ({failed}), not repeated (--reprofile measures "
            f"again); {fallback}")
        return profiles
    bare = profiles if precision == "fp32" else replace(profiles, models={
        k: replace(m, **{field: {**getattr(m, field), key: 0.0}}) for k, m in profiles.models.items()})
    cost = CostModel(cluster, bare, workload.optimizer, has_batchnorm=workload.has_batchnorm,
                     batch_coupled=workload.batch_coupled)
    plan = uniform_plan(strat, cost, global_batch, zero_stage, precision)
    if plan is None:
        return profiles
    say(f"calibrating {what} on all {len(cluster.devices)} devices ({'/'.join(map(str, plan.local_batch))})")
    return _record_residual(plan, strat.predict(plan, cost)[0].step_time_s, field, key, cluster, workload, profiles,
                            root, say, repeats, what.split(":")[0], fallback,
                            per=plan.chunks if field in PER_MICRO_STEP else 1)


PER_MICRO_STEP = ("shard_residual_s", "zero2_residual_s")
"""The terms a step pays once a micro-step (FSDP2's collectives run in every one: `_zero_graph._sharded_optimizer`),
recorded per micro-step of their calibration plan."""


def _record_residual(plan, pred_s: float, field: str, key: str, cluster: Cluster, workload, profiles: ProfileSet,
                     root: Path, say: Say, repeats: int, name: str, fallback: str, per: int = 1) -> ProfileSet:
    """Real runs of `plan` (`whole_cluster_step`); their step minus `pred_s` (over `per`, the term's
    occurrences in the plan's step) stored in each model profile's `field` under `key`.  A failed run is said ("`name` calibration failed (status); `fallback`") and,
    when out of memory, remembered under `FIELD:key` (`remember_failure`)."""
    m, reals = whole_cluster_step(plan, cluster, workload, profiles, say, repeats)
    if reals is None:
        say(f"{name} calibration failed ({m.status}); {fallback}")
        return remember_failure(profiles, root, workload, f"{field}:{key}", m.status)
    return record(profiles, root, workload, lambda kind, prof: replace(
        prof, **{field: {**getattr(prof, field), key: (reals[kind] - pred_s) / per}}))


def remember_failure(profiles: ProfileSet, root: Path, workload, tag: str, status: str) -> ProfileSet:
    """After a failed calibration run: an out-of-memory status recorded under `tag` in every model profile
    (`ModelProfile.calib_failed`: later searches do not repeat it); anything else is not (a crash or a
    timeout may pass next time; running out of memory will not)."""
    if status != "oom":
        return profiles
    return record(profiles, root, workload, lambda kind, prof: replace(prof, calib_failed={**prof.calib_failed,
                                                                                          tag: status}))


def whole_cluster_step(plan, cluster: Cluster, workload, profiles: ProfileSet, say: Say,
                        repeats: int) -> tuple[Measurement, dict[str, float] | None]:
    """(the last measurement, each model kind's real step at its profile's host speed, or None when the
    run failed) of `robust_step_s` of `plan` on the whole cluster: one host-speed reference when the
    kinds share one, else each kind's own probe."""
    one = len({prof.probe_s for prof in profiles.models.values()}) == 1
    m, real = robust_step_s(plan, cluster=cluster, workload=workload, ref_probe_s=host_ref(profiles), steps=STEPS,
                            say=say, repeats=repeats)
    if real is None:
        return m, None
    return m, {kind: real if one else m.step_time_at(prof.probe_s) for kind, prof in profiles.models.items()}


def host_ref(profiles: ProfileSet) -> float:
    """The one host-speed probe time every model kind's profile shares (0 when they differ: none)."""
    refs = {prof.probe_s for prof in profiles.models.values()}
    return next(iter(refs)) if len(refs) == 1 else 0.0


def record(profiles: ProfileSet, root: Path, workload,
            update: Callable[[str, ModelProfile], ModelProfile]) -> ProfileSet:
    """Every model profile updated by `update(kind, profile)` and saved under `root`."""
    models = {}
    for kind, prof in profiles.models.items():
        models[kind] = prof = update(kind, prof)
        save(prof, model_profile_path(root, kind, workload.spec))
    return replace(profiles, models=models)


def uniform_plan(strat, cost: CostModel, global_batch: int | None, zero_stage: int | None = None,
                 precision: str = "fp32"):
    """The uniform plan a data-parallel term is calibrated on: `strat`'s baseline (at `zero_stage` when
    given) at the search's global batch, the batch its baseline and its plans run at, when it is
    predicted to fit; else (or without one) at `SMALL_BATCH_PER_DEVICE` samples per device, at least
    16.  The term is one constant per step, and what it stands for is not: on gpt@tiny@64 (default
    cluster, five interleaved runs each, scattering by +-10 %) real minus simulated read +9.5 ms at
    8/8 and -8 ms at 16/16; the searches' uniform baseline (16/16 at the default batch of 32) was
    predicted 16-20 % slow in five of the fresh-clone searches the README keeps (resnet50 three
    times, gpt twice; -2 to +7.6 % in three others) while the term came from 8/8.  None when `strat`
    has no uniform plan here.  In a low `precision`: the same plan in it."""
    n = len(cost.cluster.devices)
    small = max(SMALL_BATCH_PER_DEVICE * n, 16)
    plan = None
    for gb in dict.fromkeys(b for b in (global_batch, small) if b):
        try:
            plan = strat.baseline(SearchContext(cost=cost, global_batch=gb))
            if plan is None:
                return None
            if zero_stage is not None:
                plan = replace(plan, zero_stage=zero_stage)
            if precision != "fp32":
                plan = replace(plan, precision=precision)
            strat.validate(plan, cost)
            if strat.predict(plan, cost)[0].feasible:
                return plan
        except InfeasiblePlanError:  # no such plan for this model (FSDP2 and a parameter with no dimension)
            return None
    return plan  # predicted not to fit even at the small batch: its run says so (and is remembered)

