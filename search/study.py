"""The Optuna study: one trial = one plan, simulated; infeasible plans are constraint violations."""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from hetsim.strategies.base import Plan, SearchContext
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hetsim import strategies
from hetsim.errors import ConfigError, InfeasiblePlanError, shown
from hetsim.serial import from_dict, to_dict
from hetsim.types import Measurement, Prediction

from .checks import hide_secrets, masked_url
from .persist import make_storage
from .sampler import log_uniform_int

MEASURED_PREFIX = "measured:"


def plan_key(plan: Plan) -> str:
    return hashlib.sha1(json.dumps(to_dict(plan), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    prediction: Prediction
    trial_number: int


class KeyedRandomSampler(optuna.samplers.BaseSampler):
    """Independent random sampling where each value depends on (seed, trial number, parameter name)
    alone, drawn with Python's own `random` (its string seeding and draws are stable across
    releases).  The golden cases search with it, so that their plans do not change with an Optuna
    release the way TPE's choices do (seen: optuna 5.0.0 found 25 distinct feasible plans in the
    seeded TPE search of emu-tight-memory where the release that wrote the golden file found 24)."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def infer_relative_search_space(self, study, trial) -> dict:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict:
        return {}

    def sample_independent(self, study, trial, param_name: str, param_distribution):
        rng = random.Random(f"{self.seed}:{trial.number}:{param_name}")
        d = param_distribution
        if isinstance(d, optuna.distributions.CategoricalDistribution):
            return d.choices[rng.randrange(len(d.choices))]
        if isinstance(d, optuna.distributions.IntDistribution) and d.log:
            return log_uniform_int(rng, d.low, d.high)
        if isinstance(d, optuna.distributions.IntDistribution) and not d.log:
            return d.low + d.step * rng.randrange((d.high - d.low) // d.step + 1)
        if isinstance(d, optuna.distributions.FloatDistribution) and not d.log and d.step is None:
            return d.low + (d.high - d.low) * rng.random()
        raise NotImplementedError(f"KeyedRandomSampler does not sample {d!r} ({param_name})")


def open_study(name: str, storage: str | None, seed: int,
               sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    """A maximising study (created, or loaded when it exists); TPE unless another sampler is given."""
    kw = {} if _NEW_CONSTRAINTS else {"constraints_func": _constraints}
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the CLI says itself whether a study resumes
    sampler = sampler or optuna.samplers.TPESampler(seed=seed, n_startup_trials=20, **kw)
    try:
        with warnings.catch_warnings():  # SQLAlchemy's warnings about a URL would print lines of their own
            warnings.simplefilter("ignore", category=Warning)
            return optuna.create_study(study_name=name, storage=make_storage(storage), sampler=sampler,
                                       direction="maximize", load_if_exists=True)
    except ConfigError:
        raise
    except Exception as e:  # sqlalchemy, sqlite and driver errors alike: a URL the user gave cannot be used
        why = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", f"{type(e).__name__}: {e}").strip()
        why = hide_secrets(why, storage or "")
        raise ConfigError(f"--storage {shown(masked_url(storage or ''), 200)} cannot be opened ({why[:500]}); use "
                          "an Optuna storage URL that this machine can open, such as "
                          "journal:results/hetsim.journal or sqlite:///results/hetsim.db") from None




# Optuna 5 takes constraints from the trial (`Trial.set_constraint`); older ones from a sampler callback.
_NEW_CONSTRAINTS = hasattr(optuna.trial.Trial, "set_constraint")


def _set_constraint(trial: optuna.Trial, value: float) -> None:
    trial.set_user_attr("constraint", value)
    if _NEW_CONSTRAINTS:
        trial.set_constraint("memory", value)


def memory_constraint(pred: Prediction) -> float:
    """Optuna's constraint value of a prediction: feasible <= 0; otherwise the worst device's
    relative excess over its capacity, a margin that helps TPE move towards fitting plans."""
    over = max((m - c) / c for m, c in zip(pred.peak_mem_bytes, pred.capacity_bytes))
    return over if not pred.feasible else min(0.0, over)


def _constraints(trial: optuna.trial.FrozenTrial) -> tuple[float]:
    return (float(trial.user_attrs.get("constraint", 1.0)),)


def searchable(ctx: SearchContext, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The families that have plans on ctx's cluster, and why each other one has none."""
    skipped = {n: r for n in names if (r := strategies.get(n).unavailable(ctx)) is not None}
    kept = [n for n in names if n not in skipped]
    return (kept, skipped) if kept else (list(names), {})


def make_objective(ctx: SearchContext, names: list[str]) -> Callable[[optuna.Trial], float]:
    """The TPE objective: every plan through the event simulation (`_EventSimulated`), so that a seeded
    TPE study (the golden cases) ranks its trials on exactly the numbers it always had.  The closed
    form agrees to 1e-9 but not to the last bit, and TPE orders ties (plans of equal throughput) by it."""
    names, _ = searchable(ctx, names)
    return lambda trial: _objective(trial, ctx, names, _EventSimulated())


class _EventSimulated(dict):
    """A `seen` memo that remembers nothing and makes `score` call `Strategy.predict`."""

    exact = True


def _objective(trial, ctx: SearchContext, names: list[str], seen: dict) -> float:
    """One trial: the family and its knobs from `trial`, then `score`."""
    name = trial.suggest_categorical("strategy", names) if len(names) > 1 else names[0]
    strat = strategies.get(name)
    try:
        plan = strat.space(trial, ctx)
    except InfeasiblePlanError as e:
        return infeasible(trial, e)
    return score(trial, strat, plan, ctx, seen)


def infeasible(trial, e: InfeasiblePlanError) -> float:
    trial.set_user_attr("infeasible", str(e))
    _set_constraint(trial, 1.0)
    return 0.0


def score(trial, strat, plan: Plan, ctx: SearchContext, seen: dict) -> float:
    """The plan's prediction (from `seen` when the same plan was evaluated before), stored on the trial
    with the plan; the trial's value is the predicted throughput."""
    try:
        if getattr(seen, "exact", False):
            pred = strat.predict(plan, ctx.cost)[0]
        else:
            pred = seen.get(plan)
            if pred is None:
                pred = seen[plan] = strat.evaluate(plan, ctx.cost)
    except InfeasiblePlanError as e:
        return infeasible(trial, e)
    trial.set_user_attr("plan", to_dict(plan))
    trial.set_user_attr("prediction", to_dict(pred))
    _set_constraint(trial, memory_constraint(pred))
    if not pred.feasible:
        trial.set_user_attr("infeasible", "; ".join(pred.violations))
    return pred.samples_per_s


def search_step(study: optuna.Study, ctx: SearchContext, names: list[str], trials: int, console: Console,
                stop: Callable[[], bool], **run_kw) -> list[Candidate]:
    """The search step: run the study up to `trials` (a resumed study only the missing ones) behind
    a progress bar; every distinct feasible plan, best predicted first."""
    before = len(study.trials)
    if before:
        console.print(f"resuming study {escape(repr(study.study_name))}: {before} trials already stored")
    with Progress(TextColumn("search"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as prog:
        task = prog.add_task("trials", total=trials, completed=min(before, trials))
        run_search(study, ctx, names, trials, callbacks=[lambda s, t: prog.advance(task)], stop=stop, **run_kw)
    found = feasible_candidates(study)
    if before:
        found = predicted_again(found, ctx)
    console.print(f"{len(study.trials)} trials, {len(found)} distinct feasible plans")
    return found


def predicted_again(found: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """A resumed study's plans as this run's cost model predicts them, best first.  Stored predictions
    come from the profiles and calibration of the run that stored them; after `--reprofile`, a new
    calibration or another hetsim they are stale, and the shortlist, the report and the exported plan
    must show this run's numbers.  A plan that no longer fits is dropped."""
    out = []
    for c in found:
        try:
            pred = strategies.get(c.plan.strategy).predict(c.plan, ctx.cost)[0]
        except InfeasiblePlanError:
            continue
        if pred.feasible and math.isfinite(pred.samples_per_s):
            out.append(Candidate(c.plan, pred, c.trial_number))
    return sorted(out, key=lambda c: -c.prediction.samples_per_s)


def run_search(study: optuna.Study, ctx: SearchContext, names: list[str], trials: int,
               callbacks=(), stop: Callable[[], bool] = lambda: False, *, sampler: str = "evolve",
               jobs: int = 1, seed: int = 0, trial_delay_s: float = 0.0) -> None:
    """Fill `study` up to `trials` finished trials (the study's total: a resumed study runs only the
    missing ones).  sampler "evolve": hetsim's own loop (`hetsim.search.sampler`), on an in-memory
    copy whose trials are written to the study's storage in batches (`hetsim.search.persist`), by
    `jobs` worker processes; "tpe": Optuna's seeded TPE trial by trial on `study` itself (what the
    golden cases replay)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if stop():  # Ctrl-C while profiling: keep what the study holds, run no trial
        return
    if sampler == "tpe":
        _run_tpe(study, ctx, names, trials, callbacks, stop)
        return
    if sampler != "evolve":
        raise ConfigError(f"sampler {sampler!r} is not one of ['evolve', 'tpe']")
    from hetsim.search import loop  # it runs this module's objective

    loop.run(study, ctx, names, trials, callbacks=callbacks, stop=stop, jobs=jobs, seed=seed,
             trial_delay_s=trial_delay_s)


def _run_tpe(study: optuna.Study, ctx: SearchContext, names: list[str], trials: int, callbacks, stop) -> None:
    objective = make_objective(ctx, names)

    def check_stop(st, tr):
        if stop():
            st.stop()

    if not study.trials:
        seed_trials(study, ctx, names)
    remaining = trials - complete_count(study)
    if remaining > 0:
        study.optimize(objective, n_trials=remaining, callbacks=[*callbacks, check_stop], catch=(), gc_after_trial=False)


def complete_count(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def seed_trials(study: optuna.Study, ctx: SearchContext, names: list[str], *, exact: bool = True) -> int:
    """Start a fresh study with every family's own plans (its baseline and `examples`), predicted and
    stored as completed trials, as one enqueues known configurations: the sampler starts from plans a
    person would try, and no family is lost to a search that gave it few trials (seen: a 100-trial
    search on two 300 MiB devices tried 26 pipeline plans and missed the one `examples` names, 9%
    faster than the best plan it found).  Returns how many trials it added."""
    names, _ = searchable(ctx, names)
    dist = {"strategy": optuna.distributions.CategoricalDistribution(names)} if len(names) > 1 else {}
    added, seen = 0, set()
    for name in names:
        strat = strategies.get(name)
        try:
            plans = strat.own_plans(ctx)
        except InfeasiblePlanError:
            continue
        for plan in plans:
            key = plan_key(plan)
            if key in seen:
                continue
            seen.add(key)
            try:
                # exact: the event simulation, as a TPE study's seeds always were; else the closed form
                pred = strat.predict(plan, ctx.cost)[0] if exact else strat.evaluate(plan, ctx.cost)
            except InfeasiblePlanError:
                continue
            if not math.isfinite(pred.samples_per_s):
                continue
            constraint = memory_constraint(pred)
            attrs = {"plan": to_dict(plan), "prediction": to_dict(pred), "constraint": constraint, "seeded": True}
            if not pred.feasible:
                attrs["infeasible"] = "; ".join(pred.violations)
            kw = {"constraints": {"memory": constraint}} if _NEW_CONSTRAINTS else {}
            study.add_trial(optuna.trial.create_trial(params={"strategy": name} if dist else {}, distributions=dist,
                                                      value=pred.samples_per_s, user_attrs=attrs, **kw))
            added += 1
    return added


def feasible_candidates(study: optuna.Study) -> list[Candidate]:
    """Every distinct feasible plan, best predicted throughput first."""
    best: dict[str, Candidate] = {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if "plan" not in t.user_attrs or t.user_attrs.get("constraint", 1.0) > 0:
            continue
        plan = strategies.plan_from_dict(t.user_attrs["plan"])
        pred = from_dict(Prediction, t.user_attrs["prediction"])
        if not pred.feasible or not math.isfinite(pred.samples_per_s):
            continue
        k = plan_key(plan)
        if k not in best or best[k].prediction.samples_per_s < pred.samples_per_s:
            best[k] = Candidate(plan, pred, t.number)
    return sorted(best.values(), key=lambda c: -c.prediction.samples_per_s)


def infeasible_reasons(study: optuna.Study, strategy: str) -> list[str]:
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if t.params.get("strategy", strategy) == strategy and "infeasible" in t.user_attrs:
            out.append(t.user_attrs["infeasible"])
    return out


def stored_measurement(study: optuna.Study, plan: Plan) -> Measurement | None:
    data = study.user_attrs.get(MEASURED_PREFIX + plan_key(plan))
    return from_dict(Measurement, data) if data else None


def store_measurement(study: optuna.Study, plan: Plan, m: Measurement) -> None:
    study.set_user_attr(MEASURED_PREFIX + plan_key(plan), to_dict(m))


def trial_table(study: optuna.Study) -> tuple[list[dict], list[tuple[int, float]]]:
    """One row per trial for the report's trials.csv, and the optimisation history: (trial number,
    predicted samples/s) of every feasible trial."""
    trials, history = [], []
    for t in study.trials:
        row = {"number": t.number, "state": t.state.name, "value": t.value, **{f"param_{k}": v for k, v in t.params.items()},
               "feasible": t.user_attrs.get("constraint", 1.0) <= 0, "infeasible": t.user_attrs.get("infeasible", "")}
        pred = t.user_attrs.get("prediction")
        if pred:
            row.update({"pred_step_time_s": pred["step_time_s"], "pred_peak_mem_bytes": pred["peak_mem_bytes"]})
            if row["feasible"]:
                history.append((t.number, pred["samples_per_s"]))
        trials.append(row)
    return trials, history
