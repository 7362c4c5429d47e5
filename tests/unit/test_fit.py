"""Fits of measured timings: the least-squares line, and the measured points kept as knots."""

from __future__ import annotations

import pytest

from hetsim.profiling.obtain import micro_batch_sizes
from hetsim.serial import from_dict, to_dict
from hetsim.types import Fit


def test_knots_pass_through_the_measured_points():
    """A convex curve (per-sample cost rising with the batch, as on a CPU out of cache): the line
    through every point misses the small sizes; the knots hit every point and interpolate between."""
    xs = [2, 16, 32, 64, 128, 255]
    ys = [0.002 * x + 0.00004 * x * x for x in xs]
    f = Fit.measured(xs, ys)
    line = Fit.least_squares(xs, ys)
    assert (f.intercept, f.slope) == (line.intercept, line.slope)
    for x, y in zip(xs, ys):
        assert f(x) == pytest.approx(y)
    assert f(24) == pytest.approx((ys[1] + ys[2]) / 2)
    assert abs(line(20) - (0.002 * 20 + 0.00004 * 400)) > 0.3 * (0.002 * 20 + 0.00004 * 400)
    # past either end: along the end segment, never negative
    assert f(300) == pytest.approx(ys[-1] + (ys[-1] - ys[-2]) / (255 - 128) * 45)
    assert f(0) >= 0.0


def test_knots_never_decrease_by_noise():
    """Timing noise that makes a larger batch look cheaper (here by 8 %) is pooled: time never falls
    with size."""
    f = Fit.measured([2, 64, 128, 255], [0.02, 0.6, 0.55, 3.0])
    assert [y for _, y in f.knots] == pytest.approx([0.02, 0.575, 0.575, 3.0])
    sizes = range(1, 300)
    vals = [f(x) for x in sizes]
    assert all(b >= a for a, b in zip(vals, vals[1:]))


def test_a_real_drop_is_kept():
    """A drop of more than REAL_DROP is a library changing kernels (resnet50@64 fp32 on a CPU: 0.55 s a
    step at 15 samples, 0.28 s at 16), kept; the noise on either side of it is still pooled."""
    from hetsim.types import REAL_DROP

    f = Fit.measured([2, 8, 12, 15, 16, 31], [0.11, 0.31, 0.30, 0.55, 0.28, 0.49])
    assert 0.28 < 0.55 * (1 - REAL_DROP)
    assert [y for _, y in f.knots] == pytest.approx([0.11, 0.305, 0.305, 0.55, 0.28, 0.49])
    assert f(16) == pytest.approx(0.28) and f(15) == pytest.approx(0.55)
    assert f(10) == pytest.approx(0.305)


def test_one_point_and_old_files_are_lines():
    assert Fit.measured([8], [0.4]).knots == ()
    assert Fit.measured([8], [0.4])(16) == pytest.approx(0.8)
    old = from_dict(Fit, {"intercept": 0.1, "slope": 0.01})  # a format-4 profile's fit
    assert old.knots == () and old(10) == pytest.approx(0.2)
    f = Fit.measured([2, 4, 8], [1.0, 2.0, 5.0])
    assert from_dict(Fit, to_dict(f)) == f


def test_coupled_workloads_are_profiled_at_gradient_cache_chunks():
    plain = micro_batch_sizes(256, 2)
    coupled = micro_batch_sizes(256, 2, coupled=True)
    assert plain == (2, 64, 128, 255)
    assert coupled == (2, 16, 32, 64, 128, 255)
