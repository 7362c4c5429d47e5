"""hetsim's own search loop: an evolutionary sampler over the families' knobs, at ~0.1 ms a proposal.

Optuna's TPE re-splits every finished trial for every parameter of every trial (seen: 70 ms a trial
at 300 trials on 8 devices, growing with the study), which a simulated plan (~0.1 ms) cannot
afford.  This loop asks the same search spaces (`Strategy.space` calls `suggest_*` on a
`LiteTrial`) and records every trial in the Optuna study as a finished trial, so storage, resume,
reports and `--jobs` see ordinary Optuna trials.

A proposal is either random (the first `startup` trials, then a fraction `explore`) or a mutation
of a parent drawn by a two-way tournament among the best feasible trials: each knob is kept, or
re-drawn (a categorical), or moved a step (an int or a float).  A proposal whose plan was already
evaluated is re-drawn (up to `retries` times), so a small space is enumerated rather than
re-sampled; a plan seen before is never simulated twice.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

_MISSING = object()


def log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    """An int in low..high, log-uniform, as Optuna samples a log-scaled int."""
    return min(high, max(low, int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))


class LiteTrial:
    """The part of `optuna.Trial` a family's search space uses, answered from a wished-for set of
    values where they are valid choices, and at random otherwise."""

    __slots__ = ("_want", "_rng", "_dists", "params", "distributions", "user_attrs", "constraint")

    def __init__(self, want: dict[str, Any], rng: random.Random, dists: dict):
        self._want, self._rng, self._dists = want, rng, dists
        self.params: dict[str, Any] = {}
        self.distributions: dict[str, BaseDistribution] = {}
        self.user_attrs: dict[str, Any] = {}
        self.constraint: float | None = None

    def _dist(self, key: tuple, make: Callable[[], BaseDistribution]) -> BaseDistribution:
        d = self._dists.get(key)
        if d is None:
            d = self._dists[key] = make()
        return d

    def suggest_categorical(self, name: str, choices):
        choices = tuple(choices)
        v = self._want.get(name, _MISSING)
        if v is _MISSING or v not in choices:
            v = choices[self._rng.randrange(len(choices))]
        self.params[name] = v
        self.distributions[name] = self._dist(("c", name, choices), lambda: CategoricalDistribution(choices))
        return v

    def suggest_int(self, name: str, low: int, high: int, step: int = 1, log: bool = False) -> int:
        v = self._want.get(name, _MISSING)
        if v is _MISSING or not (low <= v <= high) or (v - low) % step:
            if log:
                v = log_uniform_int(self._rng, low, high)
            else:
                v = low + step * self._rng.randrange((high - low) // step + 1)
        self.params[name] = v
        self.distributions[name] = self._dist(("i", name, low, high, step, log),
                                              lambda: IntDistribution(low, high, step=step, log=log))
        return v

    def suggest_float(self, name: str, low: float, high: float, step: float | None = None, log: bool = False) -> float:
        v = self._want.get(name, _MISSING)
        if v is _MISSING or not (low <= v <= high):
            v = self._rng.uniform(low, high)
        self.params[name] = v
        self.distributions[name] = self._dist(("f", name, low, high, step, log),
                                              lambda: FloatDistribution(low, high, step=step, log=log))
        return v

    def settle(self, name: str, value: Any) -> None:
        """Knob `name` took `value`, one of its choices, rather than the value drawn
        (`hetsim.strategies.helpers.settled`)."""
        self.params[name] = value

    def set_user_attr(self, key: str, value: Any) -> None:
        self.user_attrs[key] = value

    def set_constraint(self, name: str, value: float) -> None:
        self.constraint = value


@dataclass
class Evolver:
    """Proposes the wished-for knobs of the next trial from the finished ones."""

    seed: int
    startup: int = 20
    explore: float = 0.2
    elite: int = 12
    retries: int = 8
    polish: float = 0.5
    """Share of the proposals (after `startup`) that try the best trial's next untried neighbour."""
    rng: random.Random = field(init=False)
    best: list[tuple[float, dict, dict]] = field(default_factory=list)
    """(score, params, distributions) of the best trials so far, best first (at most `elite`)."""
    seen: int = 0
    _queue: list[dict] = field(default_factory=list)
    _queued_for: float | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def tell(self, params: dict, dists: dict, value: float | None, constraint: float) -> None:
        """A finished trial: feasible ones rank by value, infeasible ones below all of them."""
        self.seen += 1
        if not params:
            return
        score = value if constraint <= 0 and value is not None else -1e300 * (1.0 + min(constraint, 1e6)) / 2
        if len(self.best) >= self.elite and score <= self.best[-1][0]:
            return
        self.best.append((score, params, dists))
        self.best.sort(key=lambda b: -b[0])
        del self.best[self.elite:]

    def propose(self) -> dict[str, Any]:
        rng = self.rng
        if self.seen < self.startup or not self.best or rng.random() < self.explore:
            return {}
        if self.best[0][0] > -1e300 and rng.random() < self.polish:
            if self._queued_for != self.best[0][0]:  # a new best: its neighbourhood, in random order
                self._queued_for = self.best[0][0]
                self._queue = neighbours(self.best[0][1], self.best[0][2], rng)
            if not self._queue:  # the best is a local optimum: another elite's neighbourhood
                _, params, dists = self.best[rng.randrange(len(self.best))]
                self._queue = neighbours(params, dists, rng)
            if self._queue:
                return self._queue.pop()
        a, b = rng.randrange(len(self.best)), rng.randrange(len(self.best))
        _, parent, dists = self.best[min(a, b)]
        names = list(parent)
        rate = max(1.0 / len(names), 0.2)
        forced = names[rng.randrange(len(names))]
        want: dict[str, Any] = {}
        for name in names:
            v = parent[name]
            if name != forced and rng.random() >= rate:
                want[name] = v
                continue
            moved = _step(dists.get(name), v, rng)
            if moved is not _MISSING:
                want[name] = moved
        return want


