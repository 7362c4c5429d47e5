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


EXACT_CELLS = 50_000
"""Largest n x (spare samples + 1)^2 that `min_max_split` searches exactly when times are not monotone
in the batch (a two-device split of 32 samples: 1,922; beyond it the greedy split stands)."""


def min_max_split(n: int, total: int, floor: int, time_of: Callable[[int, int], float],
                  fits: Callable[[int, int], bool] = lambda i, b: True, monotone: bool = True) -> tuple[int, ...]:
    """Exact min-max split of `total` samples over `n` workers, each at least `floor`: each next
    sample goes to the worker that would finish it soonest (`time_of(i, b)`: worker i's time with
    b samples, non-decreasing in b, so the greedy is optimal for the slowest worker).  Workers whose
    next sample would not fit (`fits`) take no more while that is possible; when it is not, memory
    is ignored (the caller's memory check refuses).

    A heap of (time with one more sample, position) keeps the greedy at O(total log n) time
    evaluations; ties go to the lowest position, as a linear scan would.  A worker that cannot fit
    one more sample never can later (its share no longer changes), so it leaves the heap for good.

    `monotone=False` (a worker's time falls somewhere as its batch grows, `Fit.measured`): the greedy
    would stop short of the cheaper larger batch, so a small enough split (`EXACT_CELLS`) is searched
    exactly (`_exact_split`) and the better of the two kept.
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
    if monotone or n * (extra + 1) ** 2 > EXACT_CELLS:
        return tuple(local)
    exact = _exact_split(n, extra, floor, time_of, fits)

    def slowest(split) -> float:
        return max(time_of(i, b) for i, b in enumerate(split))

    return exact if exact is not None and slowest(exact) < slowest(local) else tuple(local)


def _exact_split(n: int, extra: int, floor: int, time_of: Callable[[int, int], float],
                 fits: Callable[[int, int], bool]) -> tuple[int, ...] | None:
    """The min-max split by dynamic programming over the workers (every share of the `extra` samples
    beyond `floor` each), for times of any shape; memory as in `min_max_split`."""
    for respect_memory in (True, False):
        best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
        for i in range(n):
            opts = [(b, time_of(i, floor + b)) for b in range(extra + 1)
                    if b == 0 or not respect_memory or fits(i, floor + b)]
            nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
            for s, (t, shares) in best.items():
                for b, tb in opts:
                    if s + b > extra:
                        break
                    cand = max(t, tb)
                    if s + b not in nxt or cand < nxt[s + b][0]:
                        nxt[s + b] = (cand, shares + (floor + b,))
            best = nxt
        if extra in best:
            return best[extra][1]
    return None
