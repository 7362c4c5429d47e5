"""The calibration step: short real runs of the strategies' own executors that add to the model
profiles what isolated block timings miss, each term recorded beside the profile it corrects.

Ten terms, each measured once per profile (or per device group) and then reused: the single-device
residual (the real data-parallel executor on one device at two batch sizes, in fp32 and in each low
precision searched that is not far slower: `LOW_PRECISION_SKIP`), the speed each slowed emulated device
really runs at (`calibrate_speed`), the gradient synchronisation of a
uniform data-parallel step on the whole cluster and again at the split that balances the devices
(`calibrate_sync_balanced`; both again in each such low precision, for its own plans), what a uniform ZeRO-3 (FSDP), ZeRO-2 and ZeRO-1 step adds to it and what
FSDP2 with CPU offload adds on one device alone (`hetsim.search.calib_dataparallel`), the per-action overhead of real pipelines (one-stage ones
at up to three micro-batch sizes, and each multi-stage schedule), and (transformers) the
per-all-reduce overhead of real tensor-parallel steps (`hetsim.search.calib_modelparallel`).  This
module runs them all and measures the single-device terms itself.  A search measures the terms of the
families it runs (`ProfileRequest.strategies`) and the data-parallel one its baseline needs.  The
profiles step before it is `hetsim.search.profiles`.

Every term rests on `--calib-repeats` real runs of its plan (`ProfileRequest.repeats`, default four, and
more while no two agree within the noise floor), of which it keeps the median
(`hetsim.search.realruns.robust_step_s`): one run that fell into a slow phase of the host had moved the
data-parallel term by 0.16 s between two recordings made back to back, and a term's runs scatter by about
3 % each (`hetsim.names.CALIB_REPEATS`).
"""

from __future__ import annotations

import time
from dataclasses import replace

from hetsim.strategies._coupled import GRAD_CACHE_CHOICES
from hetsim.strategies.ddp import DDP, DDPPlan
from hetsim.strategies.helpers import trains_in

from hetsim.execution.warm import warm_launches
from hetsim.hardware.cluster import Cluster
from hetsim.model.costmodel import LOW_PRECISION_SKIP, CostModel, precision_problem
from hetsim.names import CALIB_REPEATS
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
from hetsim.types import Fit

from .calib_dataparallel import calibrate_dataparallel, calibrate_offload_single
from .calib_modelparallel import calibrate_pipeline, calibrate_tp
from .realruns import robust_step_s, taken_in_turn

RESIDUAL = "calib_residual_s"
"""The single-device term's key in `ModelProfile.calib_failed` when its run failed."""
GC_RESIDUAL = "grad_cache_residual_s"
"""The single-device gradient-cache term's key in `ModelProfile.calib_failed`."""
SPEED = "speed_scale"
"""A slowed device's term's key in `ModelProfile.calib_failed` (then `:` and the device's `group_key`)."""
SPEED_SCALE_MAX = 1.5
"""`calibrate_speed`'s result is kept within [1/this, this]: a run that far off says more about the host
than about the emulation."""


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

    real = cluster.links is None and all(d.backend != "catalog" for d in cluster.devices)
    r, gb = req.repeats, req.global_batch
    if real and len(cluster.devices) == 1 and searched("zero"):
        # One device has no group terms, but an offloaded step still misses what its simulation does not
        # see (an H200, 2026-12-04: one-device ZeRO-2/3 offload measured 45-52 % slower than simulated).
        profiles = calibrate_offload_single(cluster, workload, profiles, req.root, say, repeats=r, global_batch=gb)
    if real and len(cluster.devices) > 1:
        # The uniform data-parallel baseline always runs; the other terms only for the families searched.
        lows = pipeline_precisions(cluster, profiles, req.precisions)
        profiles = calibrate_dataparallel(cluster, workload, profiles, req.root, say, searched("zero"), repeats=r,
                                          global_batch=gb, precisions=lows if searched("ddp", "zero") else ())
        if searched("pipeline", "hybrid"):
            profiles = calibrate_pipeline(cluster, workload, profiles, req.root, say, req.global_batch, repeats=r,
                                          precisions=lows)
        if searched("tp"):
            profiles = calibrate_tp(cluster, workload, profiles, req.root, say, req.global_batch, repeats=r)
    return profiles


def pipeline_precisions(cluster: Cluster, profiles: ProfileSet, precisions) -> tuple[str, ...]:
    """The low precisions whose pipelines and data-parallel steps get calibration runs of their own
    (`calibrate_pipeline`, `calibrate_dataparallel`): those
    every device trains in, that no profile refuses or times too slow to be calibrated (as the single-device
    residual decides), and not fp16, which pipelined runs refuse (no loss scaling)."""
    def usable(prec: str) -> bool:
        return (prec != "fp16" and all(prec in low_precisions(d, precisions) for d in cluster.devices)
                and not any(precision_problem(m, prec) or slowdown(m, prec) > LOW_PRECISION_SKIP
                            for m in profiles.models.values()))
    return tuple(p for p in dict.fromkeys(precisions) if p != "fp32" and usable(p))


