"""Accuracy arithmetic of predictions against measurements: relative error, MAPE, host speed, out-of-memory detail."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hetsim.reporting.decision import rows_decision
from hetsim.reporting.rows import Row
from hetsim.serial import to_dict


def rel_err(predicted: float, measured: float) -> float:
    """Signed relative error of a prediction, as a fraction of the measured value."""
    return (predicted - measured) / measured


def mape_of(rel_errors: Iterable[float]) -> float:
    """Mean absolute percentage error (as a fraction) of signed relative errors."""
    errs = [abs(e) for e in rel_errors]
    if not errs:
        raise ValueError("MAPE of no pairs: nothing was measured")
    return sum(errs) / len(errs)


def mape(pairs: Sequence[tuple[float, float]]) -> float:
    """Mean absolute percentage error (as a fraction) over (predicted, measured) pairs."""
    return mape_of(rel_err(p, m) for p, m in pairs)


def err_pct(row: Row) -> float | None:
    """The row's step-time error in percent, against the measured step at the profiles' host speed."""
    m = row.measured
    if m is None or not m.timed:
        return None
    return 100.0 * rel_err(row.predicted.step_time_s, m.step_time_at(row.ref_probe_s))


def host_speed(row: Row) -> float | None:
    """How fast the host ran during the row's run relative to when its profiles were recorded
    (profile probe / run probe: 0.8 = 20% slower), None when not probed."""
    m = row.measured
    if m is None or not m.probe_s or not row.ref_probe_s:
        return None
    return row.ref_probe_s / m.probe_s


def mem_err_pct(row: Row) -> list[float] | None:
    """Per device, the peak-memory error in percent."""
    m = row.measured
    if m is None or m.status != "ok" or not m.peak_mem_bytes:
        return None
    return [100.0 * rel_err(p, q) for p, q in zip(row.predicted.peak_mem_bytes, m.peak_mem_bytes)]


def speedup(row: Row, base: Row | None) -> float | None:
    """Measured throughput of the row over the baseline's (None unless both ran)."""
    if base is None or base.measured is None or base.measured.status != "ok" or row.measured is None or row.measured.status != "ok":
        return None
    return row.measured.samples_per_s / base.measured.samples_per_s


def oom_detail(row: Row) -> dict:
    """A plan predicted to fit that ran out of memory: where, and by how many bytes the prediction was short.

    The failing rank's measured peak is known when its accounting caught the overflow (emulated
    devices); otherwise (a real CUDA out-of-memory) only a lower bound is: the device's capacity.
    """
    m = row.measured
    p = row.predicted
    rank = m.failed_rank if m is not None and m.failed_rank is not None and m.failed_rank < len(p.peak_mem_bytes) else None
    devices = list(getattr(row.plan, "devices", range(len(p.peak_mem_bytes))))
    out = {"label": row.label, "plan": to_dict(row.plan), "rank": rank,
           "device": devices[rank] if rank is not None and rank < len(devices) else None,
           "predicted_bytes": p.peak_mem_bytes[rank] if rank is not None else None,
           "capacity_bytes": p.capacity_bytes[rank] if rank is not None and rank < len(p.capacity_bytes) else None,
           "measured_bytes": m.failed_peak_bytes if m is not None else None,
           "under_predicted_bytes": None, "at_least": False}
    if rank is not None:
        if out["measured_bytes"] is not None:
            out["under_predicted_bytes"] = out["measured_bytes"] - out["predicted_bytes"]
        elif out["capacity_bytes"] is not None:
            out["under_predicted_bytes"] = out["capacity_bytes"] - out["predicted_bytes"]
            out["at_least"] = True
    return out


def oom_text(d: dict) -> str:
    """One line for an `oom_detail`: rank, device, predicted, measured and the under-prediction."""
    if d["rank"] is None:
        return f"{d['label']}: out of memory on an unknown rank (see its error below)"
    under = d["under_predicted_bytes"]
    amount = "?" if under is None else f"{'at least ' if d['at_least'] else ''}{under / 2**20:.1f} MiB ({under} bytes)"
    measured = ("unknown (at least the capacity)" if d["measured_bytes"] is None
                else f"{d['measured_bytes'] / 2**20:.1f} MiB")
    return (f"{d['label']}: rank {d['rank']} (device {d['device']}) predicted {d['predicted_bytes'] / 2**20:.1f} MiB "
            f"of {(d['capacity_bytes'] or 0) / 2**20:.1f} MiB, measured {measured}: under-predicted by {amount}")


def accuracy(rows: list[Row]) -> dict:
    """The run's accuracy: step-time and peak-memory MAPE over executed plans, out-of-memory surprises."""
    errs = [e / 100 for e in (err_pct(r) for r in rows) if e is not None]
    merrs = [x / 100 for r in rows for x in (mem_err_pct(r) or [])]
    executed = [r for r in rows if r.measured is not None]
    oom_fit = [r for r in executed if r.measured.status == "oom" and r.predicted.feasible]
    return {
        "executed": len(executed),
        "executed_ok": len(errs),
        "step_time_mape": mape_of(errs) if errs else None,
        "step_time_max_err": max(abs(e) for e in errs) if errs else None,
        "peak_mem_mape": mape_of(merrs) if merrs else None,
        "oom_predicted_to_fit": len(oom_fit),
        "oom_predicted_to_fit_plans": [oom_detail(r) for r in oom_fit],
        **rows_decision(rows),
    }
