"""Every plan of a small search space, for checking what a search finds against the true best.

`EnumTrial` answers a family's `space(trial, ctx)` with one fixed choice per `suggest_*` call; a
depth-first walk over those choices visits every combination the space can produce (categoricals
and ints only: a float knob, such as a pipeline's device order, cannot be enumerated).
"""

from __future__ import annotations

from hetsim.search.study import memory_constraint
from hetsim.strategies.base import SearchContext

from hetsim import strategies
from hetsim.errors import InfeasiblePlanError


class NotEnumerable(Exception):
    pass


class EnumTrial:
    def __init__(self, prefix: list[int]):
        self.prefix = prefix
        self.sizes: list[int] = []
        self.picked: list[int] = []

    def _pick(self, n: int) -> int:
        k = len(self.picked)
        i = self.prefix[k] if k < len(self.prefix) else 0
        self.sizes.append(n)
        self.picked.append(i)
        return i

    def suggest_categorical(self, name, choices):
        choices = list(choices)
        return choices[self._pick(len(choices))]

    def suggest_int(self, name, low, high, step=1, log=False):
        return low + step * self._pick((high - low) // step + 1)

    def suggest_float(self, *a, **k):
        raise NotEnumerable("a float knob")

    def set_user_attr(self, *a):
        pass


def enumerate_best(ctx: SearchContext, names: list[str], limit: int = 20000) -> tuple[float, str, int]:
    """(best feasible predicted throughput, its plan's label, number of distinct plans) over every plan
    the families' spaces can produce."""
    best, label, plans = 0.0, "", set()
    for name in names:
        strat = strategies.get(name)
        stack: list[list[int]] = [[]]
        while stack:
            prefix = stack.pop()
            t = EnumTrial(prefix)
            try:
                plan = strat.space(t, ctx)
            except InfeasiblePlanError:
                plan = None
            for j in range(len(prefix), len(t.sizes)):
                stack.extend(t.picked[:j] + [i] for i in range(1, t.sizes[j]))
            if plan is None or plan in plans:
                continue
            plans.add(plan)
            if len(plans) > limit:
                raise NotEnumerable(f"more than {limit} plans")
            try:
                pred = strat.evaluate(plan, ctx.cost)
            except InfeasiblePlanError:
                continue
            if memory_constraint(pred) <= 0 and pred.feasible and pred.samples_per_s > best:
                best, label = pred.samples_per_s, strat.label(plan)
    return best, label, len(plans)
