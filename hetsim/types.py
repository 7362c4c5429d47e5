"""Plain, frozen, JSON round-trippable values shared by every stage of the flow.

Units are in field names (`_s`, `_bytes`, `_bps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

REAL_DROP = 0.15
"""A measured time that falls by more than this fraction from one batch size to the next is a real
drop, not timing noise (`Fit.measured`); a point timed as the median of three rounds scatters by a
few percent here."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """y = intercept + slope * x, fitted by least squares; or, where the points it was fitted to are
    kept (`knots`), the line through them piece by piece."""

    intercept: float
    slope: float
    knots: tuple[tuple[float, float], ...] = ()
    """Measured (x, y) points, x ascending, y non-decreasing but for real drops (`Fit.measured`).
    With two or more, y is interpolated between neighbouring points and continued past either end along the end
    segment; intercept and slope stay the least-squares line.  Time is not linear in the batch on
    every device: on a CPU a block costs about half as much per sample at 20 samples as at 255 (the
    small batch's tensors stay in cache), so a line through 2..255 over-charges a gradient-cache
    chunk of 20 by ~80%."""

    def __call__(self, x: float) -> float:
        k = self.knots
        if len(k) < 2:
            return max(0.0, self.intercept + self.slope * x)
        return max(0.0, _between(k, x))

    def residual(self, x: float) -> float:
        """This fit read as a calibrated residual, which may be negative (no floor at zero): the line, or
        with knots the line through them piece by piece, held at the end knots' values beyond them (a
        residual measured at a few plans says nothing of a trend past them)."""
        k = self.knots
        if len(k) < 2:
            return self.intercept + self.slope * x
        return _between(k, min(max(x, k[0][0]), k[-1][0]))

    @staticmethod
    def measured(xs: list[float], ys: list[float]) -> Fit:
        """The least-squares line of `least_squares`, keeping the points as knots, points at one x
        averaged: y made non-decreasing in x by pooling adjacent violators (timing noise never makes a
        larger batch cheaper), except across a drop of more than `REAL_DROP`, which is kept.

        Why a drop is kept: oneDNN picks its convolution kernels by the batch, and a larger batch can
        be far cheaper.  resnet50@64 fp32 on an AMD EPYC (torch 2.14, one thread), a training step:
        0.55 s at 15 samples, 0.28 s at 16; its last three blocks cost more at 8 samples than at 31.
        Pooling made those blocks flat from 8 to 31, which predicted 16 samples 7 % slow and 10-15
        (interpolated between 8 and 16) 30-40 % fast."""
        line = Fit.least_squares(xs, ys)
        by_x: dict[float, list[float]] = {}
        for x, y in zip(xs, ys):
            by_x.setdefault(float(x), []).append(float(y))
        pts = sorted((x, sum(v) / len(v)) for x, v in by_x.items())
        if len(pts) < 2:
            return line
        ys = [p[1] for p in pts]
        cuts = [0] + [i + 1 for i in range(len(ys) - 1) if ys[i + 1] < ys[i] * (1 - REAL_DROP)] + [len(ys)]
        kept = [y for a, b in zip(cuts, cuts[1:]) for y in _non_decreasing(ys[a:b])]
        return Fit(intercept=line.intercept, slope=line.slope, knots=tuple(zip((p[0] for p in pts), kept)))

    @staticmethod
    def least_squares(xs: list[float], ys: list[float], nonneg: bool = True) -> Fit:
        """Least-squares line; with nonneg, a negative slope (timing noise) becomes a flat mean, so
        that time and bytes never decrease with size (the batch-split solver relies on it)."""
        n = len(xs)
        if n == 1:
            return Fit(intercept=0.0, slope=ys[0] / xs[0] if xs[0] else 0.0)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        if nonneg and slope < 0:
            return Fit(intercept=my, slope=0.0)
        return Fit(intercept=my - slope * mx, slope=slope)


def _between(k: tuple[tuple[float, float], ...], x: float) -> float:
    """The line through knots `k` (two or more, x ascending) piece by piece at x, continued past either
    end along the end segment."""
    i = 1
    while i < len(k) - 1 and x > k[i][0]:
        i += 1
    (x0, y0), (x1, y1) = k[i - 1], k[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _non_decreasing(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ys in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks[-1]
            blocks[-2:] = [[(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]]
    return [m for m, n in blocks for _ in range(int(n))]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes one device holds at its peak, by category."""

    params_bytes: int = 0
    grads_bytes: int = 0
    optim_bytes: int = 0
    activations_bytes: int = 0
    other_bytes: int = 0
    """Communication buffers, temporaries, fixed overhead."""
    host_bytes: int = 0
    """Bytes moved to host memory by offload (not counted in total_bytes)."""

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optim_bytes + self.activations_bytes + self.other_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    step_time_s: float
    samples_per_s: float
    peak_mem_bytes: tuple[int, ...]
    """Per device of the plan, in plan order."""
    memory: tuple[MemoryBreakdown, ...]
    capacity_bytes: tuple[int, ...]
    feasible: bool
    violations: tuple[str, ...] = ()
    """Why infeasible: which device, how many bytes over."""
    bubble_fraction: float = 0.0
    breakdown_s: dict[str, float] = field(default_factory=dict)
    """Where the step's time goes on the critical device (compute, exposed comm, optimizer...)."""
    warnings: tuple[str, ...] = ()
    """Feasible but questionable (e.g. BatchNorm statistics over a tiny per-device batch)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    status: str
    """'ok', 'oom', 'timeout', 'error' (a crash, a signal) or 'nonfinite' (loss became NaN/inf)."""
    step_time_s: float | None = None
    samples_per_s: float | None = None
    peak_mem_bytes: tuple[int, ...] | None = None
    memory: tuple[MemoryBreakdown, ...] | None = None
    error: str | None = None
    rank_median_step_s: tuple[float, ...] = ()
    """Median step time of each rank (hetsim.execution.worker.RankResult.step_s has every step)."""
    wall_s: float = 0.0
    failed_rank: int | None = None
    """Plan rank whose failure ended the run (None: ok, a timeout, or unknown)."""
    failed_peak_bytes: int | None = None
    """That rank's measured peak bytes when it had measured one (an out-of-memory rank's accounting)."""
    probe_s: float | None = None
    """Median host-speed probe of the run (hetsim.profiling.hostspeed; None when not probed, e.g. on GPUs)."""
    steps_per_probe: float | None = None
    """The step time in probe units: each step over the ranks' mean probe taken before it
    (hetsim.profiling.hostspeed.shared_probes) raised to `probe_elasticity`, median per rank, slowest
    rank (None when not probed)."""
    probe_elasticity: float = 1.0
    """The exponent `steps_per_probe` was taken with (hetsim.profiling.hostspeed.ELASTICITY when the
    run was measured; 1.0 in measurements written before the exponent existed, which divided by the
    probe itself)."""
    step_starts_s: tuple[tuple[float, ...], ...] = ()
    """The measured timeline: per rank, each timed step's start in seconds after the earliest
    rank's first timed step (empty when not recorded)."""
    step_durations_s: tuple[tuple[float, ...], ...] = ()
    """Per rank, each timed step's duration in seconds (same order as step_starts_s)."""
    runs_at_probe: tuple[float, ...] = ()
    """When the plan ran more than once (`python -m hetsim.search --repeats`): each run's step in probe
    times (its `steps_per_probe`; its raw step time when unprobed); this measurement holds their median."""

    @property
    def timed(self) -> bool:
        """The run finished and measured a step time (every figure of merit needs one)."""
        return self.status == "ok" and bool(self.step_time_s)

    def step_time_at(self, ref_probe_s: float) -> float | None:
        """The measured step time at the host speed whose probe time is `ref_probe_s` (a profile's
        `probe_s`); the raw step time when either side was not probed."""
        if self.steps_per_probe is None or not ref_probe_s:
            return self.step_time_s
        return self.steps_per_probe * ref_probe_s ** self.probe_elasticity


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineEvent:
    resource: str
    kind: str
    label: str
    start_s: float
    end_s: float
