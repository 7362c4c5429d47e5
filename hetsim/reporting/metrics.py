"""Accuracy arithmetic of predictions against measurements: relative error and MAPE, in one place."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


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
