"""The calibrated cost model: how long a block range takes on a device, what it holds, what a collective costs.

Calibrated devices use their own kind's measured block times, divided by the
device's relative speed (1.0 for real GPUs).  Catalog devices have no
measurement of their own: their profile comes from a per-operator roofline over
the model's traced shapes (hetsim.model.roofline); a catalog device without one
(profile sets recorded before it) is scaled from a measured reference kind by the
ratio of sustained matmul throughput, and every report says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from hetsim.errors import ProfileError
from hetsim.hardware.cluster import Cluster, Device
from hetsim.profiling.store import (
    BlockProfile,
    ModelProfile,
    ProfileSet,
    group_key,
    multi_stage_key,
    precision_action_key,
)
from hetsim.types import Fit
from hetsim.workloads.builtin import OPTIMIZER_STATE_PER_PARAM

# Fraction of datasheet peak that convolution-heavy training reaches on a GPU
# (typical published MFU of ResNet training); used only for catalog scaling.
CATALOG_EFFICIENCY = 0.4
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What strategies need to know about the workload, without torch."""

    n_blocks: int
    has_batchnorm: bool
    batch_coupled: bool
    optimizer: str
    logits_per_sample_sq: int = 0
    """Batch-coupled losses: logits of a batch of B are about this times B**2 (Workload field)."""


MIN_GRAD_COSINE = 0.9
"""Least cosine between a low-precision gradient and the fp32 one for a plan to use that precision,
unless the model's gradient moves about as far from rounding alone (`GRAD_MOVE_FACTOR`).  Low
precision perturbs gradients a little (0.94-0.9999 on the models here)."""

GRAD_MOVE_FACTOR = 10.0
"""A low precision is refused only when it moves the gradient (1 - cosine) more than this many times
as far as rounding the weights to it does in fp32 (`ModelProfile.grad_cosine_floor`).  A BatchNorm
resnet50 at initialisation is that sensitive by itself: its fp32 gradient's cosine to the fp32
gradient at weights rounded to bf16 is 0.42-0.46 (fp16: 0.89-0.90), and bf16 autocast gives 0.16 on
a CPU and 0.15 on an H200, where resnet50 trains in bf16 and ran 1.26x faster than in fp32
(results/gpu/h200).  A precision that breaks the gradient (fp16 underflow, a kernel without the
precision) moves it much further than rounding does on a model whose gradient is stable."""


def cosine_refuses(cos: float | None, floor: float | None) -> bool:
    """True when a low precision's gradient cosine `cos` is too low, given `floor`, the fp32 gradient's
    cosine after only rounding the weights to that precision (None: not measured, `cos` alone decides)."""
    if cos is None or cos >= MIN_GRAD_COSINE:
        return False
    return floor is None or (1.0 - cos) > GRAD_MOVE_FACTOR * (1.0 - floor)


LOW_PRECISION_SKIP = 2.0
"""A low precision whose blocks take more than this many times their fp32 time is far slower here
(a CPU without bf16 arithmetic: gpt@tiny@64's bf16 blocks 9-11x, resnet50's 9-15x, on an AMD EPYC
VM, 2026-12-03): no plan in it competes with fp32's, so profiling times it in one round, not
every round (`hetsim.profiling.measure.profile_model`), and calibration gives it no single-device
term of its own (`search.calibrate`: calibrating gpt's bf16 took about 160 s of a 493 s calibration,
and no bf16 plan came within 10x of the best)."""


ZERO_RESIDUAL_FIELDS = {1: "zero1_residual_s", 2: "zero2_residual_s", 3: "shard_residual_s"}
TP_TERMS = {"slices": "tp_collective_s", "dtensor": "tp_dtensor_collective_s", "sp": "tp_sp_collective_s"}
"""The calibrated per-collective term of each way a tensor-parallel plan runs (`TPPlan.realisation`):
per-rank slices, DTensor's even shards, DTensor with sequence parallelism."""
"""`ModelProfile` field of each ZeRO stage's calibrated term."""


