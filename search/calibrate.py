"""The calibration step: short real runs of the strategies' own executors that add to the model
profiles what isolated block timings miss, each term recorded beside the profile it corrects.

Eight terms, each measured once per profile (or per device group) and then reused: the single-device
residual (the real data-parallel executor on one device at two batch sizes), the gradient
synchronisation of a uniform data-parallel step on the whole cluster and again at the split that
balances the devices (`calibrate_sync_balanced`), what a uniform ZeRO-3 (FSDP),
ZeRO-2 and ZeRO-1 step adds to it, the per-action overhead of two real pipelines, and
(transformers) the per-all-reduce overhead of two real tensor-parallel steps.  A search measures the
terms of the families it runs (`ProfileRequest.strategies`) and the data-parallel one its baseline needs.  The profiles
step before it is `hetsim.search.profiles`.

Every term rests on `--repeats` real runs of its plan (`ProfileRequest.repeats`, default two, and a
third when those two disagree by more than the noise floor: `robust_step_s`): one run that fell into a
slow phase of the host had moved the data-parallel term by 0.16 s between two recordings made back to
back.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hetsim.strategies._coupled import GRAD_CACHE_CHOICES
from hetsim.strategies._dp_closed import compute_overlap, data_parallel_compute
from hetsim.strategies.base import SearchContext
from hetsim.strategies.ddp import DDP, DDPPlan
from hetsim.strategies.helpers import balance_batch
from hetsim.strategies.pipeline import Pipeline
from hetsim.strategies.zero import ZeRO

from hetsim.errors import InfeasiblePlanError
from hetsim.execution.runner import measure
from hetsim.execution.warm import warm_launches
from hetsim.hardware.cluster import Cluster
from hetsim.model.costmodel import CostModel
from hetsim.names import REPEATS, min_samples_per_micro_batch
from hetsim.profiling.hostspeed import profile_ref
from hetsim.profiling.obtain import (
    ProfileRequest,
    Say,
    micro_batch_sizes,
)
from hetsim.profiling.store import (
    DeviceProfile,
    ModelProfile,
    ProfileSet,
    group_key,
    model_profile_path,
    save,
)
from hetsim.types import Fit, Measurement

from .realruns import repeated_runs

RESIDUAL = "calib_residual_s"
"""The single-device term's key in `ModelProfile.calib_failed` when its run failed."""
SMALL_BATCH_PER_DEVICE = 4
"""Samples per device of a uniform calibration run when the search's global batch is predicted not to fit."""
GC_RESIDUAL = "grad_cache_residual_s"
"""The single-device gradient-cache term's key in `ModelProfile.calib_failed`."""


def robust_step_s(plan, *, cluster: Cluster, workload, ref_probe_s: float, steps: int, say: Say,
                  timeout_s: float = 600, repeats: int = REPEATS):
    """(last measurement, step time at the profiles' host speed or None): `repeats` real runs of `plan`
    (the search's --repeats), with two a third when they disagree by more than the noise floor
    (`NOISE_FLOOR_REL`); the median is kept, so one run caught in a slow phase of the host is
    out-voted.  None when a run fails (the failing measurement says why)."""
    runs = repeated_runs(
        lambda k: measure(plan, cluster=cluster, workload_spec=workload.spec, optimizer=workload.optimizer,
                          steps=steps, warmup=3, timeout_s=timeout_s),
        repeats, at=lambda m: m.step_time_at(ref_probe_s),
        on_disagree=lambda a, b: say(f"  the two runs disagree ({a:.3f} and {b:.3f} s at the profiles' host speed): "
                                     "a third decides"))
    m = runs[-1]
    if not m.timed:
        return m, None
    return m, statistics.median(r.step_time_at(ref_probe_s) for r in runs)


def calibrate(cluster: Cluster, workload, profiles: ProfileSet, req: ProfileRequest, say: Say = print) -> ProfileSet:
    """Every calibration term the profiles lack for this cluster, measured by real runs and saved
    into the model profiles under `req.root`/profiles/; terms already recorded are reused."""
    t0 = time.perf_counter()
    with warm_launches():  # every run's ranks forked fresh from one warm torchrun agent (hetsim.execution.warm)
        profiles = _calibrate_all(cluster, workload, profiles, req, say)
    say(f"calibration ready in {time.perf_counter() - t0:.0f} s")
    return profiles


