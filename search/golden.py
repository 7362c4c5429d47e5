"""Golden expectations: what the recorded profiles predict, kept under results/golden/.

    python -m hetsim.search.golden            # compute every case, compare with results/golden/*.json, print the diff
    python -m hetsim.search.golden --write    # rewrite the golden files (what `nox -s regen` runs)
    python -m hetsim.search.golden --replay results/bench/fidelity.json --root results
                                              # a bench run predicted again by the current cost model
    python -m hetsim.search.golden --replay-runs results/bench/runs
                                              # every kept bench run so: each kind of plan's mean error

A case is a cluster, a workload and a seeded, in-memory Optuna search over the
strategy families, simulated from the profiles recorded under
results/profiles/ (nothing is measured, nothing is trained).  Its expectation is
the best plan, its predicted throughput, step time and peak memory per device,
the number of distinct feasible plans, and the prediction of every family's
baseline and example plans.  A deliberate change to the cost model or a
strategy's simulation therefore shows up as one reviewed diff of results/golden/.
The search draws its plans with `study.KeyedRandomSampler`, whose every value
follows from (seed, trial number, parameter name) through Python's `random`, not
with TPE: the plans a case visits, and so its expectation, stay the same under
another Optuna release (the CLI keeps TPE, which finds better plans in fewer trials).

This module also holds the accuracy arithmetic shared by the fidelity bench
(benchmarks/) and the accuracy gate (tests/regression/): MAPE and Kendall's tau
over recorded predicted-vs-measured pairs (Kendall's tau and top-1 regret from
hetsim.reporting.decision, which the main job's report uses too), and the bounds they must meet.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hetsim.search.study import KeyedRandomSampler, feasible_candidates, open_study, run_search
from hetsim.strategies.base import SearchContext

from hetsim import strategies
from hetsim.errors import ConfigError, HetsimError, InfeasiblePlanError
from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.store import (
    CommProfile,
    DeviceProfile,
    ModelProfile,
    ProfileSet,
    device_profile_path,
    load,
    model_profile_path,
    profile_dir,
)
from hetsim.reporting.decision import decision_quality, kendall_tau
from hetsim.reporting.metrics import mape, rel_err
from hetsim.serial import to_dict
from hetsim.workloads.builtin import workload_from_spec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
"""In a source checkout: the repository's results/ folder."""

REFERENCE_KIND = "emu-cpu"
"""The device kind whose recorded profiles the cases use (catalog devices scale from it)."""

HOST_MEMORY_BYTES = 64 * 2**30
"""Host RAM assumed by every case, so that offload feasibility does not depend on this machine's RAM."""

REL_TOL = 1e-3
"""Relative tolerance on predicted time, throughput and memory against the golden value.
Simulation is deterministic arithmetic over recorded data, so anything above float noise
is a change of the cost model or of a strategy's simulation: review it, then regenerate."""

# Bounds of the fidelity suite (the bench asserts them on a fresh run, the accuracy gate on the
# recorded pairs).  Errors are fractions: 0.05 is 5 %.
STEP_TIME_MAPE_MAX = 0.05
PEAK_MEM_MAPE_MAX = 0.10
KENDALL_TAU_MIN = 0.8


# ----------------------------------------------------------------------------- accuracy arithmetic




@dataclass(frozen=True, kw_only=True, slots=True)
class Accuracy:
    """Accuracy of a set of executed plans."""

    n_plans: int
    step_time_mape: float
    step_time_max_err: float
    peak_mem_mape: float
    kendall_tau: float
    top1_regret: float
    """1 - measured throughput of the plan predicted fastest / fastest measured (hetsim.reporting.decision)."""

    def violations(self) -> list[str]:
        """Each bound the figures break, with the value and the limit."""
        out = []
        if self.step_time_mape > STEP_TIME_MAPE_MAX:
            out.append(f"step-time MAPE {self.step_time_mape:.3f} > {STEP_TIME_MAPE_MAX}")
        if self.peak_mem_mape > PEAK_MEM_MAPE_MAX:
            out.append(f"peak-memory MAPE {self.peak_mem_mape:.3f} > {PEAK_MEM_MAPE_MAX}")
        if self.kendall_tau < KENDALL_TAU_MIN:
            out.append(f"Kendall tau {self.kendall_tau:.3f} < {KENDALL_TAU_MIN}")
        return out


