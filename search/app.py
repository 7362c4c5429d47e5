"""The main job: cluster -> profiles -> search -> real runs -> report.  Options come in parsed."""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hetsim.search.calibrate import obtain_profiles
from hetsim.strategies.base import SearchContext
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetsim import strategies
from hetsim.execution.runner import Launch, measure
from hetsim.execution.worker import Fault
from hetsim.hardware.cluster import Cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.hostspeed import profile_ref
from hetsim.reporting import report
from hetsim.serial import to_dict

from .export import export_plans
from .study import (
    feasible_candidates,
    infeasible_reasons,
    open_study,
    run_search,
    searchable,
    store_measurement,
    stored_measurement,
)


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str
    cluster: Cluster
    workload: object
    global_batch: int
    strategies: tuple[str, ...]
    trials: int
    top_k: int
    steps: int
    warmup: int
    timeout_s: float
    storage: str | None
    study: str
    jobs: int = 1
    out: Path
    execute: bool
    seed: int
    reprofile: bool
    precisions: tuple[str, ...]
    min_local_batch: int
    checkpointing: bool
    launch: Launch
    notes: tuple[str, ...] = ()
    fault: Fault | None = None
    """For tests: a fault injected into the first real run (hidden --inject-fault)."""
    trial_delay_s: float = 0.0
    """For tests: a wait after each trial, so a kill can land half-way through a search (hidden --trial-delay)."""


class StopFlag:
    """First Ctrl-C: finish the current trial or run, write the report, exit 130.  Second: abort."""

    def __init__(self):
        self.requested = False

    def install(self, console: Console):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            console.print("[yellow]interrupted: stopping after the current trial or run (Ctrl-C again to abort)[/]")

        self.previous = signal.signal(signal.SIGINT, handler)

    def uninstall(self) -> None:
        """Give SIGINT back to whoever had it (the CLI may run inside a test or a notebook)."""
        if getattr(self, "previous", None) is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None

    def __call__(self) -> bool:
        return self.requested


def default_study_name(model: str, cluster_spec: str, gb: int, names: tuple[str, ...]) -> str:
    raw = f"{model}-{cluster_spec}-b{gb}-{'+'.join(names)}"
    return re.sub(r"[^A-Za-z0-9_.@+-]+", "_", raw)[:120]


def run(opts: Options, console: Console) -> int:
    stop = StopFlag()
    stop.install(console)
    try:
        return _run(opts, console, stop)
    finally:
        stop.uninstall()


