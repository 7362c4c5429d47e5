"""Plain, frozen, JSON round-trippable values shared by every stage of the flow.

Units are in field names (`_s`, `_bytes`, `_bps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """y = intercept + slope * x, fitted by least squares."""

    intercept: float
    slope: float

    def __call__(self, x: float) -> float:
        return max(0.0, self.intercept + self.slope * x)

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
    """The step time in probe times: each step over the ranks' mean probe taken before it
    (hetsim.profiling.hostspeed.shared_probes), median per rank, slowest rank (None when not probed)."""
    step_starts_s: tuple[tuple[float, ...], ...] = ()
    """The measured timeline: per rank, each timed step's start in seconds after the earliest
    rank's first timed step (empty when not recorded)."""
    step_durations_s: tuple[tuple[float, ...], ...] = ()
    """Per rank, each timed step's duration in seconds (same order as step_starts_s)."""

    def step_time_at(self, ref_probe_s: float) -> float | None:
        """The measured step time at the host speed whose probe time is `ref_probe_s` (a profile's
        `probe_s`); the raw step time when either side was not probed."""
        if self.steps_per_probe is None or not ref_probe_s:
            return self.step_time_s
        return self.steps_per_probe * ref_probe_s


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineEvent:
    resource: str
    kind: str
    label: str
    start_s: float
    end_s: float