def accuracy_of(records: Sequence[dict]) -> Accuracy:
    """Accuracy over fidelity records (dicts with pred/meas step time and peak memory per device);
    records whose run did not finish ('status' other than 'ok') are left out."""
    ok = [r for r in records if r.get("status") == "ok"]
    if len(ok) < 2:
        raise ValueError(f"accuracy needs >= 2 executed plans, got {len(ok)} of {len(records)}")
    steps = [(r["pred_step_time_s"], r["meas_step_time_s"]) for r in ok]
    # Throughput as 1 / step time: every plan of a suite has the same global batch, which cancels.
    decision = decision_quality([(1.0 / p, 1.0 / m) for p, m in steps])
    mems = [(p, m) for r in ok for p, m in zip(r["pred_peak_mem_bytes"], r["meas_peak_mem_bytes"])]
    return Accuracy(
        n_plans=len(ok),
        step_time_mape=mape(steps),
        step_time_max_err=max(abs(rel_err(p, m)) for p, m in steps),
        peak_mem_mape=mape(mems),
        kendall_tau=kendall_tau([p for p, _ in steps], [m for _, m in steps]),
        top1_regret=decision.top1_regret,
    )


# ----------------------------------------------------------------------------- recorded profiles


def profile_paths(root: Path, model_spec: str, kind: str = REFERENCE_KIND) -> list[Path]:
    """The recorded files a cost model for this workload reads: device, model, collectives."""
    base = profile_dir(root, kind)
    return [device_profile_path(root, kind), model_profile_path(root, kind, model_spec),
            *sorted(base.glob("comm-*.json"))]


