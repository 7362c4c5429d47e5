"""The real-runs step: every shortlisted plan runs through torchrun once per study; a measurement
is stored in the study as it finishes, so a resumed study never runs the same plan again."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import optuna
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hetsim.execution.runner import measure
from hetsim.reporting import report
from hetsim.types import Measurement

from .options import Options
from .outcome import Shortlist
from .study import store_measurement, stored_measurement


def real_runs_step(study: optuna.Study, plans: Shortlist, opts: Options, console: Console,
                   stop: Callable[[], bool]) -> Shortlist:
    """Run the shortlist behind a progress bar (nothing with --no-execute or on a catalog cluster);
    a failed run gets its status and the next plan runs.  After Ctrl-C the remaining plans stay unrun."""
    if not (opts.execute and opts.cluster.calibrated):
        return plans
    rows, fault = list(plans.rows), opts.fault
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as prog:
        task = prog.add_task("real runs", total=len(rows))
        for i, row in enumerate(rows):
            if stop():
                break
            m = stored_measurement(study, row.plan)
            if m is not None:
                console.print(f"[dim]{escape(f'already measured: {row.label}')}[/]")
            else:
                prog.update(task, description=f"running {row.label}")
                m = run_plan(row, opts, fault)
                fault = None  # only the first real run
                store_measurement(study, row.plan, m)
            rows[i] = dataclasses.replace(row, measured=m)
            prog.advance(task)
            if m.status != "ok":
                first = (m.error or "").strip().splitlines()[0] if m.error else ""
                console.print(f"[red]run failed ({m.status}):[/] {escape(row.label)}: {escape(first)}", highlight=False)
                console.print("  the error's last lines are in the report; continuing with the next plan")
    return plans.with_rows(rows)


def run_plan(row: report.Row, opts: Options, fault) -> Measurement:
    """One real run of a shortlisted plan, its logs and rank files under OUT/runs/STUDY/run-RANK/."""
    wl = opts.workload
    return measure(row.plan, cluster=opts.cluster, workload_spec=wl.spec, optimizer=wl.optimizer, steps=opts.steps,
                   warmup=opts.warmup, timeout_s=opts.timeout_s, seed=opts.seed,
                   out_dir=str(opts.out / "runs" / opts.study / f"run-{row.place}"), launch_cfg=opts.launch,
                   fault=fault)
