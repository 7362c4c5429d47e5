"""How a batch divides: evenly into parts, or min-max over workers of different speeds (the rule
the search's data-parallel split and hetsim.search.train's rebalancing share)."""

from __future__ import annotations

import heapq
from collections.abc import Callable


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` samples in `parts` parts as evenly as possible (the first ones take the remainder):
    a local batch into accumulation micro-batches, or a global batch into equal local batches."""
    base, rem = divmod(total, parts)
    return [base + (1 if j < rem else 0) for j in range(parts)]


def min_max_split(n: int, total: int, floor: int, time_of: Callable[[int, int], float],
                  fits: Callable[[int, int], bool] = lambda i, b: True) -> tuple[int, ...]:
    """Exact min-max split of `total` samples over `n` workers, each at least `floor`: each next
    sample goes to the worker that would finish it soonest (`time_of(i, b)`: worker i's time with
    b samples, non-decreasing in b, so the greedy is optimal for the slowest worker).  Workers whose
    next sample would not fit (`fits`) take no more while that is possible; when it is not, memory
    is ignored (the caller's memory check refuses).

    A heap of (time with one more sample, position) keeps the greedy at O(total log n) time
    evaluations; ties go to the lowest position, as a linear scan would.  A worker that cannot fit
    one more sample never can later (its share no longer changes), so it leaves the heap for good.
    """
    extra = total - floor * n
    for respect_memory in (True, False):
        local = [floor] * n
        heap = [(time_of(i, floor + 1), i) for i in range(n)]
        heapq.heapify(heap)
        placed = 0
        while placed < extra and heap:
            _, i = heapq.heappop(heap)
            if respect_memory and not fits(i, local[i] + 1):
                continue
            local[i] += 1
            placed += 1
            heapq.heappush(heap, (time_of(i, local[i] + 1), i))
        if placed == extra:
            break
    return tuple(local)