def calibrate_devices(cluster: Cluster, workload, profiles: ProfileSet, req: ProfileRequest, say: Say) -> ProfileSet:
    """The single-device terms of every model profile whose kind has a real device here and that has
    none yet (a failed run is remembered: `--reprofile` measures again): the residual in fp32 and in each
    low precision, and the speed of each slowed emulated device.  Their runs are taken in turn first
    (`taken_in_turn`: each plan's runs minutes apart, not back to back in one phase of the host), then each
    term is solved on its own runs.  Two recordings made back to back (resnet18@64, 2026-12-07, four runs
    back to back) had read the slowed device's speed term 1.075 and 1.028; over the 16 earlier pairs of
    recordings the term's two readings differed by 0.1-9.2 %."""
    sizes = micro_batch_sizes(req.global_batch, len(cluster.devices))
    models = dict(profiles.models)
    for kind, prof in profiles.models.items():
        dev = next((d for d in cluster.devices if d.kind == kind and d.backend != "catalog"), None)
        if dev is None:
            continue
        fp32 = prof.calib_residual_s is None and RESIDUAL not in prof.calib_failed
        lows = _lows_to_calibrate(dev, prof, req.precisions, say)
        slows = [d for d in slowed_devices(cluster, kind)
                 if group_key([d]) not in prof.speed_scale and f"{SPEED}:{group_key([d])}" not in prof.calib_failed]
        plans = (residual_plans(dev, sizes, "fp32") if fp32 else []) + [
            p for prec in lows for p in residual_plans(dev, sizes, prec)] + [speed_plan(d, sizes) for d in slows]
        with taken_in_turn(plans, cluster=None, workload=workload, ref_probe_s=prof.probe_s, steps=SINGLE_STEPS,
                           say=say, repeats=req.repeats):
            if fp32:
                prof = calibrate_residual(dev, workload, prof, profiles.devices[kind], sizes, say, repeats=req.repeats)
                save(prof, model_profile_path(req.root, kind, workload.spec))
            for prec in lows:
                prof = calibrate_residual(dev, workload, prof, profiles.devices[kind], sizes, say, repeats=req.repeats,
                                          precision=prec)
                save(prof, model_profile_path(req.root, kind, workload.spec))
            for slow in slows:
                prof = calibrate_speed(slow, workload, prof, profiles.devices[kind], sizes, say, repeats=req.repeats)
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


def _lows_to_calibrate(dev, prof: ModelProfile, precisions, say: Say) -> list[str]:
    """The low precisions whose single-device residual `dev`'s kind still lacks and can be calibrated: not
    refused by the profile (BatchNorm under CPU autocast: no plans to correct), not recorded or failed
    already, and not so slow in the profiles that its plans keep the fp32 residual (said so)."""
    out = []
    for prec in low_precisions(dev, precisions):
        if (precision_problem(prof, prec) or prec in prof.calib_residual_low_s
                or f"{RESIDUAL}:{prec}" in prof.calib_failed):
            continue
        slower = slowdown(prof, prec)
        if slower > LOW_PRECISION_SKIP:
            say(f"not calibrating {prof.device_kind} in {prec}: its blocks take {slower:.1f}x their fp32 time in the "
                f"profiles, so its plans keep the fp32 residual")
            continue
        out.append(prec)
    return out


def slowdown(prof: ModelProfile, precision: str) -> float:
    """The whole model's profiled forward and backward in `precision` over fp32's, at the largest
    micro-batch profiled (1.0 when either is not profiled)."""
    mb = max(prof.micro_batches)

    def total(p: str) -> float:
        return sum(b.timing[p].fwd_s(mb) + b.timing[p].bwd_s(mb) for b in prof.blocks)

    if not prof.blocks or any(p not in b.timing for b in prof.blocks for p in ("fp32", precision)):
        return 1.0
    base = total("fp32")
    return total(precision) / base if base > 0 else 1.0


def _one_device(device, speed: float = 1.0) -> Cluster:
    """A cluster of this one device at `speed` (full speed unless given) with no memory cap: single-device
    calibration runs."""
    one_dev = replace(device, speed=speed, memory_bytes=1 << 50, index=device.index)
    return Cluster(spec="calibration", source=device.backend if device.backend != "catalog" else "emulated",
                   devices=(one_dev,))


SINGLE_STEPS = 10
"""Timed steps of each single-device calibration run."""


