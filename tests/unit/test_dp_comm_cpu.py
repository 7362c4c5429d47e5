"""The gradient all-reduces an emulated CPU rank runs on its own core (`rank_comm_cpu_s`)."""

from types import SimpleNamespace

import pytest
from hetsim.strategies._dp_closed import rank_comm_cpu_s


def _cost(*devices):
    return SimpleNamespace(device=lambda i: devices[i])


FAST = SimpleNamespace(speed=1.0, backend="emulated")
SLOW = SimpleNamespace(speed=0.5, backend="emulated")
GPU = SimpleNamespace(speed=1.0, backend="cuda")


def test_all_reduces_during_a_ranks_compute_take_its_real_share_of_them():
    # Two buckets ready on both ranks at 0.2 and 0.5 s; the fast rank computes until 0.9 s, the slow
    # one until 0.4 s.  Bucket 1 all-reduces from 0.2 to 0.3 s (both compute: the slow rank loses half,
    # its spins take the rest), bucket 2 from 0.5 to 0.55 s (only the fast rank still computes).
    ready = [(0.2, 0.2), (0.5, 0.5)]
    got = rank_comm_cpu_s(_cost(FAST, SLOW), (0, 1), ready, [0.9, 0.4], (0.1, 0.05))
    assert got == pytest.approx((0.15, 0.05))


def test_an_all_reduce_that_starts_after_a_ranks_compute_costs_it_nothing():
    # Bucket 1 waits for the slow rank (0.9 s): only it still computes then.  The last bucket is ready
    # when the slow rank's backward ends: no rank computes any more.
    ready = [(0.3, 0.9), (0.4, 1.0)]
    got = rank_comm_cpu_s(_cost(FAST, SLOW), (0, 1), ready, [0.4, 1.0], (0.2, 0.1))
    assert got == pytest.approx((0.0, 0.1))


def test_gpus_and_a_single_rank_lose_nothing():
    assert rank_comm_cpu_s(_cost(GPU, GPU), (0, 1), [(0.1, 0.1)], [1.0, 1.0], (0.5,)) == (0.0, 0.0)
    assert rank_comm_cpu_s(_cost(FAST), (0,), [(0.1,)], [1.0], (0.5,)) == (0.0,)
    # A GPU beside an emulated rank: only the CPU rank pays.
    assert rank_comm_cpu_s(_cost(GPU, FAST), (0, 1), [(0.1, 0.1)], [1.0, 1.0], (0.5,)) == (0.0, 0.5)
