"""The real-runs step: every shortlisted plan runs through torchrun's launcher (`--repeats` times, the
median run kept) once per study; a measurement is stored in the study as it finishes, so a resumed
study never runs the same plan again.

Local runs go through the warm launcher, as calibration's do (`hetsim.execution.warm`: torchrun's
`elastic_launch`, fresh ranks forked from one warm agent), so that a plan's measurement and the terms
calibrated for it share one launch path.  gpt@tiny@64 ddp 16/16 on the default cluster, 2026-12-03,
runs interleaved: a torchrun command measured 8-25 % slower than forked ranks at the profiles' host
speed (three experiments of 4-6 pairs, raw steps +3 %), while every calibrated term came from forked
ranks; the search's executed plans then all read 9-16 % slow.  `launch.sh` stays a torchrun command.
A run with an injected fault (tests) stays one too."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
from collections.abc import Callable

import optuna
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hetsim.execution.runner import measure
from hetsim.execution.warm import warm_launches
from hetsim.hardware.cluster import Cluster
from hetsim.names import CALIB_REPEATS, MORE_RUNS
from hetsim.profiling.obtain import Say
from hetsim.reporting import report
from hetsim.reporting.decision import NOISE_FLOOR_REL
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
    with (contextlib.nullcontext() if fault is not None else warm_launches()), \
            Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
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
    """The real runs of a shortlisted plan (`repeated_runs`: `opts.repeats`, more while no two agree),
    combined by `combine_runs`; a run that fails ends the plan's runs with its status.  Logs and rank
    files under OUT/runs/STUDY/run-RANK/ (the later runs: run-RANK-2/, run-RANK-3/, ...)."""
    wl = opts.workload
    runs = repeated_runs(
        lambda k: measure(row.plan, cluster=opts.cluster, workload_spec=wl.spec, optimizer=wl.optimizer,
                          steps=opts.steps, warmup=opts.warmup, timeout_s=opts.timeout_s, seed=opts.seed,
                          out_dir=str(opts.out / "runs" / opts.study / f"run-{row.place}{f'-{k + 1}' if k else ''}"),
                          launch_cfg=opts.launch, fault=fault if k == 0 else None),
        opts.repeats)
    last = runs[-1]
    return combine_runs(runs) if last.timed else last


def _at_probe(m: Measurement) -> float:
    return m.steps_per_probe if m.steps_per_probe is not None else m.step_time_s


def repeated_runs(run: Callable[[int], Measurement], repeats: int, at: Callable[[Measurement], float] = _at_probe,
                  on_disagree: Callable[[float, float], None] | None = None) -> list[Measurement]:
    """The real runs of one plan, `run(k)` making the k-th: `repeats` of them and, with two or more, more
    (up to `MORE_RUNS`) while no two agree (by `at`, a step time at one host speed) within the noise floor
    (`NOISE_FLOOR_REL`), so that runs caught in slow phases of a shared host are out-voted (`consensus`, the
    median).
    gpt@tiny@64, 2026-12-03: a ddp plan's three runs read 11.5, 9.9 and 17.8 probe times; their median
    made it 19 % slower than predicted, and with a fourth run of about 10 it reads 10.8.  Stops at a failing run, which is then the last.  Shared by the
    executed plans and calibration (`robust_step_s`)."""
    return runs_in_turn([run], repeats, at, None if on_disagree is None else lambda i, lo, hi: on_disagree(lo, hi))[0]


def runs_in_turn(runs: list[Callable[[int], Measurement]], repeats: int, at: Callable[[Measurement], float] = _at_probe,
                 on_disagree: Callable[[int, float, float], None] | None = None,
                 on_run: Callable[[int, int], None] | None = None) -> list[list[Measurement]]:
    """`repeated_runs` of several plans at once, taken in turn: round k runs the k-th run of every plan
    that still needs one, so that each plan's runs lie minutes apart and every plan meets the same phases
    of the host.  `on_disagree(i, lo, hi)` before plan i's run past `repeats`; `on_run(i, k)` before
    every run (plan i's k-th, from 0)."""
    done: list[list[Measurement]] = [[] for _ in runs]
    active = list(range(len(runs)))
    for k in range(repeats + MORE_RUNS):
        going = []
        for i in active:
            if k >= repeats:
                vals = [at(r) for r in done[i]]
                if len(vals) < 2 or _closest_gap(vals) <= NOISE_FLOOR_REL:
                    continue
                if on_disagree is not None:
                    on_disagree(i, min(vals), max(vals))
            if on_run is not None:
                on_run(i, k)
            done[i].append(runs[i](k))
            if done[i][-1].timed:
                going.append(i)
        active = going
    return done


def agreeing(vals: list[float]) -> list[int]:
    """Which of a plan's runs give its one value: the middle one of an odd number, the middle two of an
    even number (all of one or two), so that their mean is the runs' median.  A run that drifted either
    way does not move it, and every run counts towards which are in the middle.  Until 2026-12-07 the two
    that agree best were kept; resampling the bench's pass residuals (`hetsim.names.CALIB_REPEATS`), that
    rule read two recordings' terms 2.05 % apart with two runs and 2.10 % with four, the median 1.90 and
    1.45 %."""
    if len(vals) <= 2:
        return list(range(len(vals)))
    order = sorted(range(len(vals)), key=vals.__getitem__)
    mid = len(vals) // 2
    return sorted(order[mid - 1:mid + 1] if len(vals) % 2 == 0 else order[mid:mid + 1])


def _closest_gap(vals: list[float]) -> float:
    """How far apart the two runs that agree best are (a fraction of the lower)."""
    s = sorted(vals)
    return min(b / a - 1 for a, b in zip(s, s[1:]))


def consensus(vals: list[float]) -> float:
    """One value of a plan's runs: their median (the mean of the `agreeing` ones)."""
    return statistics.fmean(vals[i] for i in agreeing(vals))


def robust_step_s(plan, *, cluster: Cluster, workload, ref_probe_s: float, steps: int, say: Say,
                  timeout_s: float = 600, repeats: int = CALIB_REPEATS):
    """(last measurement, step time at the profiles' host speed or None): the real runs of `plan`
    (`repeated_runs`: the search's --calib-repeats, more while no two agree) and their `consensus`.  None when
    a run fails (the failing measurement says why)."""
    runs = _TAKEN.pop(_taken_key(plan, cluster), None)
    if runs is None:
        runs = repeated_runs(
            lambda k: _calibration_run(plan, cluster, workload, steps, timeout_s, say), repeats,
            at=lambda m: m.step_time_at(ref_probe_s),
            on_disagree=lambda a, b: say(f"  the runs disagree ({a:.3f} to {b:.3f} s at the profiles' host speed): "
                                         "one more"))
    m = runs[-1]
    if not m.timed:
        return m, None
    return m, consensus([r.step_time_at(ref_probe_s) for r in runs])


HUNG_RETRIES = 1
"""Times a calibration run that timed out is run again before its term is given up, as torchrun's
`--max-restarts` restarts a worker group.  A calibration run is a few steps (seconds to a minute here), so
a timeout is a hung rank, not a slow plan, and a term given up moves every prediction of its family for
the whole recording: in the bench of 2026-12-07 23:07 one run of a pp2 x tp2 term (6 steps of about
0.12 s) hung until its 600 s timeout, the term stayed uncalibrated, and the pp x tp plans then read 30 %
off (tp MAPE 0.144), the first calibration timeout in the kept benches (results/README.md).  An executed
plan is not retried: its timeout is the user's `--timeout`, and a slow plan's is its answer."""


def _calibration_run(plan, cluster: Cluster, workload, steps: int, timeout_s: float, say: Say) -> Measurement:
    def run() -> Measurement:
        return measure(plan, cluster=cluster, workload_spec=workload.spec, optimizer=workload.optimizer, steps=steps,
                       warmup=3, timeout_s=timeout_s)

    m = run()
    for _ in range(HUNG_RETRIES):
        if m.status != "timeout":
            break
        say(f"  the run timed out after {timeout_s:g} s (a rank hung): once more")
        m = run()
    return m


_TAKEN: dict[tuple[str, str], list[Measurement]] = {}
"""Runs made ahead by `taken_in_turn`, by `_taken_key`, until `robust_step_s` asks for them."""


def _taken_key(plan, cluster: Cluster | None) -> tuple[str, str]:
    return repr(plan), repr(getattr(cluster, "devices", None))


@contextlib.contextmanager
def taken_in_turn(plans: list[tuple], *, cluster: Cluster | None, workload, ref_probe_s: float, steps: int,
                  say: Say, timeout_s: float = 600, repeats: int = CALIB_REPEATS):
    """Run the calibration plans ((label, plan) on `cluster`, or (label, plan, its own cluster)) of several
    terms in turn (`runs_in_turn`) before the terms are solved one after the other: inside the block,
    `robust_step_s` of one of them reads its runs instead of running it.  Two recordings made back to back
    on this host (resnet18@64, 2026-12-05) had measured ZeRO-3/2/1 terms of 124/54/23 and 59/-13/-12 ms
    beside data-parallel terms of 48 and 51 ms: each term's runs, back to back, agreed within 5 %, and the
    host's collectives had changed speed between one term's runs and the next."""
    entries = [(p[0], p[1], p[2] if len(p) > 2 else cluster) for p in plans]
    if len(entries) > 1:
        say(f"calibration runs of {len(entries)} plans taken in turn, {repeats} rounds: "
            + "; ".join(label for label, _, _ in entries))
        started = itertools.count(1)
        runs = runs_in_turn(
            [lambda k, p=p, c=c: _calibration_run(p, c, workload, steps, timeout_s, say) for _, p, c in entries], repeats,
            at=lambda m: m.step_time_at(ref_probe_s),
            on_disagree=lambda i, a, b: say(f"  {entries[i][0]}: the runs disagree ({a:.3f} to {b:.3f} s at the "
                                            "profiles' host speed): one more"),
            # One line a run, as profiling prints one a micro-batch: these runs take minutes in all.
            on_run=lambda i, k: say(f"  calibration run {next(started)} of {len(entries) * repeats}"
                                    f"{' (one more)' if k >= repeats else ''}: {entries[i][0]} (round {k + 1})"))
        _TAKEN.update({_taken_key(p, c): r for (_, p, c), r in zip(entries, runs)})
    try:
        yield
    finally:
        for _, p, c in entries:
            _TAKEN.pop(_taken_key(p, c), None)


def combine_runs(runs: list[Measurement]) -> Measurement:
    """One measurement of several ok runs of a plan: the `agreeing` runs' mean step, i.e. the median run
    (raw, and in probe times: the host speed the report compares at), the first run's memory and timeline, every run's
    step in probe times kept in `runs_at_probe`."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    use = [runs[i] for i in agreeing([_at_probe(m) for m in runs])]
    step = statistics.fmean(m.step_time_s for m in use)
    probed = all(m.steps_per_probe is not None and m.probe_s for m in runs)
    return dataclasses.replace(
        first, step_time_s=step, samples_per_s=first.samples_per_s * first.step_time_s / step,
        steps_per_probe=statistics.fmean(m.steps_per_probe for m in use) if probed else None,
        probe_s=statistics.fmean(m.probe_s for m in use) if probed else first.probe_s,
        wall_s=sum(m.wall_s for m in runs), runs_at_probe=tuple(_at_probe(m) for m in runs))