def residual_plans(device, sizes, precision: str = "fp32") -> list[tuple[str, DDPPlan, Cluster]]:
    """(label, plan, its one-device cluster) of the single-device residual's runs in `precision`: the
    data-parallel step on `device` alone at a middle and at the largest micro-batch size."""
    tag = "" if precision == "fp32" else f" in {precision}"
    batches = sorted({int(sizes[len(sizes) // 2 - 1] if len(sizes) > 2 else sizes[0]), int(sizes[-1])})
    one = _one_device(device)
    return [(f"real single-device step at batch {b}{tag}", DDPPlan(devices=(0,), local_batch=(b,), precision=precision),
             one) for b in batches]


def speed_plan(device, sizes) -> tuple[str, DDPPlan, Cluster]:
    """(label, plan, its one-device cluster) of a slowed emulated device's speed term: the single-device
    step at the largest micro-batch, at the device's own speed."""
    return (f"real single-device step at batch {int(sizes[-1])} at speed {device.speed:g}",
            DDPPlan(devices=(0,), local_batch=(int(sizes[-1]),)), _one_device(device, speed=device.speed))


def slowed_devices(cluster: Cluster, kind: str) -> list:
    """One emulated device of `kind` per relative speed below 1 in the cluster (`calibrate_speed`)."""
    found = {}
    for d in cluster.devices:
        if d.kind == kind and d.backend == "emulated" and d.speed < 1:
            found.setdefault(d.speed, d)
    return list(found.values())


def calibrate_speed(device, workload, prof: ModelProfile, dev_prof: DeviceProfile, sizes, say: Say,
                    repeats: int = CALIB_REPEATS) -> ModelProfile:
    """Run the real single-device step at the largest micro-batch on this slowed emulated device, at its
    own speed, and record how much slower its compute really runs than 1/speed of the profile says
    (`ModelProfile.speed_scale`, solved on the step's simulation, which is linear in it)."""
    key = group_key([device])
    _, plan, one = speed_plan(device, sizes)

    def predicted(scale: float) -> float:
        at = replace(prof, speed_scale={key: scale})
        cost = CostModel(one, ProfileSet(models={prof.device_kind: at}, devices={prof.device_kind: dev_prof}),
                         workload.optimizer)
        return DDP().predict(plan, cost)[0].step_time_s

    say(f"calibrating {prof.device_kind} at speed {device.speed:g}: real single-device step at batch {sizes[-1]}")
    m, real = robust_step_s(plan, cluster=one, workload=workload, ref_probe_s=prof.probe_s, steps=SINGLE_STEPS,
                            say=say, repeats=repeats)
    if real is None:
        say(f"calibration run failed ({m.status}); plans on that device keep 1/speed of the profile")
        return replace(prof, calib_failed={**prof.calib_failed, f"{SPEED}:{key}": m.status})
    at1, at2 = predicted(1.0), predicted(2.0)
    scale = 1.0 + (real - at1) / (at2 - at1) if at2 > at1 else 1.0
    return replace(prof, speed_scale={**prof.speed_scale, key: min(SPEED_SCALE_MAX, max(1 / SPEED_SCALE_MAX, scale))})


def low_precisions(device, precisions) -> list[str]:
    """The low precisions among `precisions` that `device` trains in (bf16 where supported; fp16 on GPUs)."""
    return [p for p in precisions if p != "fp32" and trains_in(device, p)]


def calibrate_residual(device, workload, prof: ModelProfile, dev_prof: DeviceProfile, sizes, say: Say,
                       repeats: int = CALIB_REPEATS, precision: str = "fp32") -> ModelProfile:
    """Run the real data-parallel executor on one device of this kind at two batch sizes in `precision`
    and fit what the isolated block timings miss (measured step - predicted step), per micro-step:
    `calib_residual_s` for fp32, `calib_residual_low_s[precision]` otherwise (each against the bare
    block model, so neither depends on the other)."""
    plans = residual_plans(device, sizes, precision)
    one = plans[0][2]  # the plans' one-device cluster
    bare = replace(prof, calib_residual_s=None, calib_residual_low_s={})
    cost = CostModel(one, ProfileSet(models={prof.device_kind: bare}, devices={prof.device_kind: dev_prof}),
                     workload.optimizer)
    xs = [float(plan.local_batch[0]) for _, plan, _ in plans]
    tag = "" if precision == "fp32" else f" in {precision}"
    ys, failed = _single_device_gaps([(plan, label) for label, plan, _ in plans], one, cost, workload, prof, say,
                                     repeats)
    if failed is not None:
        say(f"calibration run failed ({failed}); keeping the uncalibrated block model{tag}")
        key = RESIDUAL if precision == "fp32" else f"{RESIDUAL}:{precision}"
        return replace(prof, calib_failed={**prof.calib_failed, key: failed})
    line = Fit.least_squares(xs, ys, nonneg=False)
    if precision == "fp32":
        return replace(prof, calib_residual_s=line)
    return replace(prof, calib_residual_low_s={**prof.calib_residual_low_s, precision: line})


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
        m, real = robust_step_s(plan, cluster=one, workload=workload, ref_probe_s=prof.probe_s, steps=SINGLE_STEPS,
                                say=say, repeats=repeats)
        if real is None:
            return gaps, m.status
        gaps.append(real - pred)
    return gaps, None


def calibrate_grad_cache(device, workload, prof: ModelProfile, dev_prof: DeviceProfile, locals_: list[int],
                         say: Say, repeats: int = CALIB_REPEATS) -> ModelProfile:
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
