"""What a study's report says: the shortlist of plans to run (the top plans and the uniform baseline),
the notes on families that were not searched, never fit or were not worth it, and the report data."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import optuna
from hetsim.strategies.base import SearchContext

from hetsim import strategies
from hetsim.names import MORE_RUNS
from hetsim.profiling.hostspeed import profile_ref
from hetsim.reporting import report
from hetsim.reporting.decision import NOISE_FLOOR_REL, profile_spread

from .coupled import coupled_notes
from .options import Options
from .study import Candidate, infeasible_reasons, searchable, trial_table

UNCALIBRATED = ("no calibration runs with --no-execute: the predictions use the calibration terms already recorded "
                "under --out/profiles and none for the others (a run without --no-execute measures them: minutes "
                "of real steps for each family)")
"""A --no-execute search on a cluster it could run on: said while it runs and in the report."""


@dataclass(frozen=True)
class Shortlist:
    """The plans the real-runs step runs: the top-k distinct feasible plans (rank 1..k) and the
    uniform-split data-parallel baseline (rank 0), each with its prediction and, once run, its
    measurement."""

    candidates: tuple[report.Row, ...]
    baseline: report.Row

    @property
    def rows(self) -> tuple[report.Row, ...]:
        """Every row in the order the real runs take them: the candidates, then the baseline."""
        return (*self.candidates, self.baseline)

    def with_rows(self, rows: list[report.Row]) -> Shortlist:
        """The same shortlist with `rows` (in the order of `.rows`) in place of its rows."""
        return Shortlist(candidates=tuple(rows[:-1]), baseline=rows[-1])


def shortlist(found: list[Candidate], ctx: SearchContext, top_k: int, families: tuple[str, ...] = ()) -> Shortlist:
    """The top-k of the search's distinct feasible plans, the best plan of each of `families` that
    has none among them, the plans their families ask to run beside them (`Strategy.counterparts`,
    e.g. the even tensor-parallel plan beside an uneven one), and the uniform data-parallel baseline."""
    ref = profile_ref(ctx.cost.profiles.models.values())
    spread = profile_spread(ctx.cost.profiles.models.values())
    rows = [report.Row(place=i + 1, label=strategies.get(c.plan.strategy).label(c.plan), plan=c.plan,
                       predicted=c.prediction, measured=None, ref_probe_s=ref, timing_spread=spread)
            for i, c in enumerate(found[:top_k])]
    rows += family_best_rows(rows, found, families, ref, spread)
    rows += counterpart_rows(rows, ctx.cost, ref, spread)
    ddp = strategies.get("ddp")
    base_plan = ddp.baseline(ctx)
    base_pred, _, _ = ddp.predict(base_plan, ctx.cost)
    base = report.Row(place=0, label="uniform baseline: " + ddp.label(base_plan), plan=base_plan, predicted=base_pred,
                      measured=None, ref_probe_s=ref, timing_spread=spread)
    return Shortlist(candidates=tuple(rows), baseline=base)


def report_data(study: optuna.Study, plans: Shortlist, found: list[Candidate], ctx: SearchContext,
                opts: Options) -> report.ReportData:
    """Everything the report shows: the shortlist as run, the notes, the best plan's simulated
    timeline (whatever its family, as ARCHITECTURE.md asks) and every trial."""
    rows = list(plans.candidates)
    timeline, tl_label = [], ""
    if rows:
        strat = strategies.get(rows[0].plan.strategy)
        _, sched, graph = strat.predict(rows[0].plan, ctx.cost)
        timeline, tl_label = sched.timeline(graph), rows[0].label
    trials, history = trial_table(study)
    return report.ReportData(study=opts.study, model=opts.workload.spec, cluster=opts.cluster,
                             global_batch=opts.global_batch, candidates=rows, baseline=plans.baseline, trials=trials,
                             timeline=timeline, timeline_label=tl_label, notes=notes(study, plans, found, ctx, opts),
                             history=history, tokens_per_sample=opts.workload.tokens_per_sample)


def notes(study: optuna.Study, plans: Shortlist, found: list[Candidate], ctx: SearchContext,
          opts: Options) -> list[str]:
    """The report's notes: the cluster's, the CLI's, then what the search and the runs leave to say."""
    out = list(opts.cluster.notes) + list(opts.notes)
    if not found:
        out.append("no feasible plan was found: " + "; ".join(sorted(set(
            r for n in opts.strategies for r in infeasible_reasons(study, n)))[:3]))
    out += family_notes(study, found, ctx, opts.strategies)
    if not plans.baseline.predicted.feasible:
        out.append("the uniform data-parallel baseline does not fit: " + "; ".join(plans.baseline.predicted.violations))
    if opts.execute and not opts.cluster.calibrated:
        out.append("catalog cluster: plans were simulated only (nothing to run them on)")
    if not opts.execute and opts.cluster.calibrated:
        out.append(UNCALIBRATED)
    out += knob_notes(list(plans.candidates), found, opts, ctx.cost)
    out += coupled_notes(opts.workload.name, [r.plan for r in plans.candidates], ctx.cost, opts.global_batch)
    if any(report.host_speed(r) is not None for r in plans.rows):
        out.append(report.HOST_SPEED_NOTE)
    repeated = [r for r in plans.rows if r.measured is not None and len(r.measured.runs_at_probe) > 1]
    if repeated:
        spread = max(max(r.measured.runs_at_probe) / min(r.measured.runs_at_probe) - 1 for r in repeated)
        out.append(f"each executed plan ran {opts.repeats} times (more, up to {opts.repeats + MORE_RUNS}, while no two "
                   f"agreed within {NOISE_FLOOR_REL:.0%}; their median is reported); the runs of "
                   "one plan differed by up to "
                   f"{spread:.1%} at one host speed (every run: runs_at_probe in summary.json)")
    return out