def precision_problem(prof, precision: str) -> str | None:
    """Why `precision` must not train `prof`'s model on its device kind, from what profiling found (a
    `ModelProfile`): the model fails under its autocast, or its gradient's cosine to fp32's is too
    low; None when it may (or nothing was measured)."""
    failed = prof.precision_failed.get(precision)
    if failed:
        return (f"{prof.model} fails under {precision} autocast on {prof.device_kind} ({failed}; measured when "
                f"profiling); use fp32")
    cos, floor = prof.grad_cosine.get(precision), prof.grad_cosine_floor.get(precision)
    if cosine_refuses(cos, floor):
        moved = "" if floor is None else f", where rounding the weights to {precision} alone gives {floor:.2f}"
        return (f"{precision} autocast changes {prof.model}'s gradients on {prof.device_kind}: cosine "
                f"{cos:.2f} to the fp32 gradient of the same batch (measured when profiling), below "
                f"{MIN_GRAD_COSINE}{moved}; use fp32")
    return None


class CostModel:
    def __init__(self, cluster: Cluster, profiles: ProfileSet, optimizer: str = "adamw", *,
                 has_batchnorm: bool = False, batch_coupled: bool = False, logits_per_sample_sq: int = 0):
        self.cluster = cluster
        self.profiles = profiles
        self.optimizer = optimizer
        if not profiles.models:
            raise ProfileError("no model profile was given to the cost model; profile the model first")
        self._base_kind = next(iter(profiles.models))
        self.base_profile = profiles.models[self._base_kind]
        """The model profile block sizes are read from and catalog devices are scaled from."""
        self.facts = ModelFacts(
            n_blocks=len(self.base_profile.blocks), has_batchnorm=has_batchnorm, batch_coupled=batch_coupled, optimizer=optimizer,
            logits_per_sample_sq=logits_per_sample_sq,
        )
        self._scale = [self._device_scale(d) for d in cluster.devices]
        first: dict[Device, int] = {}
        self.klass: tuple[int, ...] = tuple(first.setdefault(replace(d, name="", index=0), i)
                                            for i, d in enumerate(cluster.devices))
        """klass[d]: the first device equal to d but for its name and position.  Compute times depend on
        nothing else, so they are computed and memoised once per class (512 devices of four types: four)."""
        self._param_total = sum(b.param_count for b in self.base_profile.blocks)
        self._trainable_total = sum(b.trainable_count for b in self.base_profile.blocks)
        self._memo: dict[tuple, Any] = {}
        self._tables: dict[str, dict] = {}
        self.step_barrier = cluster.emulated
        """Every step of a real run starts together on every rank (an emulated cluster's runs time the
        host-speed probe first, `RunProbe`): a step is one step's makespan (`run_steady`'s `barrier`)."""

    def memo(self, key: tuple, compute: Callable[[], T]) -> T:
        """`compute()`, once per key: what is derived from this model never changes (cluster and
        profiles are frozen), and a search asks for the same values trial after trial (a batch
        split over 64 devices reads thousands of step times and memory peaks)."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = compute()
            return value

    def memo_table(self, name: str) -> dict:
        """A named dict for values derived from this model, for hot loops that look up many keys
        per call (a plan's per-device step and memory): `table.get(key)` costs less than `memo`."""
        try:
            return self._tables[name]
        except KeyError:
            table = self._tables[name] = {}
            return table

    # -------------------------------------------------------------- devices

    def _device_scale(self, d: Device) -> tuple[ModelProfile, float]:
        """(profile to read, time multiplier) for device d."""
        if d.kind in self.profiles.models:
            prof = self.profiles.models[d.kind]
            realised = prof.speed_scale.get(group_key([d]), 1.0) if d.backend == "emulated" else 1.0
            return prof, realised / d.speed
        ref_dev = self.profiles.devices.get(self._base_kind)
        if d.backend == "catalog" and ref_dev is not None and d.peak_fp32_flops > 0:
            ref_flops = ref_dev.matmul_flops.get("fp32", 0.0)
            if ref_flops > 0:
                return self.base_profile, ref_flops / (d.peak_fp32_flops * CATALOG_EFFICIENCY)
        raise ProfileError(
            f"device {d.name!r} (kind {d.kind!r}) has no profile and cannot be scaled from one; "
            f"profiled kinds: {', '.join(self.profiles.models)}"
        )

    @property
    def n_devices(self) -> int:
        return len(self.cluster.devices)

    def device(self, i: int) -> Device:
        return self.cluster.devices[i]

    def blocks(self, dev: int | None = None) -> tuple[BlockProfile, ...]:
        return (self._scale[dev][0] if dev is not None else self.base_profile).blocks

    def precision_factor(self, dev: int, precision: str) -> tuple[str, float]:
        """Timing key to read and extra factor: devices without a fast path run low precision at fp32 speed."""
        d = self.device(dev)
        prof = self._scale[dev][0]
        if precision == "fp32":
            return "fp32", 1.0
        if d.backend == "catalog" and prof.device_kind == d.kind and precision in prof.blocks[0].timing:
            return precision, 1.0  # the catalog GPU's own roofline profile (hetsim.model.roofline)
        if d.backend == "catalog":
            peak = d.peak_bf16_flops if precision == "bf16" else d.peak_fp16_flops
            return "fp32", d.peak_fp32_flops / peak if peak > d.peak_fp32_flops else 1.0
        if precision in prof.blocks[0].timing:
            return precision, 1.0
        if precision == "fp16" and "bf16" in prof.blocks[0].timing and d.fast_fp16:
            return "bf16", 1.0
        return "fp32", 1.0

    # -------------------------------------------------------------- time

    def fwd_s(self, dev: int, lo: int, hi: int, mb: float, precision: str = "fp32") -> float:
        return self._timed("fwd", dev, lo, hi, mb, precision)

    def bwd_s(self, dev: int, lo: int, hi: int, mb: float, precision: str = "fp32") -> float:
        return self._timed("bwd", dev, lo, hi, mb, precision)

    def nograd_fwd_s(self, dev: int, lo: int, hi: int, mb: float, precision: str = "fp32") -> float:
        """A forward that records no graph (the gradient cache's first pass); `fwd_s` where the profile
        did not time one."""
        return self._timed("nograd", dev, lo, hi, mb, precision)

    def _timed(self, which: str, dev: int, lo: int, hi: int, mb: float, precision: str) -> float:
        if mb <= 0:
            return 0.0
        dev = self.klass[dev]
        return self.memo((which, dev, lo, hi, mb, precision), lambda: self._blocks_s(dev, lo, hi, mb, precision, which))

    def _blocks_s(self, dev: int, lo: int, hi: int, mb: float, precision: str, which: str) -> float:
        prof, mult = self._scale[dev]
        key, f = self.precision_factor(dev, precision)

        def fit(t):
            if which == "bwd":
                return t.bwd_s
            if which == "nograd" and t.nograd_fwd_s is not None:
                return t.nograd_fwd_s
            return t.fwd_s  # also the no-graph forward of a profile that did not time one

        return mult * f * sum(fit(b.timing[key])(mb) for b in prof.blocks[lo:hi])

    def monotone_in_batch(self, dev: int, precision: str = "fp32") -> bool:
        """Whether every block's time on this device never falls as the micro-batch grows (a profile
        keeps a real drop, `Fit.measured`; `hetsim.model.batchsplit.min_max_split` then searches)."""
        dev = self.klass[dev]

        def check() -> bool:
            key, _ = self.precision_factor(dev, precision)
            fits = [f for b in self._scale[dev][0].blocks for f in (b.timing[key].fwd_s, b.timing[key].bwd_s)]
            return all(y1 >= y0 for f in fits for (_, y0), (_, y1) in zip(f.knots, f.knots[1:]))

        return self.memo(("monotone", dev, precision), check)

    def overhead_s(self, dev: int, mb: float = 0.0, grad_cache: bool = False, precision: str = "fp32") -> float:
        """Per-micro-step time outside the blocks, calibrated against real executor steps (in
        `precision` where its own single-device residual was measured).  With
        `grad_cache`, one of a gradient-cache chunk's two passes over mb samples: half its calibrated
        per-chunk residual (`ModelProfile.grad_cache_residual_s`) where measured, else a plain
        micro-step's."""
        prof, mult = self._scale[dev]
        # The emulator throttles blocks and the optimizer only: the rest runs at full speed there.
        scale = 1.0 if self.device(dev).backend == "emulated" else mult
        gc = prof.grad_cache_residual_s if grad_cache else None
        if gc is not None:
            # Time the chunk's blocks take beyond their isolated timings: block time, which a slower device
            # (the emulator's too) stretches; simclr@96 missed 0.07 s per chunk of 21.5 at full speed and
            # 0.10 s per chunk of 10.5 at half speed.
            return max(0.0, prof.step_overhead_s * scale + mult * gc(mb) / 2)
        extra = 0.0
        r = prof.calib_residual_low_s.get(precision) if precision != "fp32" else None
        if r is None:
            r = prof.calib_residual_s
        if r is not None:
            extra = r.intercept + r.slope * mb
        return max(0.0, (prof.step_overhead_s + extra) * scale)

    def stage_overhead_s(self, dev: int, lo: int, hi: int, mb: float, precision: str = "fp32") -> float:
        """The share of `overhead_s(dev, mb)` that a pipeline stage of blocks lo..hi carries per micro-batch:
        in proportion to its block time, so a one-stage pipeline costs what a data-parallel micro-step does."""
        whole_t = self.fwd_s(dev, 0, self.facts.n_blocks, mb, precision) + self.bwd_s(dev, 0, self.facts.n_blocks, mb,
                                                                                     precision)
        part = self.fwd_s(dev, lo, hi, mb, precision) + self.bwd_s(dev, lo, hi, mb, precision)
        return self.overhead_s(dev, mb, precision=precision) * (part / whole_t if whole_t > 0 else 0.0)

    def pipeline_action_s(self, mb: float, schedule: str | None = None, precision: str = "fp32") -> float:
        """Calibrated extra time of every compute action of a pipeline schedule on this cluster at micro-batch
        mb (0 when not calibrated): torch.distributed.pipelining's per-action work, waits for peers, p2p and
        contention, as real pipeline runs measured it (`hetsim.search.calib_modelparallel.calibrate_pipeline`).
        Read at the calibrated micro-batches, and between them piece by piece (`Fit.residual`), signed: real
        pipelines run faster than simulated at large micro-batches (gpt@tiny@64, 1F1B, interleaved runs on
        2026-12-03: -2.3, -1.7 and -1.1 ms an action at 16, 8 and 4 samples; floored at zero, those plans
        were predicted 9-13 % slow).  Outside the calibrated range it is held flat but never below zero: a
        negative term carried to shapes no run measured once made gpt's InterleavedZeroBubble plans of 3
        stages x 8 micro-batches 59-69 % fast (their term came from 2 x 2 alone, -2.2 ms an action).
        One-stage-per-rank schedules (GPipe, 1F1B) have one term (`ModelProfile.pipe_action_s`); a multi-stage
        `schedule` the one its own calibration runs measured (`ModelProfile.pipe_action_multi_s`,
        `hetsim.strategies._pipeline_sched.action_term`), and then `mb` is the plan's micro-batches x stages
        per rank, the variable that term is fitted in.  A low `precision` reads the term its own runs
        measured (`precision_action_key`) where there is one, else the fp32 term."""
        group = self.memo(("cluster_group_key",), lambda: group_key(self.cluster.devices))
        field_name, key = ("pipe_action_s", group) if schedule is None else ("pipe_action_multi_s",
                                                                              multi_stage_key(schedule, group))
        low = precision_action_key(key, precision)
        if low != key and any(low in getattr(m, field_name) for m in self.profiles.models.values()):
            key = low

        def fits():
            return [getattr(m, field_name)[key] for m in self.profiles.models.values() if key in getattr(m, field_name)]

        def read(f: Fit) -> float:
            r = f.residual(mb)
            return r if len(f.knots) >= 2 and f.knots[0][0] <= mb <= f.knots[-1][0] else max(0.0, r)

        vals = [read(f) for f in self.memo(("pipe_action_fits", field_name, key), fits)]
        return max(vals) if vals else 0.0

    def sync_residual_s(self, group: tuple[int, ...], overlap: float | None = None, precision: str = "fp32") -> float:
        """Calibrated extra time of a data-parallel gradient synchronisation over this group: the
        uniform step's term, or, given the plan's compute `overlap` (`_dp_closed.compute_overlap`)
        and a balanced step recorded as well (`ModelProfile.sync_balanced_s`), the line between the
        two steps' terms at that overlap, flat beyond them (never below 0).

        Why two: on an emulated cluster the ranks contend for the host (memory bandwidth, the
        all-reduces on their own cores) while both compute, and a split that balances the devices
        keeps both busy for the whole step where the uniform one leaves the fast rank idle for half of
        it.  resnet50@64 on the default cluster, one recording, the uniform term alone: 16/16 -3 and
        +1 %, 27/5 -14 and -10 %, 24/8 -16 and -20 % (overlap 0.55, 0.89 and 0.80).

        A low `precision` reads the terms its own runs measured (`precision_action_key`, both of them, where
        its uniform term is recorded), else fp32's: gpt@tiny@64 on the default cluster, 2026-12-06, with the
        fp32 terms: ddp 22/10 bf16 -15.7 %, zero1 22/10 bf16 -15.9 %, ddp 22/10 accum 2 bf16 -17.6 %, the
        fp32 baseline +4.4 %."""
        prec = self.memo(("sync_precision", tuple(group), precision), lambda: self._term_precision(group, precision))
        base = self._group_term("sync_residual_s", group, precision=prec)
        if overlap is None or len(group) <= 1:
            return base

        def point() -> tuple[float, float, float] | None:
            key = precision_action_key(group_key([self.device(d) for d in group]), prec)
            return next((m.sync_balanced_s[key] for m in self.profiles.models.values() if key in m.sync_balanced_s),
                        None)

        found = self.memo(("sync_balanced", tuple(group), prec), point)
        if found is None or found[1] <= found[0]:
            return base
        at_uniform, at_balanced, term = found
        f = min(1.0, max(0.0, (overlap - at_uniform) / (at_balanced - at_uniform)))
        return max(0.0, base + (term - base) * f)

    def zero_residual_s(self, stage: int, group: tuple[int, ...]) -> float:
        """Calibrated extra time of a ZeRO-`stage` step over this group beyond `sync_residual_s`: each
        stage from its own real uniform step (`hetsim.search.calib_dataparallel`: ZeRO-3 `calibrate_sharded`,
        ZeRO-2 `calibrate_zero2`, ZeRO-1 `calibrate_zero1`)."""
        return self._group_term(ZERO_RESIDUAL_FIELDS[stage], group)

    def offload_single_s(self, dev: int) -> float:
        """Calibrated extra time of a ZeRO-2/3 step with CPU offload on device `dev` alone
        (`ModelProfile.offload_single_s`, `hetsim.search.calib_dataparallel.calibrate_offload_single`; 0 when
        not calibrated)."""
        return self._group_term("offload_single_s", (dev,), min_devices=1)

    def tp_collective_s(self, group: tuple[int, ...], realisation: str) -> float:
        """Calibrated extra time, in seconds per MiB of the activation, of every collective of a
        tensor-parallel layer over this tensor group (an all-reduce, or with sequence parallelism a
        reduce-scatter and an all-gather), for a realisation of `TP_TERMS`
        (`hetsim.search.calib_modelparallel.calibrate_tp`, `hetsim.strategies.tp.layer_collective_s`)."""
        return self._group_term(TP_TERMS[realisation], group)

    def tp_pipeline_scale(self, group: tuple[int, ...]) -> float:
        """Calibrated relative change, signed, of the compute of a pipeline stage that is this tensor
        group (`ModelProfile.tp_pipeline_scale`; 0 where no PP x TP run calibrated it; at least -0.9)."""
        return self._group_term("tp_pipeline_scale", group, floor=-0.9)

    def _term_precision(self, group: tuple[int, ...], precision: str) -> str:
        """`precision` where its own data-parallel term is recorded for this group, else 'fp32'."""
        key = precision_action_key(group_key([self.device(d) for d in group]), precision)
        return precision if any(key in m.sync_residual_s for m in self.profiles.models.values()) else "fp32"

    def _group_term(self, field: str, group: tuple[int, ...], min_devices: int = 2, floor: float = 0.0,
                    precision: str = "fp32") -> float:
        """A calibrated per-group term of the model profiles, at least `floor` (0 for fewer than
        `min_devices` or an uncalibrated group); memoised, since the closed forms ask for it on every
        evaluation."""
        if len(group) < min_devices:
            return 0.0

        def term() -> float:
            key = precision_action_key(group_key([self.device(d) for d in group]), precision)
            vals = [getattr(m, field)[key] for m in self.profiles.models.values() if key in getattr(m, field)]
            return max(floor, max(vals)) if vals else 0.0

        return self.memo(("group_term", field, tuple(group), precision), term)

    def opt_s(self, dev: int, param_count: float) -> float:
        prof, mult = self._scale[dev]
        fit = prof.opt_step_s.get(self.optimizer) or next(iter(prof.opt_step_s.values()))
        return mult * fit(param_count) if param_count > 0 else 0.0

    def precision_problem(self, devices, precision: str) -> str | None:
        """Why `precision` must not train this model on these devices, from each device kind's profile
        (`precision_problem`); None when it may (or nothing was measured)."""
        return next((p for p in (precision_problem(self._scale[d][0], precision) for d in devices) if p), None)

    def host_opt_s(self, dev: int, param_count: float) -> float:
        """Optimizer step on device dev's host CPU (CPU offload).  A GPU profile measures it; an
        emulated or catalog device's profile is this CPU's own, so its step unthrottled, unscaled
        is the host's.  A GPU profile recorded without it falls back to the device's own step."""
        if param_count <= 0:
            return 0.0
        prof, mult = self._scale[dev]
        if prof.host_opt_step_s:
            fit = prof.host_opt_step_s.get(self.optimizer) or next(iter(prof.host_opt_step_s.values()))
            return fit(param_count)
        fit = prof.opt_step_s.get(self.optimizer) or next(iter(prof.opt_step_s.values()))
        if self.cluster.devices[dev].backend in ("emulated", "catalog"):
            return fit(param_count)
        return mult * fit(param_count)

    def allreduce_s(self, nbytes: float, group: tuple[int, ...]) -> float:
        n = len(group)
        if n <= 1 or nbytes <= 0:
            return 0.0
        if self.cluster.links is None:
            comm = self._comm(n)
            return comm.allreduce_s(nbytes)
        bw, lat = self.memo(("group_link", tuple(group)), lambda: self._group_link(group))
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    def _group_link(self, group) -> tuple[float, float]:
        """(slowest bandwidth, highest latency) between the members of a group."""
        bw, lat = self.memo(("link_arrays",), self._link_arrays)  # a group of 256 has 65,280 pairs
        idx = np.asarray(group)
        return float(bw[np.ix_(idx, idx)].min()), float(lat[np.ix_(idx, idx)].max())

    def _link_arrays(self):
        """Every pair's bandwidth and latency as arrays, a device with itself left out (inf, -inf)."""
        links = self.cluster.links
        bw = np.array([[link.bandwidth_bps for link in row] for row in links], dtype=float)
        lat = np.array([[link.latency_s for link in row] for row in links], dtype=float)
        np.fill_diagonal(bw, np.inf)
        np.fill_diagonal(lat, -np.inf)
        return bw, lat

    def allgather_s(self, nbytes_total: float, group: tuple[int, ...]) -> float:
        """All-gather (or reduce-scatter) of a tensor whose full size is nbytes_total: half an all-reduce."""
        n = len(group)
        if n <= 1 or nbytes_total <= 0:
            return 0.0
        if self.cluster.links is None:
            comm = self._comm(n)
            if comm.allgather_s is not None:
                return comm.allgather_s(nbytes_total)
            return 0.5 * comm.allreduce_s(nbytes_total)
        return 0.5 * self.allreduce_s(nbytes_total, group)

    def p2p_s(self, nbytes: float, src: int, dst: int) -> float:
        if src == dst or nbytes <= 0:
            return 0.0
        if self.cluster.links is None:
            comm = self._comm(2)
            if comm.sendrecv_s is not None:
                return comm.sendrecv_s(nbytes)
            return 0.5 * comm.allreduce_s(nbytes)
        link = self.cluster.links[src][dst]
        return link.latency_s + nbytes / link.bandwidth_bps

    def host_transfer_s(self, dev: int, nbytes: float) -> float:
        d = self.device(dev)
        prof = self.profiles.devices.get(d.kind)
        bps = d.host_link_bps or (prof.host_link_bps if prof else 0.0) or (prof.copy_bps if prof else 0.0)
        return nbytes / bps if bps > 0 else 0.0

    def _comm(self, n: int):
        if n in self.profiles.comm:
            return self.profiles.comm[n]
        if not self.profiles.comm:
            raise ProfileError(f"no collective profile for a group of {n}; profile the process group first")
        # Ring all-reduce: latency grows with 2(n-1), bandwidth term with 2(n-1)/n.
        m = max(self.profiles.comm)
        base = self.profiles.comm[m]
        a = base.allreduce_s.intercept * (n - 1) / max(1, m - 1)
        b = base.allreduce_s.slope * ((n - 1) / n) / ((m - 1) / m)
        from dataclasses import replace

        return replace(base, world_size=n, allreduce_s=Fit(intercept=a, slope=b))

    # -------------------------------------------------------------- memory

    def param_count(self, lo: int = 0, hi: int | None = None) -> int:
        if lo == 0 and hi is None:  # the whole model: asked for by every data-parallel plan
            return self._param_total
        return sum(b.param_count for b in self.base_profile.blocks[lo:hi])

    def param_bytes(self, lo: int = 0, hi: int | None = None) -> int:
        return sum(b.param_bytes for b in self.base_profile.blocks[lo:hi])

    def trainable_count(self, lo: int = 0, hi: int | None = None) -> int:
        """Parameters of blocks lo..hi that receive a gradient: what the optimizer steps and holds state
        for.  `param_count` less the frozen ones (`BlockProfile.param_trainable`)."""
        if lo == 0 and hi is None:
            return self._trainable_total
        return sum(b.trainable_count for b in self.base_profile.blocks[lo:hi])

    def grad_bytes(self, lo: int = 0, hi: int | None = None) -> int:
        """fp32 bytes of the gradients of blocks lo..hi: what DDP buckets and all-reduces, what FSDP
        reduce-scatters.  `param_bytes` less the frozen parameters'."""
        return sum(b.trainable_bytes for b in self.base_profile.blocks[lo:hi])

    def buffer_bytes(self, lo: int = 0, hi: int | None = None) -> int:
        return sum(b.buffer_bytes for b in self.base_profile.blocks[lo:hi])

    def optim_state_bytes(self, param_count: float) -> int:
        return int(OPTIMIZER_STATE_PER_PARAM.get(self.optimizer, 2) * 4 * param_count)

    def act_bytes(self, lo: int, hi: int, mb: float, precision: str = "fp32", checkpoint_upto: int = 0) -> int:
        """Activation bytes saved for backward by blocks lo..hi at micro-batch mb.

        Blocks with index < checkpoint_upto keep only their input (the previous block's output).
        """
        if mb <= 0:
            return 0
        total = 0.0
        blocks = self.base_profile.blocks
        key = precision if precision in blocks[0].act_bytes else "fp32"
        for k in range(lo, hi):
            if k < checkpoint_upto:
                prev = blocks[k - 1].boundary_bytes_per_sample(key) if k > 0 else self.base_profile.input_bytes_per_sample
                total += prev * mb
            else:
                total += blocks[k].act_bytes[key](mb)
        return int(total)

    def recompute_s(self, dev: int, lo: int, hi: int, mb: float, precision: str, checkpoint_upto: int) -> float:
        """Extra forward time spent recomputing checkpointed blocks during backward."""
        upto = min(hi, checkpoint_upto)
        return self.fwd_s(dev, lo, upto, mb, precision) if upto > lo else 0.0