def profile_digests(root: Path, model_spec: str, kind: str = REFERENCE_KIND) -> dict[str, str]:
    """sha256 of each recorded profile file, keyed by its path under root (what a fidelity run used)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in profile_paths(root, model_spec, kind) if p.exists()}


def recorded_profiles(root: Path, model_spec: str, kind: str = REFERENCE_KIND):
    """The ProfileSet recorded under root/profiles/ for this workload, without the fingerprint check:
    the point is to replay what was measured on the recording machine, on any machine."""
    device, model, *comms = profile_paths(root, model_spec, kind)
    missing = [str(p) for p in (device, model) if not p.exists()]
    if missing:
        raise ConfigError(
            f"recorded profile(s) {', '.join(missing)} missing; run `nox -s bench` (it records them) "
            f"or `python -m hetsim.search --model {model_spec.split('@')[0]} --top-k 1`"
        )
    comm = {c.world_size: c for c in (load(CommProfile, p) for p in comms)}
    return ProfileSet(models={kind: load(ModelProfile, model)}, devices={kind: load(DeviceProfile, device)}, comm=comm)


def replay(fidelity: dict, root: Path) -> list[dict]:
    """The executed plans of a fidelity run (`nox -s bench`'s fidelity.json) predicted again by the
    current cost model from the profiles recorded under root/profiles/, beside the run's measurements:
    the records of `accuracy_of` with fresh predictions.  A bench run whose profiles are kept (see
    results/README.md) is a dataset on which a cost-model change can be judged without running anything."""
    wl = workload_from_spec(fidelity["model"], fidelity.get("optimizer", "adamw"))  # the gpt suite's runs name none
    cluster = dataclasses.replace(parse_cluster(fidelity["cluster"]), host_memory_bytes=HOST_MEMORY_BYTES)
    cost = CostModel(cluster, recorded_profiles(root, fidelity["model"]), wl.optimizer,
                     has_batchnorm=wl.has_batchnorm, batch_coupled=wl.batch_coupled)
    out = []
    for r in fidelity["plans"]:
        if r["status"] != "ok":
            continue
        plan = strategies.plan_from_dict(r["plan"])
        pred, _, _ = strategies.get(plan.strategy).predict(plan, cost)
        out.append(dict(r, pred_step_time_s=pred.step_time_s, pred_peak_mem_bytes=list(pred.peak_mem_bytes)))
    return out


def replay_runs(folder: Path) -> list[tuple[Path, list[dict]]]:
    """`replay` of every kept bench run under `folder` (results/bench/runs): each fidelity file
    (`fidelity*-STAMP.json`) whose recording (`recording-STAMP`, the part of the name after the suite's)
    is kept beside it with profiles of its cluster's size, in name order."""
    out = []
    for path in sorted(folder.glob("fidelity*-*.json")):
        root = folder / f"recording-{path.stem.split('-', 1)[1]}"
        fidelity = json.loads(path.read_text())
        n = len(parse_cluster(fidelity["cluster"]).devices)
        # The tensor-parallel suite records its four-device cluster in a folder of its own, not kept.
        if any(root.glob(f"profiles/*/comm-{n}.json")):
            out.append((path, replay(fidelity, root)))
    return out


def _print_runs(runs: list[tuple[Path, list[dict]]]) -> None:
    """Each run's step-time MAPE, then each kind of plan (suite, family and knobs) over the runs: its
    mean signed error, whose sign says which way the cost model leans on it, and its mean absolute one."""
    kinds: dict[str, list[float]] = {}
    for path, records in runs:
        acc = accuracy_of(records)
        print(f"{path.name}: step-time MAPE {acc.step_time_mape:.4f} (max {acc.step_time_max_err:.3f}) over "
              f"{acc.n_plans} plans")
        for r in records:
            knobs = ", ".join(f"{k} {v}" for k, v in r["knobs"].items() if k != "strategy")
            kind = f"{path.name.split('-', 1)[0]}: {r['strategy']} ({knobs})"
            kinds.setdefault(kind, []).append(rel_err(r["pred_step_time_s"], r["meas_step_time_s"]))
    print(f"by kind of plan over {len(runs)} runs (mean signed error, mean absolute error, runs):")
    for kind, errs in sorted(kinds.items(), key=lambda kv: -abs(sum(kv[1]) / len(kv[1]))):
        print(f"  {sum(errs) / len(errs):+7.1%} {sum(map(abs, errs)) / len(errs):6.1%} {len(errs):3d}  {kind}")


def _print_replay(fidelity_path: Path, records: list[dict], root: Path) -> None:
    acc = accuracy_of(records)
    print(f"{fidelity_path} replayed from {root / 'profiles'}: step-time MAPE {acc.step_time_mape:.4f} "
          f"(max {acc.step_time_max_err:.3f}), peak-memory MAPE {acc.peak_mem_mape:.4f}, "
          f"Kendall tau {acc.kendall_tau:.3f}, top-1 regret {acc.top1_regret:.1%} over {acc.n_plans} plans")
    for r in records:
        print(f"  {rel_err(r['pred_step_time_s'], r['meas_step_time_s']):+7.1%}  {r['label']}")


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    name: str
    """File name under results/golden/ (without .json)."""
    cluster: str
    """A --cluster spec (emulated or catalog: nothing here is run)."""
    model: str = "resnet18@64"
    """Workload spec whose profile is recorded under results/profiles/."""
    global_batch: int = 32
    trials: int = 120
    """Seeded `KeyedRandomSampler` trials, own plans included (in-memory storage)."""
    seed: int = 0
    precisions: tuple[str, ...] = ("fp32", "bf16")
    optimizer: str = "adamw"


CASES: tuple[Case, ...] = (
    # The machine's default emulated cluster: what `python -m hetsim.search` plans on a CPU box.
    Case(name="emu-default", cluster="emu:1.0@4G,0.5@2G"),
    # Caps below what plain DDP holds (~180 MiB of parameters, gradients and AdamW state for
    # 11.7 M parameters, plus activations): the memory model decides what fits.
    Case(name="emu-tight-memory", cluster="emu:1.0@200M,0.5@150M"),
    # Four mismatched devices: collectives of 4 are extrapolated from the recorded group of 2.
    Case(name="emu-four", cluster="emu:1.0@4G,1.0@2G,0.5@2G,0.25@1G", global_batch=64),
    # What-if planning on GPUs we do not have, scaled from this machine's CPU profile.
    Case(name="catalog-mixed", cluster="catalog:rtx_3090,gtx_1080_ti*2,t4", global_batch=64,
         precisions=("fp32", "bf16", "fp16")),
)


def _context(case: Case, root: Path) -> SearchContext:
    """The case's search context: its cluster (with a fixed host memory) costed from the recorded profiles."""
    cluster = dataclasses.replace(parse_cluster(case.cluster), host_memory_bytes=HOST_MEMORY_BYTES)
    wl = workload_from_spec(case.model, case.optimizer)
    profiles = recorded_profiles(root, case.model)
    cost = CostModel(cluster, profiles, case.optimizer, has_batchnorm=wl.has_batchnorm,
                     batch_coupled=wl.batch_coupled)
    precisions = tuple(p for p in case.precisions if p != "fp16" or not cluster.emulated)
    return SearchContext(cost=cost, global_batch=case.global_batch, precisions=precisions)


def _prediction(strat, plan, cost) -> dict:
    pred, _, _ = strat.predict(plan, cost)
    return {"label": strat.label(plan), "plan": _plain(plan), "feasible": pred.feasible,
            "step_time_s": pred.step_time_s, "samples_per_s": pred.samples_per_s,
            "peak_mem_bytes": list(pred.peak_mem_bytes)}


def _plain(plan) -> dict:
    return json.loads(json.dumps(to_dict(plan)))


def _canonical(plan: dict | None) -> dict | None:
    """A recorded plan as the plan type reads it today: a field added since (with its default, e.g.
    `grad_cache_chunks`) does not make an old golden plan a different plan."""
    if plan is None:
        return None
    try:
        return _plain(strategies.plan_from_dict(plan))
    except (HetsimError, TypeError, KeyError, ValueError):  # a plan of an unknown family, or malformed
        return plan


def compute(case: Case, root: Path = RESULTS, families: Sequence[str] | None = None) -> dict:
    """The case's expectation: fixed plans of every family, then the best plan of a seeded search."""
    ctx = _context(case, root)
    names = list(families) if families is not None else strategies.names()
    fixed: dict[str, list[dict]] = {}
    for name in names:
        strat = strategies.get(name)
        rows, seen = [], set()
        try:
            plans = strat.own_plans(ctx)
        except InfeasiblePlanError as e:  # a family may have no valid example on a tight cluster
            plans = []
            rows.append({"label": f"{name} examples", "plan": None, "invalid": str(e)})
        for plan in plans:
            key = json.dumps(_plain(plan), sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            try:
                rows.append(_prediction(strat, plan, ctx.cost))
            except InfeasiblePlanError as e:
                rows.append({"label": strat.label(plan), "plan": _plain(plan), "invalid": str(e)})
        fixed[name] = rows
    study = open_study(f"golden-{case.name}", None, case.seed, sampler=KeyedRandomSampler(case.seed))
    run_search(study, ctx, names, case.trials, sampler="tpe")  # trial by trial on the keyed sampler
    cands = feasible_candidates(study)
    best = None
    if cands:
        c = cands[0]
        best = _prediction(strategies.get(c.plan.strategy), c.plan, ctx.cost)
        best["trial"] = c.trial_number
    return {"case": _plain(case), "strategies": names, "best": best, "n_feasible_plans": len(cands),
            "fixed_plans": fixed}


# ----------------------------------------------------------------------------- comparison


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12)


def _diff_prediction(where: str, want: dict | None, have: dict | None) -> list[str]:
    if want is None or have is None:
        return [] if want is have else [f"{where}: golden {want and want['label']!r} != now {have and have['label']!r}"]
    out = []
    if _canonical(want.get("plan")) != _canonical(have.get("plan")):
        out.append(f"{where}: plan changed: golden {want['label']!r} != now {have['label']!r}")
        return out
    if "invalid" in want or "invalid" in have:
        if want.get("invalid") != have.get("invalid"):
            out.append(f"{where} {have['label']}: invalid: golden {want.get('invalid')!r} != now {have.get('invalid')!r}")
        return out
    if want["feasible"] != have["feasible"]:
        out.append(f"{where} {have['label']}: feasible golden {want['feasible']} != now {have['feasible']}")
    for key in ("step_time_s", "samples_per_s"):
        if not _close(want[key], have[key]):
            out.append(f"{where} {have['label']}: {key} golden {want[key]:.6g} != now {have[key]:.6g} "
                       f"({rel_err(have[key], want[key]):+.2%})")
    wm, hm = want["peak_mem_bytes"], have["peak_mem_bytes"]
    if len(wm) != len(hm) or not all(_close(a, b) for a, b in zip(wm, hm)):
        out.append(f"{where} {have['label']}: peak MiB golden {[round(b / 2**20, 1) for b in wm]} "
                   f"!= now {[round(b / 2**20, 1) for b in hm]}")
    return out


def compare(golden: dict, now: dict) -> tuple[list[str], list[str]]:
    """(differences, notes): differences fail the regression test; notes (families registered since
    the golden file was written) only ask for a regeneration."""
    diffs: list[str] = []
    notes: list[str] = []
    if golden.get("case") != now.get("case"):
        diffs.append(f"case definition changed: golden {golden.get('case')} != now {now.get('case')}")
    diffs += _diff_prediction("best plan", golden.get("best"), now.get("best"))
    if golden.get("n_feasible_plans") != now.get("n_feasible_plans"):
        diffs.append(f"distinct feasible plans found: golden {golden.get('n_feasible_plans')} "
                     f"!= now {now.get('n_feasible_plans')}")
    for name, want_rows in golden.get("fixed_plans", {}).items():
        have_rows = now.get("fixed_plans", {}).get(name)
        if have_rows is None:
            diffs.append(f"family {name!r} has golden plans but was not computed now")
            continue
        # Matched by plan, not position: a family that adds an example shows one new plan.
        want = {json.dumps(_canonical(r["plan"]), sort_keys=True): r for r in want_rows}
        have = {json.dumps(_canonical(r["plan"]), sort_keys=True): r for r in have_rows}
        for k, w in want.items():
            if k not in have:
                diffs.append(f"{name}: fixed plan {w['label']!r} is gone")
            else:
                diffs += _diff_prediction(f"{name} fixed plan", w, have[k])
        diffs += [f"{name}: new fixed plan {h['label']!r}" for k, h in have.items() if k not in want]
    return diffs, notes


def golden_path(case: Case, root: Path = RESULTS) -> Path:
    return Path(root) / "golden" / f"{case.name}.json"


def check(case: Case, root: Path = RESULTS) -> tuple[dict, list[str], list[str]]:
    """Compute a case with the families its golden file lists; (now, differences, notes)."""
    path = golden_path(case, root)
    if not path.exists():
        now = compute(case, root)
        return now, [f"{path} does not exist; run `nox -s regen` (python -m hetsim.search.golden --write)"], []
    golden = json.loads(path.read_text())
    registered = strategies.names()
    gone = [n for n in golden["strategies"] if n not in registered]
    if gone:
        now = compute(case, root, [n for n in golden["strategies"] if n in registered])
        return now, [f"families {gone} are in the golden file but no longer registered"], []
    now = compute(case, root, golden["strategies"])
    diffs, notes = compare(golden, now)
    new = [n for n in registered if n not in golden["strategies"]]
    if new:
        notes.append(f"families {new} were registered after {path.name} was written; "
                     "run `nox -s regen` to include them")
    return now, diffs, notes


def write(now: dict, case: Case, root: Path = RESULTS) -> Path:
    path = golden_path(case, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(now, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hetsim.search.golden",
                                description="Compare (or, with --write, rewrite) results/golden/ from the recorded profiles.")
    p.add_argument("--write", action="store_true", help="rewrite the golden files with what is computed now")
    p.add_argument("--root", default=str(RESULTS), help="results folder holding profiles/ and golden/")
    p.add_argument("--case", action="append", default=None, help="only this case (repeatable)")
    p.add_argument("--replay", metavar="FIDELITY_JSON", default=None,
                   help="instead: predict a bench run's executed plans again from the profiles under --root "
                        "and print each plan's error against its measurement")
    p.add_argument("--replay-runs", metavar="DIR", default=None,
                   help="instead: replay every kept bench run under DIR (results/bench/runs: fidelity files "
                        "beside their recording-STAMP folders) and print each run's MAPE and each kind of "
                        "plan's mean error over the runs")
    args = p.parse_args(argv)
    root = Path(args.root)
    if args.replay_runs is not None:
        try:
            runs = replay_runs(Path(args.replay_runs))
        except (HetsimError, OSError, KeyError, ValueError) as e:
            print(f"hetsim.search.golden: error: cannot replay the runs under {args.replay_runs}: {e}; give a "
                  "folder of fidelity*-STAMP.json files with their recording-STAMP/profiles folders", file=sys.stderr)
            return 2
        if not runs:
            print(f"hetsim.search.golden: error: no fidelity*-STAMP.json with a recording-STAMP/profiles folder "
                  f"under {args.replay_runs}; give results/bench/runs or a folder laid out like it", file=sys.stderr)
            return 2
        _print_runs(runs)
        return 0
    if args.replay is not None:
        try:
            records = replay(json.loads(Path(args.replay).read_text()), root)
        except (HetsimError, OSError, KeyError, ValueError) as e:
            print(f"hetsim.search.golden: error: cannot replay {args.replay} from {root / 'profiles'}: {e}; "
                  "give a fidelity.json written by `nox -s bench` and the folder holding its profiles/",
                  file=sys.stderr)
            return 2
        _print_replay(Path(args.replay), records, root)
        return 0
    cases = [c for c in CASES if args.case is None or c.name in args.case]
    if args.case and len(cases) != len(args.case):
        known = ", ".join(c.name for c in CASES)
        print(f"hetsim.search.golden: unknown case in {args.case}; known: {known}", file=sys.stderr)
        return 2
    changed = 0
    try:
        for case in cases:
            if args.write:
                path = golden_path(case, root)
                old = json.loads(path.read_text()) if path.exists() else None
                now = compute(case, root)
                diffs, _ = compare(old, now) if old is not None else ([f"new file {path}"], [])
                write(now, case, root)
                notes = []
            else:
                now, diffs, notes = check(case, root)
            best = now["best"]["label"] if now["best"] else "no feasible plan"
            status = "changed" if diffs else "same"
            print(f"{case.name}: {status}; best {best}"
                  + (f" at {now['best']['samples_per_s']:.2f} samples/s" if now["best"] else ""))
            for line in diffs:
                print(f"  - {line}")
            for line in notes:
                print(f"  note: {line}")
            changed += bool(diffs)
    except HetsimError as e:
        print(f"hetsim.search.golden: error: {e}", file=sys.stderr)
        return 2
    if args.write:
        print(f"wrote {len(cases)} golden file(s) under {root / 'golden'}; review the diff before committing")
        return 0
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
