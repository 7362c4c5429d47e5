"""What a report is made of: one row per executed or predicted plan, and the run around them."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetsim.types import Measurement, Prediction, TimelineEvent


@dataclass
class Row:
    place: int
    """Position in the report's table (1 = best predicted; the baseline is 0)."""
    label: str
    plan: object
    predicted: Prediction
    measured: Measurement | None
    ref_probe_s: float = 0.0
    """The profiles' host-speed probe (hetsim.profiling.hostspeed): a probed run's step is compared with the
    prediction at that host speed.  0: compare raw times (GPUs, unprobed profiles)."""
    timing_spread: float | None = None
    """The profiles' relative timing spread (hetsim.reporting.decision.profile_spread; None: unknown):
    the prediction's interval is derived from it."""


@dataclass
class ReportData:
    study: str
    model: str
    cluster: object  # hetsim.hardware.cluster.Cluster
    global_batch: int
    candidates: list[Row]
    baseline: Row | None
    trials: object
    """The study's trials: a pandas DataFrame (`study.trials_dataframe()`) or a list of dicts."""
    timeline: list[TimelineEvent] = field(default_factory=list)
    timeline_label: str = ""
    notes: list[str] = field(default_factory=list)
    history: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_sample: int = 0
    """Tokens in one sample (sequence models): the table also shows tokens/s.  0: not a sequence model."""

    def rows(self) -> list[Row]:
        """The candidates, then the baseline when there is one."""
        return self.candidates + ([self.baseline] if self.baseline else [])

    def tag(self, row: Row) -> str:
        """How the row is named in tables and figures: its place, or 'base'."""
        return "base" if row is self.baseline else str(row.place)
