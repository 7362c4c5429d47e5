"""Decision quality and prediction intervals: did the model order the executed plans as they ran, and
which measured steps fell outside their prediction's interval.

The main job's report and the fidelity bench both compute these figures here (one home per rule):

- **Kendall's tau** (tau-b) between predicted and measured throughput of the plans that ran;
- **top-1 regret**: 1 - (measured throughput of the plan predicted fastest) / (fastest measured
  throughput), over the same plans: what a user who trusted the ranking without running anything
  would have lost;
- a **prediction interval**: the predicted step time +- a relative half-width taken from the
  profiles' own timing spread, never narrower than a run-to-run noise floor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NOISE_FLOOR_REL = 0.05
"""The narrowest half-width of a prediction interval (a fraction of the predicted step).  From
results/README.md (fidelity runs on the 2-core emulated cluster): two whole runs of the same plan
disagree by a median 4.7 % (mean |log ratio| 6.3 %), and the block timings' sum at one micro-batch
differs by 5 % between two recordings at the same host speed.  A spread measured within one
recording (below) does not see either, so it alone would give too narrow an interval."""

SPREAD_K = 3.0
"""Half-width in units of the profile's relative median absolute deviation: for normally
distributed noise 1.4826 MAD is one standard deviation, so 3 MAD is about two (about 95 %)."""


def kendall_tau(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Kendall's tau-b rank correlation (ties counted as in scipy.stats.kendalltau)."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError(f"Kendall's tau needs two equally long series of >= 2 values, got {n} and {len(ys)}")
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx = (xs[i] > xs[j]) - (xs[i] < xs[j])
            dy = (ys[i] > ys[j]) - (ys[i] < ys[j])
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif dx == dy:
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denom if denom else 0.0


def predicted_best(predicted: Sequence[float], measured: Sequence[float]) -> int:
    """Index of the plan predicted fastest (highest predicted throughput).  Among plans tied for the
    best prediction, the one measured slowest: the model did not tell them apart, so the figure
    takes the choice that a user could have been handed and that costs most."""
    if not predicted or len(predicted) != len(measured):
        raise ValueError(f"need equally long, non-empty series, got {len(predicted)} and {len(measured)}")
    top = max(predicted)
    return min((i for i, p in enumerate(predicted) if p == top), key=lambda i: measured[i])


def top1_regret(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """1 - measured throughput of the plan predicted best / best measured throughput (0 = the model
    picked the fastest plan that ran; 0.1 = its pick was 10 % slower than the fastest)."""
    best = max(measured)
    if not best > 0:
        raise ValueError(f"top-1 regret needs a positive measured throughput, got {best}")
    return 1.0 - measured[predicted_best(predicted, measured)] / best


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionQuality:
    """How well the predictions ordered the plans that ran (throughputs: higher is better)."""

    n_plans: int
    """Plans that ran to the end and were measured (failed runs are left out)."""
    kendall_tau: float | None
    """None with fewer than two plans."""
    top1_regret: float | None
    """None with no plan; 0 with one (it is trivially the best that ran)."""
    predicted_best: int | None
    """Index (into the pairs) of the plan predicted best."""


def decision_quality(pairs: Sequence[tuple[float, float]]) -> DecisionQuality:
    """Decision quality over (predicted, measured) throughput pairs of the plans that ran."""
    pred = [p for p, _ in pairs]
    meas = [m for _, m in pairs]
    if not pairs:
        return DecisionQuality(n_plans=0, kendall_tau=None, top1_regret=None, predicted_best=None)
    return DecisionQuality(n_plans=len(pairs), kendall_tau=kendall_tau(pred, meas) if len(pairs) >= 2 else None,
                           top1_regret=top1_regret(pred, meas), predicted_best=predicted_best(pred, meas))


# ----------------------------------------------------------------------------- intervals


def profile_spread(models: Iterable[object]) -> float | None:
    """The relative timing spread of a set of model profiles (`ModelProfile.timing_spread`): the widest
    one recorded, None when no profile recorded one (profiles of format 3 and before, catalog GPUs)."""
    known = [s for s in (getattr(m, "timing_spread", None) for m in models) if s is not None]
    return max(known) if known else None


def interval_rel(spread: float | None) -> float:
    """Half-width of a prediction interval, as a step-time error (a fraction of the measured step, as
    `hetsim.reporting.metrics.rel_err`): max(SPREAD_K x spread, NOISE_FLOOR_REL); the floor alone when
    the spread is unknown."""
    return max(SPREAD_K * spread, NOISE_FLOOR_REL) if spread is not None else NOISE_FLOOR_REL


def outside_interval(predicted_s: float, measured_s: float, half_rel: float) -> bool:
    """Whether the prediction misses the measured step by more than `half_rel` of it: the step error a
    report prints beside the mark (against the measured step) beyond +-half_rel.  Until 2026-12-07 the
    band was predicted_s x (1 +- half_rel), and a gpt row printed at -4.9 % was marked outside +-5 %."""
    return abs(predicted_s - measured_s) > half_rel * measured_s


# ----------------------------------------------------------------------------- a report's rows


def outside(row) -> bool | None:
    """Whether a report row's measured step (at the profiles' host speed, as the report compares them)
    fell outside its prediction's interval; None when the row did not run to the end.  `row` is a
    hetsim.reporting.report.Row (predicted, measured, ref_probe_s, timing_spread)."""
    m = row.measured
    if m is None or not m.timed:
        return None
    return outside_interval(row.predicted.step_time_s, m.step_time_at(row.ref_probe_s), interval_rel(row.timing_spread))


def rows_decision(rows: Sequence) -> dict:
    """The report's decision figures over its rows that ran to the end: Kendall's tau and top-1 regret
    between predicted throughput and measured throughput at the profiles' host speed (global batch /
    measured step there), and the measured steps outside their prediction's interval.  Runs that
    failed (out of memory, crash, timeout) are left out: the report counts those apart."""
    ok = [r for r in rows if outside(r) is not None]
    dq = decision_quality([(r.predicted.samples_per_s, r.plan.global_batch / r.measured.step_time_at(r.ref_probe_s))
                           for r in ok])
    spreads = {r.timing_spread for r in rows}
    one = len(spreads) == 1  # the rows of one report share their profiles, hence one interval
    spread = next(iter(spreads)) if one else None
    return {
        "kendall_tau": dq.kendall_tau,
        "top1_regret": dq.top1_regret,
        "top1_plan": ok[dq.predicted_best].label if dq.predicted_best is not None else None,
        "timing_spread": spread,
        "interval_rel": interval_rel(spread) if one else None,
        "outside_interval": sum(bool(outside(r)) for r in ok),
        "outside_interval_plans": [r.label for r in ok if outside(r)],
    }


def decision_text(a: dict) -> str:
    """Kendall's tau, top-1 regret and the count outside the interval, for a report's accuracy line
    (`a`: the summary's accuracy figures, as rows_decision and the report's accuracy() give them)."""
    tau = a.get("kendall_tau")
    out = f"Kendall tau {tau:.2f}" if tau is not None else "Kendall tau n/a (fewer than two plans ran)"
    if a.get("top1_regret") is not None:
        out += f", top-1 regret {a['top1_regret'] * 100:.1f}% (predicted best: {a['top1_plan']})"
    h = a.get("interval_rel")
    if h is not None and a.get("executed_ok"):
        spread = a.get("timing_spread")
        known = "unknown" if spread is None else f"{spread * 100:.1f}%"
        why = (f"{SPREAD_K:g} x profile spread {known}" if interval_rel(spread) > NOISE_FLOOR_REL
               else f"the noise floor; profile spread {known}")
        out += (f"; {a.get('outside_interval', 0)} of {a['executed_ok']} measured steps outside their "
                f"prediction's interval (step error beyond +-{h * 100:.1f}%: {why})")
    return out
