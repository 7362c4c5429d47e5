"""The main job as its own outline: cluster -> profiles -> calibration -> search -> real runs -> report
(--no-execute: no calibration runs and no real runs)."""

from __future__ import annotations

import signal
from collections.abc import Callable

from hetsim.search.calibrate import calibrate
from hetsim.search.profiles import profiles_step
from hetsim.strategies.base import SearchContext
from rich.console import Console
from rich.markup import escape

from hetsim import strategies
from hetsim.execution.planfile import load_plan_file
from hetsim.model.costmodel import CostModel
from hetsim.profiling.store import ProfileSet
from hetsim.reporting.console import report_step

from .export import export_plans, timed_rows
from .options import Options
from .outcome import UNCALIBRATED, Shortlist, report_data, shortlist
from .realruns import real_runs_step
from .study import open_study, search_step


def main_job(opts: Options, console: Console, stop: StopFlag) -> int:
    """One step per stage, each in its stage's module and printing its own progress.  The cluster
    arrives resolved (and printed) in `opts`: the CLI needs it to check the other options before
    anything is measured.  The study opens first, so that a bad --storage fails before profiling."""
    study = open_study(opts.study, opts.storage, opts.seed)
    profiles = profiles_step(opts.cluster, opts.workload, opts.profiling, say=progress(console))
    if opts.execute:
        profiles = calibrate(opts.cluster, opts.workload, profiles, opts.profiling, say=progress(console))
    elif opts.cluster.calibrated:
        progress(console)(UNCALIBRATED)
    ctx = search_context(opts, profiles)
    found = search_step(study, ctx, list(opts.strategies), opts.trials, console, stop, jobs=opts.jobs, seed=opts.seed,
                        trial_delay_s=opts.trial_delay_s)
    every_family = set(opts.strategies) != set(strategies.names())  # --strategies named: run each one at least once
    plans = real_runs_step(study, shortlist(found, ctx, opts.top_k, opts.strategies if every_family else ()), opts,
                           console, stop)
    folder = report_step(report_data(study, plans, found, ctx, opts), opts.out, console)
    export_step(folder, plans, opts, console)
    return stopped(opts, console) if stop() else 0


def export_step(folder, plans: Shortlist, opts: Options, console: Console) -> None:
    """best_plan.json, plans/*.json and launch.sh beside the report (search/export.py)."""
    launch_sh = export_plans(folder, list(plans.rows), cluster=opts.cluster, workload=opts.workload.spec,
                             optimizer=opts.workload.optimizer, study=opts.study, launch=opts.launch)
    if launch_sh is not None:
        best = load_plan_file(launch_sh.parent / "best_plan.json").label
        which = "measured" if timed_rows(list(plans.rows)) else "predicted"  # as best_row chose
        console.print(escape(f"train with the best {which} plan ({best}): bash {launch_sh}  "
                             f"(plan: {launch_sh.parent}/best_plan.json)"), soft_wrap=True)  # one line, to copy


def search_context(opts: Options, profiles: ProfileSet) -> SearchContext:
    """The cost model of this cluster and workload, and what the search may choose."""
    wl = opts.workload
    cost = CostModel(opts.cluster, profiles, wl.optimizer, has_batchnorm=wl.has_batchnorm,
                     batch_coupled=wl.batch_coupled, logits_per_sample_sq=wl.logits_per_sample_sq)
    return SearchContext(cost=cost, global_batch=opts.global_batch, precisions=opts.precisions,
                         checkpointing=opts.checkpointing, min_local_batch=opts.min_local_batch)


def progress(console: Console) -> Callable[[str], None]:
    """A step's progress lines, dimmed under the tables and bars."""
    return lambda msg: console.print(f"[dim]{escape(msg)}[/]")


def stopped(opts: Options, console: Console) -> int:
    console.print("[yellow]stopped early on Ctrl-C; the study keeps every finished trial and run: "
                  f"resume with --study {opts.study}[/]")
    return 130


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


def run(opts: Options, console: Console) -> int:
    """The main job with Ctrl-C handled as StopFlag says."""
    stop = StopFlag()
    stop.install(console)
    try:
        return main_job(opts, console, stop)
    finally:
        stop.uninstall()
