"""The default search: `hetsim.search.sampler`'s proposals, simulated, kept as Optuna trials.

One process runs the loop on an in-memory copy of the study (the stored trials copied in, so a
resumed study continues from them) and writes its new trials to the study's storage in batches
(`hetsim.search.persist.TrialWriter`).  With `jobs` > 1, `jobs` - 1 more processes (forked after
the family seeds are written) each run their share of the missing trials with their own seed and
their own writer on the same journal file; the journal's file lock serialises their appends.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable

import optuna
from hetsim.strategies.base import SearchContext

from hetsim import strategies
from hetsim.errors import ConfigError, InfeasiblePlanError

from .persist import TrialWriter, is_in_memory, journal_path
from .sampler import Evolver, LiteTrial
from .study import _NEW_CONSTRAINTS, complete_count, infeasible, score, searchable, seed_trials

COMPLETE = (optuna.trial.TrialState.COMPLETE,)


def run(study: optuna.Study, ctx: SearchContext, names: list[str], trials: int, *, callbacks=(),
        stop: Callable[[], bool] = lambda: False, jobs: int = 1, seed: int = 0, trial_delay_s: float = 0.0) -> None:
    if jobs > 1 and not journal_path(study):
        raise ConfigError(f"--jobs {jobs} needs a journal storage, which several processes can write (the "
                          "default, or --storage journal:PATH); SQLite breaks under parallel writers: use --jobs 1")
    in_memory = is_in_memory(study)
    work = study if in_memory else _working_copy(study)
    writer = None if in_memory else TrialWriter(study)
    if not work.trials:
        for t in _seeds(work, ctx, names):
            writer and writer.add(t)
    if writer:
        writer.flush()
    remaining = trials - complete_count(work)
    if remaining <= 0:
        return
    shares = [remaining // jobs + (1 if k < remaining % jobs else 0) for k in range(jobs)]
    delay = [lambda s, t: time.sleep(trial_delay_s)] if trial_delay_s > 0 else []  # tests: a kill lands mid-search
    callbacks = [*callbacks, *delay]
    children = [_fork(study, work, ctx, names, shares[k], seed + k, delay) for k in range(1, jobs) if shares[k]]
    try:
        evolve(work, ctx, names, shares[0], seed=seed, stop=stop, callbacks=callbacks, writer=writer)
    finally:
        if writer:
            writer.flush()
        for p in children:
            p.join()
    bad = [p.exitcode for p in children if p.exitcode]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(children)} search worker processes failed (exit codes {bad})")


def _working_copy(study: optuna.Study) -> optuna.Study:
    work = optuna.create_study(study_name=study.study_name, direction="maximize")
    work.add_trials(study.get_trials(deepcopy=False, states=COMPLETE))
    return work


def _seeds(work: optuna.Study, ctx: SearchContext, names: list[str]) -> list[optuna.trial.FrozenTrial]:
    seed_trials(work, ctx, names, exact=False)
    return work.get_trials(deepcopy=False, states=COMPLETE)


def _fork(study, work, ctx, names, n: int, seed: int, callbacks):
    """A worker process with its own loop and writer on the same storage (fork: it inherits the
    cost model and the working copy, seeds included, already written by the parent)."""
    parent = os.getpid()

    def main() -> None:
        signal.signal(signal.SIGINT, lambda *_: flag.append(1))
        writer = TrialWriter(study)
        try:
            evolve(work, ctx, names, n, seed=seed, stop=lambda: bool(flag) or os.getppid() != parent, writer=writer,
                   callbacks=callbacks)
        finally:
            writer.flush()

    flag: list[int] = []
    p = multiprocessing.get_context("fork").Process(target=main, daemon=False)
    p.start()
    return p


def evolve(work: optuna.Study, ctx: SearchContext, names: list[str], n: int, *, seed: int,
           stop: Callable[[], bool] = lambda: False, callbacks=(), writer: TrialWriter | None = None) -> int:
    """Run n trials on `work` (unless `stop()`); returns how many ran."""
    names, _ = searchable(ctx, names)
    ev = Evolver(seed=seed)
    seen: dict = {}
    bad: set = set()
    for t in work.get_trials(deepcopy=False, states=COMPLETE):
        ev.tell(t.params, t.distributions, t.value, float(t.user_attrs.get("constraint", 1.0)))
        if "plan" in t.user_attrs:
            seen[strategies.plan_from_dict(t.user_attrs["plan"])] = None  # plans tried before: not proposed again
    dists: dict = {}
    number = len(work.get_trials(deepcopy=False))
    done = 0
    while done < n and not stop():
        trial, value = _one_trial(ev, ctx, names, seen, bad, dists)
        constraint = trial.constraint if trial.constraint is not None else 1.0
        ev.tell(trial.params, trial.distributions, value, constraint)
        kw = {"constraints": {"memory": constraint}} if _NEW_CONSTRAINTS else {}
        frozen = optuna.trial.create_trial(params=trial.params, distributions=trial.distributions, value=value,
                                           user_attrs=trial.user_attrs, **kw)
        work.add_trial(frozen)
        frozen.number = number
        number += 1
        done += 1
        if writer:
            writer.add(frozen)
        for cb in callbacks:
            cb(work, frozen)
    return done


def _one_trial(ev: Evolver, ctx: SearchContext, names: list[str], seen: dict, bad: set, dists: dict):
    """A proposal that is new where possible (one whose plan, or when it has none whose knobs, was
    seen before is re-drawn up to `ev.retries` times), scored."""
    for attempt in range(ev.retries + 1):
        last = attempt == ev.retries
        trial = LiteTrial(ev.propose(), ev.rng, dists)
        name = trial.suggest_categorical("strategy", names) if len(names) > 1 else names[0]
        strat = strategies.get(name)
        try:
            plan = strat.space(trial, ctx)
        except InfeasiblePlanError as e:
            key = tuple(sorted(trial.params.items()))
            if key in bad and not last:
                continue
            bad.add(key)
            return trial, infeasible(trial, e)
        if plan in seen and not last:
            continue
        value = score(trial, strat, plan, ctx, seen)
        return trial, value if math.isfinite(value) else 0.0
    raise AssertionError("unreachable: the last attempt always returns")
