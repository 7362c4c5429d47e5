"""The tensor-parallel shard arithmetic: the min-max split against brute force, qkv rows, groups."""

from __future__ import annotations

import itertools

import pytest
from hetsim.strategies._tp_shards import (
    TransformerDims,
    even_split,
    qkv_rows,
    shard_split,
    tensor_groups,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from hetsim.errors import InfeasiblePlanError


def _brute(total: int, speeds, granule: int = 1) -> float:
    n, g = len(speeds), total // granule
    best = float("inf")
    for cut in itertools.product(range(1, g + 1), repeat=n):
        if sum(cut) == g:
            best = min(best, max(c * granule / s for c, s in zip(cut, speeds)))
    return best


@settings(max_examples=60, deadline=None)
@given(total=st.integers(2, 12), speeds=st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0]), min_size=2, max_size=3))
def test_min_max_split_is_optimal(total, speeds):
    if total < len(speeds):
        with pytest.raises(InfeasiblePlanError):
            shard_split(total, speeds)
        return
    split = shard_split(total, speeds)
    assert sum(split) == total and min(split) >= 1
    assert max(u / s for u, s in zip(split, speeds)) == pytest.approx(_brute(total, speeds))


def test_min_max_split_granule_and_memory():
    assert shard_split(512, [1.0, 0.5], granule=8) == (344, 168)
    # Position 0 can hold at most 256 units: the rest goes to position 1.
    assert shard_split(512, [1.0, 0.5], granule=8, fits=lambda p, u: p != 0 or u <= 256) == (256, 256)
    with pytest.raises(InfeasiblePlanError):
        shard_split(512, [1.0, 0.5], granule=8, fits=lambda p, u: u <= 200)


def test_qkv_rows_hold_q_k_and_v_of_the_same_heads():
    dims = TransformerDims(n_layer=1, n_head=4, d_model=8, hidden=32, seq_len=4, layer_blocks=(1,))
    rows = qkv_rows(dims, (3, 1), 1)  # the last head: units 6..7 of q, k and v
    assert rows == [6, 7, 14, 15, 22, 23]
    every = sorted(qkv_rows(dims, (3, 1), 0) + rows)
    assert every == list(range(24))
    assert even_split(10, 3) == (4, 3, 3)


def test_tensor_groups():
    speeds = [1.0, 1.0, 0.5, 0.5]
    same = lambda a, b: 1.0  # noqa: E731
    assert tensor_groups(range(4), 2, speeds, same, "fast_links") == ((0, 1), (2, 3))
    assert tensor_groups(range(4), 2, speeds, same, "strided") == ((0, 2), (1, 3))
    fast = lambda a, b: 10.0 if {a, b} in ({0, 3}, {1, 2}) else 1.0  # noqa: E731
    assert tensor_groups(range(4), 2, speeds, fast, "fast_links") == ((0, 3), (1, 2))