def _run(opts: Options, console: Console, stop: StopFlag) -> int:
    cluster = opts.cluster
    wl = opts.workload
    say = lambda msg: console.print(f"[dim]{escape(msg)}[/]")  # noqa: E731
    # The storage first: a URL that cannot be opened fails in a second, not after profiling.
    study = open_study(opts.study, opts.storage, opts.seed, resume=True)
    t0 = time.perf_counter()
    profiles = obtain_profiles(cluster, wl, root=opts.out, global_batch=opts.global_batch,
                               precisions=opts.precisions, reprofile=opts.reprofile, say=say, launch_cfg=opts.launch)
    cost = CostModel(cluster, profiles, wl.optimizer, has_batchnorm=wl.has_batchnorm, batch_coupled=wl.batch_coupled)
    ctx = SearchContext(cost=cost, global_batch=opts.global_batch, precisions=opts.precisions,
                        checkpointing=opts.checkpointing, min_local_batch=opts.min_local_batch)
    console.print(f"profiles ready in {time.perf_counter() - t0:.0f} s")

    before = len(study.trials)
    if before:
        console.print(f"resuming study {escape(repr(opts.study))}: {before} trials already stored")
    with Progress(TextColumn("search"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as prog:
        task = prog.add_task("trials", total=opts.trials, completed=min(before, opts.trials))
        run_search(study, ctx, list(opts.strategies), opts.trials,
                   callbacks=[lambda s, t: prog.advance(task)], stop=stop, jobs=opts.jobs, seed=opts.seed,
                   trial_delay_s=opts.trial_delay_s)
    cands = feasible_candidates(study)
    console.print(f"{len(study.trials)} trials, {len(cands)} distinct feasible plans")
    top = cands[: opts.top_k]

    ddp = strategies.get("ddp")
    base_plan = ddp.baseline(ctx)
    base_pred, _, _ = ddp.predict(base_plan, cost)
    ref = profile_ref(profiles.models.values())
    rows = [report.Row(rank=i + 1, label=strategies.get(c.plan.strategy).label(c.plan), plan=c.plan,
                       predicted=c.prediction, measured=None, ref_probe_s=ref) for i, c in enumerate(top)]
    rows += family_best_rows(rows, cands, opts.strategies, ref)
    rows += counterpart_rows(rows, cost, ref)
    base_row = report.Row(rank=0, label="uniform baseline: " + ddp.label(base_plan), plan=base_plan, predicted=base_pred,
                          measured=None, ref_probe_s=ref)
    notes = list(cluster.notes) + list(opts.notes)
    if not cands:
        notes.append("no feasible plan was found: " + "; ".join(sorted(set(
            r for n in opts.strategies for r in infeasible_reasons(study, n)))[:3]))
    _, skipped = searchable(ctx, list(opts.strategies))
    notes += [f"{name} was not searched: it {why}" for name, why in skipped.items()]
    never = ddp.why_never_fits(ctx)  # data parallelism cannot fit: say which device, how far over
    if never is not None:
        notes.append(never)
    for name in opts.strategies:
        if name in skipped or (name == "ddp" and never is not None):
            continue
        if not any(c.plan.strategy == name for c in cands):
            reasons = infeasible_reasons(study, name)
            if reasons:
                from collections import Counter

                top, count = Counter(reasons).most_common(1)[0]
                notes.append(f"{name} was infeasible in every trial ({len(reasons)}); most often ({count}x): {top}")
    if not base_pred.feasible:
        notes.append("the uniform data-parallel baseline does not fit: " + "; ".join(base_pred.violations))

    can_run = opts.execute and cluster.calibrated
    if opts.execute and not cluster.calibrated:
        notes.append("catalog cluster: plans were simulated only (nothing to run them on)")
    if can_run:
        jobs = [r for r in rows] + [base_row]
        fault = opts.fault
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as prog:
            task = prog.add_task("real runs", total=len(jobs))
            for r in jobs:
                if stop():
                    break
                prev = stored_measurement(study, r.plan)
                if prev is not None:
                    r.measured = prev
                    say(f"already measured: {r.label}")
                else:
                    prog.update(task, description=f"running {r.label}")
                    r.measured = measure(r.plan, cluster=cluster, workload_spec=wl.spec, optimizer=wl.optimizer,
                                         steps=opts.steps, warmup=opts.warmup, timeout_s=opts.timeout_s,
                                         seed=opts.seed, out_dir=str(opts.out / "runs" / opts.study / f"run-{r.rank}"),
                                         launch_cfg=opts.launch, fault=fault)
                    fault = None  # only the first real run
                    store_measurement(study, r.plan, r.measured)
                prog.advance(task)
                m = r.measured
                if m.status != "ok":
                    first = (m.error or "").strip().splitlines()[0] if m.error else ""
                    console.print(f"[red]run failed ({m.status}):[/] {escape(r.label)}: {escape(first)}", highlight=False)
                    console.print("  the error's last lines are in the report; continuing with the next plan")

    notes += knob_notes(rows, cands, opts, cost)
    if any(report.host_speed(r) is not None for r in rows + [base_row]):
        notes.append(report.HOST_SPEED_NOTE)
    best = rows[0] if rows else None
    shown = best  # the report's timeline is the best plan's (ARCHITECTURE.md), whatever its family
    timeline, tl_label = [], ""
    if shown is not None:
        strat = strategies.get(shown.plan.strategy)
        _, sched, graph = strat.predict(shown.plan, cost)
        timeline, tl_label = sched.timeline(graph), shown.label
    trials = []
    history = []
    for t in study.trials:
        row = {"number": t.number, "state": t.state.name, "value": t.value, **{f"param_{k}": v for k, v in t.params.items()},
               "feasible": t.user_attrs.get("constraint", 1.0) <= 0, "infeasible": t.user_attrs.get("infeasible", "")}
        pred = t.user_attrs.get("prediction")
        if pred:
            row.update({"pred_step_time_s": pred["step_time_s"], "pred_peak_mem_bytes": pred["peak_mem_bytes"]})
            if row["feasible"]:
                history.append((t.number, pred["samples_per_s"]))
        trials.append(row)
    data = report.ReportData(study=opts.study, model=wl.spec, cluster=cluster, global_batch=opts.global_batch,
                             candidates=rows, baseline=base_row, trials=trials, timeline=timeline,
                             timeline_label=tl_label, notes=notes, history=history,
                             tokens_per_sample=wl.tokens_per_sample)
    folder = report.write(data, opts.out)
    launch_sh = export_plans(folder, rows + [base_row], cluster=cluster, workload=wl.spec, optimizer=wl.optimizer,
                             study=opts.study, launch=opts.launch)
    _print_table(console, data)
    summary = report.summary(data)
    console.print(escape(report._accuracy_line(summary)))
    for line in report._oom_lines(summary):
        console.print(f"[red]out of memory although predicted to fit:[/] {escape(line)}", highlight=False)
    for n in notes:
        console.print(f"[yellow]note:[/] {escape(n)}")
    if best is not None:
        console.print(escape(f"best plan: {best.label}\n  plan JSON: {to_dict(best.plan)}"))
    console.print(escape(f"report: {folder}/report.md (also report.html, summary.json, trials.csv)"))
    if launch_sh is not None:
        console.print(escape(f"train with the best plan: bash {launch_sh}  (plan: {launch_sh.parent}/best_plan.json)"))
    if stop():
        console.print("[yellow]stopped early on Ctrl-C; the study keeps every finished trial and run: "
                      f"resume with --study {opts.study}[/]")
        return 130
    return 0


def family_best_rows(rows: list[report.Row], cands, names, ref: float) -> list[report.Row]:
    """The best plan of every searched family that has none in the top-k, so that each family asked
    for is run at least once (e.g. tensor parallelism beside faster data-parallel plans)."""
    have = {r.plan.strategy for r in rows}
    out: list[report.Row] = []
    for name in names:
        best = next((c for c in cands if c.plan.strategy == name), None)
        if best is None or name in have:
            continue
        label = f"best {name} plan (outside the top-{len(rows)}): {strategies.get(name).label(best.plan)}"
        out.append(report.Row(rank=len(rows) + len(out) + 1, label=label, plan=best.plan,
                              predicted=best.prediction, measured=None, ref_probe_s=ref))
    return out


def counterpart_rows(rows: list[report.Row], cost: CostModel, ref: float) -> list[report.Row]:
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
            out.append(report.Row(rank=len(rows) + len(out) + 1, label=f"counterpart of #{r.rank}: {strat.label(plan)}",
                                  plan=plan, predicted=pred, measured=None, ref_probe_s=ref))
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


def _print_table(console: Console, data: report.ReportData) -> None:
    title = "top plans" + (" (EMULATED cluster)" if data.cluster.emulated else "")
    t = Table(title=title)
    for h in report.header(data):
        t.add_column(h)
    for row in report.table_rows(data):
        t.add_row(*(escape(c) for c in row))
    console.print(t)
