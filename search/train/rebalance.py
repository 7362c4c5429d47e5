"""Rebalancing a data-parallel plan while it trains: measured compute re-solves the batch split.

Every N steps the ranks share their records of the last N steps (a window).

- **The split.** Each rank's forward and backward time (timed by hooks) is taken as proportional
  to its share, at its median time per sample over the window; the split that minimises the
  slowest rank's compute is solved exactly by the search's own solver
  (`hetsim.model.batchsplit.min_max_split`).  Only compute is balanced: the optimizer step comes
  after the gradient all-reduce, where the ranks meet, so every step pays the slowest rank's
  optimizer whatever the split (balancing it too took samples away from a slowed rank for the
  time of its slowed optimizer, which no split removes).
- **The prediction.** The window's steps are replayed with every rank's compute scaled to its new
  share, plus that step's slowest optimizer and its remaining time (communication, waiting), and
  the median taken over the steps of the slowest rank: the statistic the run's throughput is
  measured with.  When the ranks time a host-speed probe before each step
  (`hetsim.profiling.hostspeed`), the replayed steps are expressed at the window's median probe,
  and the steps the prediction is compared with are expressed at the same probe.
- **Hysteresis.** A new split replaces the current one only when its prediction is at least
  `MIN_GAIN` faster than the same replay of the current split: a smaller gain is within one
  window's noise, and following it would have the split wander from window to window.

The new shares apply from the next step: no restart, no new process group.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hetsim.search.train.monitor import StepRecord

from hetsim.model.batchsplit import min_max_split
from hetsim.profiling.hostspeed import at_ref, shared_probes

MIN_GAIN = 0.03
"""The smallest predicted gain (relative step time) a new split must bring to replace the current one."""


@dataclass(frozen=True)
class Decision:
    shares: tuple[int, ...]
    predicted_step_s: float
    """The replayed window's step time with `shares`, at host speed `probe_s`."""
    current_step_s: float
    """The same replay with the shares the window ran with."""
    probe_s: float
    """The host-speed probe time the predictions are expressed at (0: raw, no probes)."""

    @property
    def changes(self) -> bool:
        return self.predicted_step_s <= (1.0 - MIN_GAIN) * self.current_step_s


def per_sample_s(records: Sequence[StepRecord]) -> float:
    """One rank's median compute time per sample over `records`."""
    per = [r.compute_s / r.samples for r in records if r.samples]
    return statistics.median(per) if per else 0.0


def resolve(per_sample: Sequence[float], global_batch: int, floor: int) -> tuple[int, ...]:
    """The split of `global_batch` (each share at least `floor`) that minimises the slowest rank's
    compute, every rank's compute proportional to its share."""
    return min_max_split(len(per_sample), global_batch, floor, lambda i, b: per_sample[i] * b)


def window_probes(window: Sequence[Sequence[StepRecord]]) -> list[float]:
    """One host-speed probe per step of the window (the ranks' mean); empty when a rank has none."""
    return shared_probes([[r.probe_s for r in recs] for recs in window])


def replay_step_s(window: Sequence[Sequence[StepRecord]], shares: Sequence[int],
                  probes: Sequence[float] = ()) -> tuple[float, float]:
    """(median replayed step time with `shares`, the probe it is expressed at): see the module's doc.
    `probes`: the window's `window_probes` (raw times without)."""
    steps = []
    for i in range(len(window[0])):
        recs = [w[i] for w in window]
        compute = max(r.compute_s for r in recs)
        opt = max(r.optimizer_s for r in recs)
        rest = max(0.0, max(r.wall_s for r in recs) - compute - opt)
        scaled = max(r.compute_s * s / r.samples if r.samples else 0.0 for r, s in zip(recs, shares))
        steps.append(scaled + opt + rest)
    ref = statistics.median(probes) if probes else 0.0
    return statistics.median(at_ref(steps, probes, ref)), ref


def decide(window: Sequence[Sequence[StepRecord]], global_batch: int, floor: int) -> Decision:
    """Re-solve the split from one window of every rank's records (rank order)."""
    shares = resolve([per_sample_s(recs) for recs in window], global_batch, floor)
    current = tuple(recs[-1].samples for recs in window)
    probes = window_probes(window)
    predicted, ref = replay_step_s(window, shares, probes)
    now, _ = replay_step_s(window, current, probes)
    return Decision(shares=shares, predicted_step_s=predicted, current_step_s=now, probe_s=ref)


def compare_last(every: Sequence[Sequence[StepRecord]], rebalances: Sequence[dict], n: int = 20) -> dict | None:
    """The last `n` steps against the predictions of the splits they ran with: the median of their
    predictions and the median measured step (slowest rank), the latter expressed at each
    prediction's host speed when the steps were probed (raw beside it).  None when fewer than `n`
    steps ran or none of them ran with a re-solved split."""
    if len(every[0]) < n or not rebalances:
        return None
    last = [recs[-n:] for recs in every]
    probes = window_probes(last)
    preds, meas, raw = [], [], []
    for i in range(n):
        step = last[0][i].step
        active = [rb for rb in rebalances if rb["step"] <= step]
        if not active:
            continue
        rb = active[-1]
        wall = max(recs[i].wall_s for recs in last)
        ref = rb.get("probe_s", 0.0)
        preds.append(rb["predicted_step_s"])
        raw.append(wall)
        meas.append(at_ref([wall], [probes[i]], ref)[0] if probes and ref else wall)
    if not preds:
        return None
    pred, m, r = statistics.median(preds), statistics.median(meas), statistics.median(raw)
    # A ratio of step times, predicted over measured: the measured throughput's share of the predicted.
    return {"steps": len(preds), "predicted_step_s": pred, "measured_step_s": m, "measured_raw_step_s": r,
            "ratio": pred / m, "ratio_raw": pred / r}