def neighbours(params: dict, dists: dict, rng: random.Random) -> list[dict]:
    """Every proposal that changes one knob of `params` to a nearby value (a local search's moves,
    which a mutation reaches only by chance: one knob of ten, and a categorical re-drawn among all
    its choices): each other choice of a categorical (16 at most), an int +-1, 2, 3 (and x0.67-1.5 in six steps
    on a log scale), a float at either end of its range or half-way to it."""
    out: list[dict] = []
    for name, v in params.items():
        d = dists.get(name)
        if isinstance(d, CategoricalDistribution):
            others = [c for c in d.choices if c != v]
            moved = rng.sample(others, min(16, len(others)))
        elif isinstance(d, IntDistribution):
            cand = {v + k * d.step for k in (-3, -2, -1, 1, 2, 3)}
            if d.log:
                cand |= {round(v * f) for f in (0.67, 0.8, 0.9, 1.1, 1.25, 1.5)}
            moved = sorted(c for c in cand if d.low <= c <= d.high and c != v)
        elif isinstance(d, FloatDistribution):
            moved = [c for c in {d.low, d.high, (v + d.low) / 2, (v + d.high) / 2} if c != v]
        else:
            continue
        out.extend({**params, name: c} for c in moved)
    rng.shuffle(out)
    return out


def _step(dist: BaseDistribution | None, v: Any, rng: random.Random) -> Any:
    """A nearby value of a numeric knob (half the time; otherwise, and for a categorical, none: re-drawn)."""
    if isinstance(dist, IntDistribution) and dist.log and rng.random() < 0.5:
        width = math.log(dist.high / dist.low)  # a multiplicative step: x0.7-1.4 on 2..256
        return min(dist.high, max(dist.low, round(v * math.exp(rng.gauss(0.0, 0.08 * width)))))
    if isinstance(dist, IntDistribution) and rng.random() < 0.5:
        reach = max(1, (dist.high - dist.low) // 8)
        return min(dist.high, max(dist.low, v + rng.choice((-1, 1)) * dist.step * rng.randint(1, reach)))
    if isinstance(dist, FloatDistribution) and rng.random() < 0.5:
        return min(dist.high, max(dist.low, v + rng.gauss(0.0, 0.15 * (dist.high - dist.low))))
    return _MISSING