def _calibrate_all(cluster: Cluster, workload, profiles: ProfileSet, req: ProfileRequest, say: Say) -> ProfileSet:
    profiles = calibrate_devices(cluster, workload, profiles, req, say)

    def searched(*families: str) -> bool:
        return req.strategies is None or any(f in req.strategies for f in families)

    if cluster.links is None and len(cluster.devices) > 1 and all(d.backend != "catalog" for d in cluster.devices):
        # The uniform data-parallel baseline always runs; the other terms only for the families searched.
        r, gb = req.repeats, req.global_batch
        profiles = calibrate_sync(cluster, workload, profiles, req.root, say, repeats=r, global_batch=gb)
        profiles = calibrate_sync_balanced(cluster, workload, profiles, req.root, say, repeats=r, global_batch=gb)
        if searched("zero"):
            profiles = calibrate_sharded(cluster, workload, profiles, req.root, say, repeats=r, global_batch=gb)
            profiles = calibrate_zero2(cluster, workload, profiles, req.root, say, repeats=r, global_batch=gb)
            profiles = calibrate_zero1(cluster, workload, profiles, req.root, say, repeats=r, global_batch=gb)
        if searched("pipeline", "hybrid"):
            profiles = calibrate_pipeline(cluster, workload, profiles, req.root, say, req.global_batch, repeats=r)
        if searched("tp"):
            profiles = calibrate_tp(cluster, workload, profiles, req.root, say, req.global_batch, repeats=r)
    return profiles


