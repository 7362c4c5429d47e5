"""Rebalancing a data-parallel plan while it trains: measured compute re-solves the batch split.

Every N steps each rank reports, over the last N steps, its median compute time per sample and
its median fixed time (the optimizer step).  Rank r's time with b samples is modelled as
`a_r * b + c_r`, and the split that minimises the slowest rank's time is solved exactly by the
search's own solver (`hetsim.model.batchsplit.min_max_split`).  The new shares apply from the next
step; no restart, no new process group.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from hetsim.search.train.monitor import StepRecord

from hetsim.model.batchsplit import min_max_split


@dataclass(frozen=True)
class Rates:
    per_sample_s: float
    fixed_s: float


def rates_of(records: list[StepRecord]) -> Rates:
    """One rank's median compute per sample and fixed time over `records`."""
    per = [r.compute_s / r.samples for r in records if r.samples]
    fixed = [r.optimizer_s for r in records]
    return Rates(statistics.median(per) if per else 0.0, statistics.median(fixed) if fixed else 0.0)


def resolve(rates: list[Rates], global_batch: int, floor: int) -> tuple[tuple[int, ...], float]:
    """(new shares, predicted compute step time of the slowest rank) for the measured rates."""
    def time_of(i: int, b: int) -> float:
        return rates[i].per_sample_s * b + rates[i].fixed_s

    shares = min_max_split(len(rates), global_batch, floor, time_of)
    return shares, max(time_of(i, b) for i, b in enumerate(shares))
