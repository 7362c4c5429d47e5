"""Stage boundaries of a pipeline, shared by the `pipeline` and `hybrid` families: the exact
dynamic programme over contiguous block ranges that minimises the analytic step time under every
device's memory cap, and its element costs from the cost model."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetsim.errors import InfeasiblePlanError

from ._pipeline_memory import stage_state
from ._pipeline_sched import action_term

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel


@dataclass(frozen=True, slots=True)
class Lane:
    """One pipeline that shares the boundaries: the device of each stage and its micro-batch size."""

    stage_devices: tuple[int, ...]
    micro: int


Elem = Callable[[int, int, int], "tuple[float, float] | None"]
"""elem(stage, lo, hi) -> (seconds on the critical path, per-micro-batch bottleneck seconds), or None
when blocks lo..hi cannot be stage `stage` (memory)."""


Rows = list[dict[int, list[tuple[int, float, float]]]]
"""rows[s][lo]: the feasible (hi, a, peak) of stage s starting at block lo, hi ascending."""


def min_sum_plus_max(n_stages: int, n_blocks: int, elem: Elem, weight: float) -> tuple[float, tuple[int, ...]]:
    """Exact minimum over contiguous partitions of blocks 0..n into n_stages non-empty ranges of
    sum(a) + weight * max(peak), and the boundaries that reach it.

    For a bound B on max(peak), a chain DP gives the least sum(a) with every peak <= B.  The
    optimum's own max(peak) is one of the elements' peaks, so trying every candidate B (in
    increasing order, stopping once weight * B alone cannot beat the best) is exact.
    """
    if n_stages < 1 or n_stages > n_blocks:
        raise InfeasiblePlanError(f"{n_stages} stage(s) cannot split {n_blocks} block(s) into non-empty ranges")
    rows, peaks = _feasible_rows(n_stages, n_blocks, elem)
    free = _least_sum_chain(rows, n_blocks, math.inf)
    if free is None:
        raise InfeasiblePlanError(
            f"no split of the {n_blocks} blocks into {n_stages} stages fits every stage's device memory; "
            "use more stages, fewer micro-batches in flight (1F1B), checkpointing, or devices with more memory"
        )
    if weight <= 0:
        return free[0], free[1]
    floor_sum = free[0]
    best_val, best_bounds = math.inf, free[1]
    lowest = _least_bottleneck(rows, n_blocks)
    for bound in sorted({p for p in peaks if p >= lowest}):
        if floor_sum + weight * bound >= best_val:
            break
        got = _least_sum_chain(rows, n_blocks, bound)
        if got is None:
            continue
        val = got[0] + weight * bound
        if val < best_val:
            best_val, best_bounds = val, got[1]
    return best_val, best_bounds


def _feasible_rows(n_stages: int, n_blocks: int, elem: Elem) -> tuple[Rows, list[float]]:
    """Every feasible element (stage s, blocks lo..hi) as `Rows`, and the peak of each."""
    table: dict[tuple[int, int, int], tuple[float, float]] = {}
    for s in range(n_stages):
        # Stage s starts at >= s and leaves >= 1 block for every later stage.
        for lo in range(s, n_blocks - (n_stages - s) + 1):
            his = [n_blocks] if s == n_stages - 1 else range(lo + 1, n_blocks - (n_stages - s - 1) + 1)
            if s == 0 and lo != 0:
                continue
            for hi in his:
                e = elem(s, lo, hi)
                if e is not None:
                    table[(s, lo, hi)] = e
    rows: Rows = [{} for _ in range(n_stages)]
    for (s, lo, hi), (a, peak) in sorted(table.items()):
        rows[s].setdefault(lo, []).append((hi, a, peak))
    return rows, [e[1] for e in table.values()]


def _least_sum_chain(rows: Rows, n_blocks: int, bound: float) -> tuple[float, tuple[int, ...]] | None:
    """The least sum(a) over the partitions whose every peak is <= bound, and its boundaries (None: none)."""
    best = {0: (0.0, (0,))}  # after stage s-1: end block -> (sum, boundaries)
    for row in rows:
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for lo, (acc, bounds) in best.items():
            for hi, a, peak in row.get(lo, ()):
                if peak > bound:
                    continue
                cand = acc + a
                if hi not in nxt or cand < nxt[hi][0]:
                    nxt[hi] = (cand, bounds + (hi,))
        best = nxt
    return best.get(n_blocks)


def _least_bottleneck(rows: Rows, n_blocks: int) -> float:
    """The smallest achievable max(peak) (a min-max chain DP): no smaller bound is feasible."""
    best = {0: 0.0}
    for row in rows:
        nxt: dict[int, float] = {}
        for lo, worst in best.items():
            for hi, _, peak in row.get(lo, ()):
                w = max(worst, peak)
                if hi not in nxt or w < nxt[hi]:
                    nxt[hi] = w
        best = nxt
    return best.get(n_blocks, math.inf)


def step_elements(cost: CostModel, lanes: Sequence[Lane], n_stages: int, precision: str, ckpt: int,
                  inflight: Sequence[int], tail_s: Callable[[int, int, int, int], float] | None = None,
                  schedule: str = "GPipe", m: int = 1) -> Elem:
    """Element costs of the analytic step time that `solve_boundaries` minimises.

    For one lane (pipeline) with per-micro-batch stage times c_s (forward + backward +
    recomputation) and link times l_s (activation out, gradient back), m micro-batches:

        step = sum_s (c_s + l_s) + (m - 1) * v * max_s max(c_s, l_s) + tail

    (fill and drain cross every stage once; the steady state runs at the slowest stage or
    link; a rank with v stages runs v of them per round, v read off the lanes' placement).  The tail
    is the optimizer step (and, for hybrid, the gradient all-reduce) of stage 0, which finishes the step.
    `schedule` picks the calibrated per-action term (`_pipeline_sched.action_term`).  With several
    lanes, each term takes the slowest lane.  Memory: each stage's parameters, gradients,
    optimizer state and `inflight[s]` micro-batches of activations must fit its device.
    """
    nb = cost.facts.n_blocks
    v = n_stages // len(set(lanes[0].stage_devices)) if lanes else 1
    prefix: dict[tuple[int, int], list[float]] = {}
    lanes = distinct_lanes(cost, lanes)

    def pre(dev: int, micro: int) -> list[float]:
        key = (cost.klass[dev], micro)
        if key not in prefix:
            acc = [0.0]
            for k in range(nb):
                t = (cost.fwd_s(dev, k, k + 1, micro, precision) + cost.bwd_s(dev, k, k + 1, micro, precision)
                     + cost.recompute_s(dev, k, k + 1, micro, precision, ckpt))
                acc.append(acc[-1] + t)
            prefix[key] = acc
        return prefix[key]

    def elem(s: int, lo: int, hi: int):
        a_max = peak_max = 0.0
        for lane in lanes:
            d = lane.stage_devices[s]
            p, gr, o = stage_state(cost, lo, hi)
            need = p + gr + o + inflight[s] * cost.act_bytes(lo, hi, lane.micro, precision, ckpt)
            if need > cost.device(d).memory_bytes:
                return None
            acc = pre(d, lane.micro)
            c = max(0.0, acc[hi] - acc[lo] + cost.stage_overhead_s(d, lo, hi, lane.micro, precision)
                    + 2 * action_term(cost, schedule, lane.micro, m * v, precision))  # F and B
            link = 0.0
            if s + 1 < n_stages and lane.stage_devices[s + 1] != d:
                nbytes = cost.blocks()[hi - 1].boundary_bytes_per_sample(precision) * lane.micro
                link = 2 * cost.p2p_s(nbytes, d, lane.stage_devices[s + 1])
            a = c + link + (tail_s(s, lo, hi, d) if tail_s is not None else 0.0)
            a_max = max(a_max, a)
            peak_max = max(peak_max, c, link)
        return a_max, peak_max * v

    return elem


def lane_class(cost: CostModel, lane: Lane) -> tuple:
    """What a lane's element costs depend on: its stages' device classes, its micro-batch, and the
    link between each stage and the next.  Lanes of one class cost the same."""
    sd, links = lane.stage_devices, cost.cluster.links
    hops = tuple(None if a == b else (links[a][b] if links is not None else True) for a, b in zip(sd, sd[1:]))
    return tuple(cost.klass[d] for d in sd), lane.micro, hops


def distinct_lanes(cost: CostModel, lanes: Sequence[Lane]) -> list[Lane]:
    """One lane per class (the first): every element takes the slowest lane, so repeats change nothing."""
    seen: dict[tuple, Lane] = {}
    for lane in lanes:
        seen.setdefault(lane_class(cost, lane), lane)
    return list(seen.values())


def solve_boundaries(cost: CostModel, lanes: Sequence[Lane], n_stages: int, m: int, precision: str, ckpt: int,
                     inflight: Sequence[int], schedule: str = "GPipe",
                     tail_s: Callable[[int, int, int, int], float] | None = None) -> tuple[int, ...]:
    """Stage boundaries that minimise the analytic step time under every device's memory cap (exact DP)."""
    elem = step_elements(cost, lanes, n_stages, precision, ckpt, inflight, tail_s, schedule, m)
    _, bounds = min_sum_plus_max(n_stages, cost.facts.n_blocks, elem, float(m - 1))
    return bounds


def optimizer_tail(cost: CostModel) -> Callable[[int, int, int, int], float]:
    """Stage 0's optimizer step ends the step (it finishes the last backward)."""

    def tail(s: int, lo: int, hi: int, dev: int) -> float:
        return cost.opt_s(dev, cost.trainable_count(lo, hi)) if s == 0 else 0.0

    return tail


def check_boundaries(boundaries: Sequence[int], n_blocks: int) -> None:
    b = list(boundaries)
    if len(b) < 2 or b[0] != 0 or b[-1] != n_blocks or any(x >= y for x, y in zip(b, b[1:])):
        raise InfeasiblePlanError(
            f"stage boundaries {b} must rise strictly from 0 to the model's {n_blocks} blocks, e.g. [0, 3, {n_blocks}]"
        )