def calibrate_devices(cluster: Cluster, workload, profiles: ProfileSet, req: ProfileRequest, say: Say) -> ProfileSet:
    """The single-device residual of every model profile whose kind has a real device here and
    that has none yet (a failed run is remembered: `--reprofile` measures again)."""
    sizes = micro_batch_sizes(req.global_batch, len(cluster.devices))
    models = dict(profiles.models)
    for kind, prof in profiles.models.items():
        dev = next((d for d in cluster.devices if d.kind == kind and d.backend != "catalog"), None)
        if dev is None:
            continue
        if prof.calib_residual_s is None and RESIDUAL not in prof.calib_failed:
            prof = calibrate_residual(dev, workload, prof, profiles.devices[kind], sizes, say, repeats=req.repeats)
            save(prof, model_profile_path(req.root, kind, workload.spec))
        if (workload.batch_coupled and prof.grad_cache_residual_s is None and GC_RESIDUAL not in prof.calib_failed
                and (req.strategies is None or {"ddp", "zero"} & set(req.strategies))):
            # Half a uniform share and a whole one, in the most chunks the search offers: the chunk sizes
            # of the plans that need the cache (a slow device's and a fast one's, 10.75 and 21.25 for
            # simclr's 86/170 on 2 devices) lie between or just past them.
            share = req.global_batch // len(cluster.devices)
            locals_ = sorted({min(sizes[-1], max(2 * max(GRAD_CACHE_CHOICES), b)) for b in (share // 2, share)})
            prof = calibrate_grad_cache(dev, workload, prof, profiles.devices[kind], locals_, say, repeats=req.repeats)
            save(prof, model_profile_path(req.root, kind, workload.spec))
        models[kind] = prof
    return replace(profiles, models=models)


def _one_device(device) -> Cluster:
    """A cluster of this one device at full speed with no memory cap: single-device calibration runs."""
    one_dev = replace(device, speed=1.0, memory_bytes=1 << 50, index=device.index)
    return Cluster(spec="calibration", source=device.backend if device.backend != "catalog" else "emulated",
                   devices=(one_dev,))


def calibrate_residual(device, workload, prof: ModelProfile, dev_prof: DeviceProfile, sizes, say: Say,
                       repeats: int = REPEATS) -> ModelProfile:
    """Run the real data-parallel executor on one device of this kind at two batch sizes and fit
    what the isolated block timings miss (measured step - predicted step), per micro-step."""
    one = _one_device(device)
    cost = CostModel(one, ProfileSet(models={prof.device_kind: prof}, devices={prof.device_kind: dev_prof}),
                     workload.optimizer)
    xs = [float(b) for b in sorted({sizes[len(sizes) // 2 - 1] if len(sizes) > 2 else sizes[0], sizes[-1]})]
    ys, failed = _single_device_gaps(
        [(DDPPlan(devices=(0,), local_batch=(int(b),)), f"real single-device step at batch {int(b)}") for b in xs],
        one, cost, workload, prof, say, repeats)
    if failed is not None:
        say(f"calibration run failed ({failed}); keeping the uncalibrated block model")
        return replace(prof, calib_failed={**prof.calib_failed, RESIDUAL: failed})
    return replace(prof, calib_residual_s=Fit.least_squares(xs, ys, nonneg=False))


def _single_device_gaps(plans: list[tuple[DDPPlan, str]], one: Cluster, cost: CostModel, workload,
                        prof: ModelProfile, say: Say, repeats: int) -> tuple[list[float], str | None]:
    """Each single-device plan's real step (`robust_step_s`, at the profiles' host speed) minus its
    prediction under `cost`, in order, saying each `label`; stops at a failing run and returns its
    status as well (None when all ran)."""
    gaps = []
    for plan, label in plans:
        pred = DDP().predict(plan, cost)[0].step_time_s
        say(f"calibrating {prof.device_kind}: {label}")
        # One local device: never a multi-node rendezvous.
        m, real = robust_step_s(plan, cluster=one, workload=workload, ref_probe_s=prof.probe_s, steps=10, say=say,
                                repeats=repeats)
        if real is None:
            return gaps, m.status
        gaps.append(real - pred)
    return gaps, None


def calibrate_grad_cache(device, workload, prof: ModelProfile, dev_prof: DeviceProfile, locals_: list[int],
                         say: Say, repeats: int = REPEATS) -> ModelProfile:
    """Run the real single-device gradient-cache step of each of `locals_` samples in the most chunks
    the search offers and fit what the block timings miss per chunk, vs chunk size
    (`ModelProfile.grad_cache_residual_s`).  A chunk runs twice (no graph, then with its embedding
    gradient) at sizes far below a plain micro-batch's, where a plain step's residual is no guide.
    Larger chunks are no guide either: simclr@96's CPU blocks cost 6x more at 64 samples than at 32
    (the cache), and a line through chunks of 8 and 32 over-charged its 21-sample chunks by 2x."""
    one = _one_device(device)
    bare = replace(prof, calib_residual_s=None, grad_cache_residual_s=None)
    cost = CostModel(one, ProfileSet(models={prof.device_kind: bare}, devices={prof.device_kind: dev_prof}),
                     workload.optimizer, has_batchnorm=workload.has_batchnorm, batch_coupled=True,
                     logits_per_sample_sq=workload.logits_per_sample_sq)
    chunks = max(GRAD_CACHE_CHOICES)
    gaps, failed = _single_device_gaps(
        [(DDPPlan(devices=(0,), local_batch=(local,), grad_cache_chunks=chunks),
          f"real single-device gradient-cache step, {local} samples in {chunks} chunks") for local in locals_],
        one, cost, workload, prof, say, repeats)
    if failed is not None:
        say(f"calibration run failed ({failed}); gradient-cache chunks keep a plain micro-step's residual")
        return replace(prof, calib_failed={**prof.calib_failed, GC_RESIDUAL: failed})
    xs = [local / chunks for local in locals_]
    ys = [gap / chunks for gap in gaps]
    line = Fit.least_squares(xs, ys, nonneg=False)
    return replace(prof, grad_cache_residual_s=replace(line, knots=tuple(sorted(zip(xs, ys)))) if len(xs) > 1
                   else line)


def calibrate_sync(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                   repeats: int = REPEATS, global_batch: int | None = None) -> ProfileSet:
    """Run the uniform data-parallel step on the whole cluster once and record what the simulated
    gradient synchronisation misses (contention between ranks, gloo progress), per model kind."""

    return _calibrate_uniform(cluster, workload, profiles, root, say, DDP(), "sync_residual_s",
                              "gradient synchronisation: a real uniform step",
                              "the simulated bucket all-reduce stands alone", repeats=repeats, global_batch=global_batch)


BALANCED_MIN_GAIN = 0.1
"""How much more compute overlap (`compute_overlap`) than the uniform step's a balanced split must have
for its own data-parallel run (identical devices: none)."""


def calibrate_sync_balanced(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                            repeats: int = REPEATS, global_batch: int | None = None) -> ProfileSet:
    """Run the data-parallel step at the split that balances the devices (the search's own solver,
    `balance_batch`, at the uniform plan's batch) and record its residual beside the uniform one's,
    with both steps' compute overlap (`ModelProfile.sync_balanced_s`): plans between them read the
    line through the two (`CostModel.sync_residual_s`).  Needs the uniform term; skipped where the
    balanced split overlaps barely more than the uniform one."""
    key = group_key(cluster.devices)
    tag = f"sync_balanced_s:{key}"
    models = profiles.models.values()
    if (workload.batch_coupled or all(key in m.sync_balanced_s for m in models)
            or any(tag in m.calib_failed for m in models) or not all(key in m.sync_residual_s for m in models)):
        return profiles
    cost = CostModel(cluster, profiles, workload.optimizer, has_batchnorm=workload.has_batchnorm)
    uniform = uniform_plan(DDP(), cost, global_batch)
    if uniform is None:
        return profiles
    try:
        split = balance_batch(cost, uniform.devices, uniform.global_batch, 1, uniform.precision, 0, 1)
    except InfeasiblePlanError:
        return profiles
    plan = replace(uniform, local_batch=split)
    at_uniform, at_plan = (compute_overlap(data_parallel_compute(cost, p)) for p in (uniform, plan))
    if at_plan < at_uniform + BALANCED_MIN_GAIN or not DDP().predict(plan, cost)[0].feasible:
        return profiles

    def with_term(term: float) -> ProfileSet:
        return replace(profiles, models={k: replace(m, sync_balanced_s={**m.sync_balanced_s,
                                                                         key: (at_uniform, at_plan, term)})
                                         for k, m in profiles.models.items()})

    def predicted(term: float) -> float:
        return DDP().predict(plan, CostModel(cluster, with_term(term), workload.optimizer,
                                             has_batchnorm=workload.has_batchnorm))[0].step_time_s

    say(f"calibrating gradient synchronisation: a real balanced step on all {len(cluster.devices)} devices "
        f"({'/'.join(map(str, split))}; compute overlap {at_plan:.2f}, uniform {at_uniform:.2f})")
    m, reals = _whole_cluster_step(plan, cluster, workload, profiles, say, repeats)
    if reals is None:
        say(f"balanced data-parallel calibration failed ({m.status}); every split keeps the uniform term")
        return _record(profiles, root, workload,
                       lambda kind, prof: replace(prof, calib_failed={**prof.calib_failed, tag: m.status}))
    return _record(profiles, root, workload, lambda kind, prof: replace(
        prof, sync_balanced_s={**prof.sync_balanced_s, key: (at_uniform, at_plan, term_for(reals[kind], predicted))}))


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
                      repeats: int = REPEATS, global_batch: int | None = None) -> ProfileSet:
    """Run the uniform FSDP (ZeRO-3) step on the whole cluster once and record what its simulation
    misses beyond the data-parallel synchronisation term (on CPU: gloo all-gathers that re-gather
    each block in backward while the peer rank computes; measured 26-40% slower than simulated)."""

    return _calibrate_uniform(cluster, workload, profiles, root, say, ZeRO(), "shard_residual_s",
                              "sharded data parallelism: a real uniform FSDP step",
                              "FSDP plans keep the data-parallel term alone", repeats=repeats,
                              global_batch=global_batch)


def calibrate_zero2(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                    repeats: int = REPEATS, global_batch: int | None = None) -> ProfileSet:
    """Run the uniform ZeRO-2 step (FSDP2 keeping gathered parameters from forward to backward) on the
    whole cluster once and record what its simulation misses beyond the data-parallel term: on CPU
    ranks its per-block collectives cost about what ZeRO-3's do (vit@tiny@32 on the default cluster:
    predicted 22-36 % fast without it, where ddp, ZeRO-1 and ZeRO-3 were within 6-14 %)."""

    return _calibrate_uniform(cluster, workload, profiles, root, say, ZeRO(), "zero2_residual_s",
                              "gradient-sharded data parallelism: a real uniform ZeRO-2 step",
                              "ZeRO-2 plans keep the data-parallel term alone", zero_stage=2, repeats=repeats,
                              global_batch=global_batch)


def calibrate_zero1(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                    repeats: int = REPEATS, global_batch: int | None = None) -> ProfileSet:
    """Run the uniform ZeRO-1 step (DDP + ZeroRedundancyOptimizer) on the whole cluster once and record
    what its simulation misses beyond the data-parallel term: ZeroRedundancyOptimizer broadcasts each
    owner's parameters one tensor at a time (bert@tiny@64: predicted 15-19 % fast without it)."""

    return _calibrate_uniform(cluster, workload, profiles, root, say, ZeRO(), "zero1_residual_s",
                              "optimizer-sharded data parallelism: a real uniform ZeRO-1 step",
                              "ZeRO-1 plans keep the data-parallel term alone", zero_stage=1, repeats=repeats,
                              global_batch=global_batch)


def _calibrate_uniform(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say, strat, field: str,
                       what: str, fallback: str, zero_stage: int | None = None, repeats: int = REPEATS,
                       global_batch: int | None = None) -> ProfileSet:
    """Real runs of `strat`'s uniform plan (at `zero_stage` when given) on the whole cluster
    (`uniform_plan`); its measured minus simulated step is stored in each model profile's `field`
    under the cluster's group key (once per group)."""
    key = group_key(cluster.devices)
    tag = f"{field}:{key}"
    if all(key in getattr(m, field) for m in profiles.models.values()):
        return profiles
    failed = next((m.calib_failed[tag] for m in profiles.models.values() if tag in m.calib_failed), None)
    if failed is not None:
        say(f"{what.split(':')[0]} calibration failed before ({failed}), not repeated (--reprofile measures "
            f"again); {fallback}")
        return profiles
    cost = CostModel(cluster, profiles, workload.optimizer, has_batchnorm=workload.has_batchnorm,
                     batch_coupled=workload.batch_coupled)
    plan = uniform_plan(strat, cost, global_batch, zero_stage)
    if plan is None:
        return profiles
    pred = strat.predict(plan, cost)[0]
    say(f"calibrating {what} on all {len(cluster.devices)} devices ({'/'.join(map(str, plan.local_batch))})")
    m, reals = _whole_cluster_step(plan, cluster, workload, profiles, say, repeats)
    if reals is None:
        say(f"{what.split(':')[0]} calibration failed ({m.status}); {fallback}")
        if m.status != "oom":  # a crash or timeout may pass next time; running out of memory will not
            return profiles
        return _record(profiles, root, workload,
                       lambda kind, prof: replace(prof, calib_failed={**prof.calib_failed, tag: m.status}))
    return _record(profiles, root, workload, lambda kind, prof: replace(
        prof, **{field: {**getattr(prof, field), key: reals[kind] - pred.step_time_s}}))


def _whole_cluster_step(plan, cluster: Cluster, workload, profiles: ProfileSet, say: Say,
                        repeats: int) -> tuple[Measurement, dict[str, float] | None]:
    """(the last measurement, each model kind's real step at its profile's host speed, or None when the
    run failed) of `robust_step_s` of `plan` on the whole cluster: one host-speed reference when the
    kinds share one, else each kind's own probe."""
    refs = {prof.probe_s for prof in profiles.models.values()}
    ref = next(iter(refs)) if len(refs) == 1 else 0.0  # one host-speed reference for every kind (0: none)
    m, real = robust_step_s(plan, cluster=cluster, workload=workload, ref_probe_s=ref, steps=10, say=say,
                            repeats=repeats)
    if real is None:
        return m, None
    return m, {kind: real if len(refs) == 1 else m.step_time_at(prof.probe_s) for kind, prof in profiles.models.items()}


def _record(profiles: ProfileSet, root: Path, workload,
            update: Callable[[str, ModelProfile], ModelProfile]) -> ProfileSet:
    """Every model profile updated by `update(kind, profile)` and saved under `root`."""
    models = {}
    for kind, prof in profiles.models.items():
        models[kind] = prof = update(kind, prof)
        save(prof, model_profile_path(root, kind, workload.spec))
    return replace(profiles, models=models)


def uniform_plan(strat, cost: CostModel, global_batch: int | None, zero_stage: int | None = None):
    """The uniform plan a data-parallel term is calibrated on: `strat`'s baseline (at `zero_stage` when
    given) at the search's global batch, the batch its baseline and its plans run at, when it is
    predicted to fit; else (or without one) at `SMALL_BATCH_PER_DEVICE` samples per device, at least
    16.  The term is one constant per step, and what it stands for is not: on gpt@tiny@64 (default
    cluster, five interleaved runs each, scattering by +-10 %) real minus simulated read +9.5 ms at
    8/8 and -8 ms at 16/16; the searches' uniform baseline (16/16 at the default batch of 32) was
    predicted 16-20 % slow in five of the fresh-clone searches the README keeps (resnet50 three
    times, gpt twice; -2 to +7.6 % in three others) while the term came from 8/8.  None when `strat`
    has no uniform plan here."""
    n = len(cost.cluster.devices)
    small = max(SMALL_BATCH_PER_DEVICE * n, 16)
    plan = None
    for gb in dict.fromkeys(b for b in (global_batch, small) if b):
        plan = strat.baseline(SearchContext(cost=cost, global_batch=gb))
        if plan is None:
            return None
        if zero_stage is not None:
            plan = replace(plan, zero_stage=zero_stage)
        if strat.predict(plan, cost)[0].feasible:
            return plan
    return plan  # predicted not to fit even at the small batch: its run says so (and is remembered)


def fit_action_residual(points: list[tuple[float, float, float]]) -> Fit:
    """Per-action residual a + b * micro from (micro-batch size, actions on the critical path, step
    residual) of real runs: each run's residual spread over its critical actions, then a line through
    the per-action values (a constant from one run)."""

    per = [(mb, r / n) for mb, n, r in points if n > 0]
    if not per:
        return Fit(intercept=0.0, slope=0.0)
    if len(per) == 1 or len({mb for mb, _ in per}) == 1:
        return Fit(intercept=sum(e for _, e in per) / len(per), slope=0.0)
    (m1, e1), (m2, e2) = per[0], per[-1]
    b = (e2 - e1) / (m2 - m1)
    return Fit(intercept=e1 - b * m1, slope=b)


def calibration_pipeline_plans(cost, global_batch: int, min_micro: int) -> list:
    """The pipeline runs that calibrate the per-action term: every device in order, one stage each,
    boundaries solved as the search would; one micro-batch (the largest micro-batch, model
    parallelism), then 1F1B with 2 micro-batches per rank where the batch allows (fill, steady state
    and drain all occur at a small micro-batch)."""
    P = len(cost.cluster.devices)
    out = []
    ms = [m for m in (2 * P, P, 2) if global_batch % m == 0 and global_batch // m >= min_micro]
    # A batch-coupled loss is only ever pipelined with one micro-batch (more would change its objective).
    for m in [1] + ([] if cost.facts.batch_coupled else ms[:1]):
        try:
            out.append(Pipeline().solve(cost, tuple(range(P)), schedule="1F1B" if m >= P else "GPipe",
                                        microbatches=m, batch=global_batch))
        except InfeasiblePlanError:
            continue
    return out


def calibrate_pipeline(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say,
                       global_batch: int, repeats: int = REPEATS) -> ProfileSet:
    """Run two short real pipelines on the whole cluster (each twice, a third time when the two disagree:
    `robust_step_s`) and record the per-compute-action residual
    (a + b * micro-batch, like `calibrate_residual` per data-parallel micro-step) that makes their
    simulated steps equal the measured ones: torch.distributed.pipelining's per-action work, p2p
    waits, contention between ranks and small-micro-batch costs that isolated block timings miss."""
    key = group_key(cluster.devices)
    if all(key in m.pipe_action_s for m in profiles.models.values()):
        return profiles
    if len(next(iter(profiles.models.values())).blocks) < len(cluster.devices):
        return profiles  # fewer blocks than devices: no pipeline over the whole cluster

    def cost_with(fit: Fit) -> CostModel:
        models = {k: replace(p, pipe_action_s={**p.pipe_action_s, key: fit}) for k, p in profiles.models.items()}
        return CostModel(cluster, replace(profiles, models=models), workload.optimizer,
                         has_batchnorm=workload.has_batchnorm, batch_coupled=workload.batch_coupled)

    zero = Fit(intercept=0.0, slope=0.0)
    cost0 = cost_with(zero)
    pipe = Pipeline()
    points = []
    for plan in calibration_pipeline_plans(cost0, global_batch, min_samples_per_micro_batch(workload.has_batchnorm)):
        say(f"calibrating pipeline actions: a real {pipe.label(plan)} step on all {len(cluster.devices)} devices")
        m, real = robust_step_s(plan, cluster=cluster, workload=workload, ref_probe_s=profile_ref(profiles.models.values()),
                                steps=6, say=say, repeats=repeats)
        if real is None:
            say(f"pipeline calibration run failed ({m.status})")
            continue
        pred0 = pipe.predict(plan, cost0)[0].step_time_s
        delta = 1e-3  # actions on the critical path: how much 1 ms more per action lengthens the step
        n_crit = (pipe.predict(plan, cost_with(Fit(intercept=delta, slope=0.0)))[0].step_time_s - pred0) / delta
        say(f"  measured {real:.3f} s, simulated {pred0:.3f} s over {n_crit:.0f} critical actions")
        points.append((float(plan.micro_batch), n_crit, real - pred0))
    if not points:
        say("pipeline actions carry no calibrated overhead")
        return profiles
    fit = fit_action_residual(points)
    say(f"pipeline calibration: {fit.intercept * 1e3:+.1f} ms {fit.slope * 1e3:+.2f} ms x micro-batch per compute action")
    return _record(profiles, root, workload,
                   lambda kind, prof: replace(prof, pipe_action_s={**prof.pipe_action_s, key: fit}))


TP_FIELDS = {"tp_dtensor_collective_s": True, "tp_collective_s": False}
"""The tensor-parallel terms and whether their calibration plan runs through DTensor."""


def calibrate_tp(cluster: Cluster, workload, profiles: ProfileSet, root: Path, say: Say, global_batch: int,
                 delta: float = 1e-3, repeats: int = REPEATS) -> ProfileSet:
    """Short real tensor-parallel steps, one per kind of tensor group the search can form (transformer
    workloads): over the whole cluster as one group (2, 4 or 8 devices), DTensor's even shards and the
    solved per-rank slices; and, on 4 or 8 devices, each smaller group size: data-parallel replicas
    of its groups (solved slices, each grouping: 'strided' mixes speeds in every group, 'fast_links'
    groups like devices) and DTensor's even shards on the fastest devices alone.  Each run stores the
    per-collective residual that makes its simulated step equal the measured one: (measured -
    simulated) / the all-reduces on the critical path (found, like the pipeline term's actions, as how
    much 1 ms more per collective lengthens the simulated step).  A run whose replicas form groups of
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
    runs = [(field, lambda dt=dtensor: build_plan(cost0, every, n, "fast_links", global_batch, even=dt))
            for field, dtensor in TP_FIELDS.items()] if n in TP_SIZES else []
    fastest = tuple(sorted(every, key=lambda d: (-cluster.devices[d].speed, d)))
    for t in (t for t in TP_SIZES if t < n and n % t == 0):
        runs += [("tp_collective_s", lambda t=t, g=g: build_plan(cost0, every, t, g, global_batch))
                 for g in sorted(GROUPINGS, reverse=True)]
        runs.append(("tp_dtensor_collective_s",
                     lambda t=t: build_plan(cost0, fastest[:t], t, "fast_links", global_batch, even=True)))
    tp = TP()
    for field, make in runs:
        try:
            plan = make()
        except InfeasiblePlanError:
            continue
        if plan.dtensor != (field == "tp_dtensor_collective_s"):
            continue
        keys = sorted({group_key([cluster.devices[d] for d in grp]) for grp in plan.groups()})
        keys = [k for k in keys if not any(k in getattr(m, field) or f"{field}:{k}" in m.calib_failed
                                           for m in profiles.models.values())]
        if not keys:
            continue
        pred0 = tp.predict(plan, cost_with(field, keys, 0.0))[0].step_time_s
        n_crit = (tp.predict(plan, cost_with(field, keys, delta))[0].step_time_s - pred0) / delta
        if n_crit <= 0:  # no all-reduce on the critical path: nothing a run could attribute to them
            continue
        where = (f"{plan.tp_size} devices as one tensor group" if plan.dp == 1
                 else f"{plan.dp} replicas of {plan.tp_size}-device tensor groups")
        say(f"calibrating tensor parallelism: a real {tp.label(plan)} step on {where}")
        m, real = robust_step_s(plan, cluster=cluster, workload=workload, ref_probe_s=profile_ref(profiles.models.values()),
                                steps=6, say=say, repeats=repeats)
        failed = real is None
        if failed:
            say(f"tensor-parallel calibration run failed ({m.status}); its all-reduces carry no calibrated overhead")
        else:
            per = (real - pred0) / n_crit
            say(f"  measured {real:.3f} s, simulated {pred0:.3f} s over {n_crit:.0f} critical all-reduces: "
                f"{per * 1e3:+.2f} ms each")
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