def family_notes(study: optuna.Study, found: list[Candidate], ctx: SearchContext, names: tuple[str, ...]) -> list[str]:
    """Families that were not searched (and why), and searched families with no feasible plan."""
    _, skipped = searchable(ctx, list(names))
    out = [f"{name} was not searched: it {why}" for name, why in skipped.items()]
    never = strategies.get("ddp").why_never_fits(ctx)  # data parallelism cannot fit: which device, how far over
    if never is not None:
        out.append(never)
    for name in names:
        if name in skipped or (name == "ddp" and never is not None):
            continue
        if not any(c.plan.strategy == name for c in found):
            reasons = infeasible_reasons(study, name)
            if reasons:
                top, count = Counter(reasons).most_common(1)[0]
                out.append(f"{name} was infeasible in every trial ({len(reasons)}); most often ({count}x): {top}")
    return out


def knob_notes(rows, cands, opts: Options, cost=None) -> list[str]:
    """For checkpointing and low precision: which executed plan used it, or why none was worth it."""
    out = []
    knobs = [("activation checkpointing", lambda p: getattr(p, "checkpoint_blocks", 0) > 0, opts.checkpointing),
             ("bf16", lambda p: getattr(p, "precision", "fp32") == "bf16", "bf16" in opts.precisions)]
    best = cands[0].prediction.samples_per_s if cands else 0.0
    for name, uses, searched in knobs:
        if any(uses(r.plan) for r in rows):
            continue
        if not searched:
            if not any(n.startswith(f"{name} was not searched") for n in opts.notes):
                out.append(f"{name} was not searched (see the options of this run)")
            continue
        with_knob = [c for c in cands if uses(c.plan)]
        if not with_knob:
            why = cost.precision_problem(range(cost.n_devices), name) if cost is not None and name == "bf16" else None
            out.append(f"{name} was searched, but no feasible plan used it" + (f": {why}" if why else ""))
        else:
            top = with_knob[0].prediction.samples_per_s
            out.append(f"{name} was searched ({len(with_knob)} distinct feasible plans used it) but not worth it "
                       f"here: its best plan was predicted at {top:.1f} samples/s against {best:.1f} for the best "
                       "plan, and memory did not force it")
    return out


def family_best_rows(rows: list[report.Row], found: list[Candidate], names, ref: float,
                     spread: float | None) -> list[report.Row]:
    """The best plan of every named family that has none in the top-k, so that each family asked
    for is run at least once (e.g. tensor parallelism beside faster data-parallel plans)."""
    have = {r.plan.strategy for r in rows}
    out: list[report.Row] = []
    for name in names:
        best = next((c for c in found if c.plan.strategy == name), None)
        if best is None or name in have:
            continue
        label = f"best {name} plan (outside the top-{len(rows)}): {strategies.get(name).label(best.plan)}"
        out.append(report.Row(place=len(rows) + len(out) + 1, label=label, plan=best.plan, predicted=best.prediction,
                              measured=None, ref_probe_s=ref, timing_spread=spread))
    return out


def counterpart_rows(rows: list[report.Row], cost, ref: float, spread: float | None) -> list[report.Row]:
    """Rows for the plans a candidate's family asks to run beside it (`Strategy.counterparts`), each
    plan once, numbered after the candidates."""
    seen = [r.plan for r in rows]
    out: list[report.Row] = []
    for r in rows:
        strat = strategies.get(r.plan.strategy)
        for plan in strat.counterparts(r.plan, cost):
            if plan in seen:
                continue
            seen.append(plan)
            pred, _, _ = strat.predict(plan, cost)
            out.append(report.Row(place=len(rows) + len(out) + 1, label=f"counterpart of #{r.place}: {strat.label(plan)}",
                                  plan=plan, predicted=pred, measured=None, ref_probe_s=ref, timing_spread=spread))
    return out
