"""Fidelity: every plan of the suite predicted, then run for real on the default emulated cluster.

Writes results/bench/fidelity.json (the pairs the accuracy gate in tests/regression replays) and
asserts the bounds of hetsim.golden: step-time MAPE, peak-memory MAPE, Kendall's tau.

Measured step times are compared at the host speed the profiles were recorded at: every timed
step is taken beside hetsim.hostspeed's probe (this shared VM runs up to 30% slower in phases of
10-60 s).  The raw times and their MAPE are recorded beside them (`meas_raw_step_time_s`,
`step_time_mape_raw`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone

from bench_config import BENCH, GLOBAL_BATCH, RESULTS
from fidelity_suite import knobs, suite_plans

from hetsim import golden, strategies
from hetsim.hostspeed import profile_ref
from hetsim.runner import measure
from hetsim.serial import to_dict

STEPS = 16
WARMUP = 3
RUN_TIMEOUT_S = 300
MIN_PLANS = 20


def _rank_step_times(out_dir: str) -> list[list[float]]:
    """Every timed step of every rank, from the rank files the run left (for the noise figure)."""
    out = []
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("rank") and name.endswith(".json"):
            out.append(list(json.loads(open(os.path.join(out_dir, name)).read()).get("step_times_s", [])))
    return out


def _record(plan, pred, meas, out_dir: str, load_before: float, ref_probe_s: float) -> dict:
    strat = strategies.get(plan.strategy)
    rec = {
        "label": strat.label(plan),
        "strategy": plan.strategy,
        "knobs": knobs(plan),
        "plan": to_dict(plan),
        "status": meas.status,
        "pred_step_time_s": pred.step_time_s,
        "meas_step_time_s": meas.step_time_at(ref_probe_s),
        "meas_raw_step_time_s": meas.step_time_s,
        "probe_s": meas.probe_s,
        "pred_peak_mem_bytes": list(pred.peak_mem_bytes),
        "meas_peak_mem_bytes": list(meas.peak_mem_bytes) if meas.peak_mem_bytes else None,
        "meas_rank_step_times_s": list(meas.step_times_s),
        "load_avg_1m_before": load_before,
        "wall_s": meas.wall_s,
    }
    if meas.status == "ok":
        rec["step_time_err"] = golden.rel_err(pred.step_time_s, rec["meas_step_time_s"])
        rec["step_time_err_raw"] = golden.rel_err(pred.step_time_s, meas.step_time_s)
        rec["peak_mem_err"] = [golden.rel_err(p, m) for p, m in zip(pred.peak_mem_bytes, meas.peak_mem_bytes)]
        # Spread of the timed steps within each rank: a high value says the machine was busy.
        cvs = [statistics.pstdev(ts) / statistics.mean(ts) for ts in _rank_step_times(out_dir) if len(ts) > 1]
        rec["step_time_cv"] = max(cvs) if cvs else None
    else:
        rec["error"] = (meas.error or "")[-800:]
    return rec


def run_suite(plans, cost, cluster, workload, ref_probe_s: float) -> list[dict]:
    records = []
    for i, plan in enumerate(plans):
        strat = strategies.get(plan.strategy)
        pred, _, _ = strat.predict(plan, cost)
        out_dir = str(RESULTS / "runs" / "bench-fidelity" / f"plan-{i:02d}")
        load_before = os.getloadavg()[0]
        meas = measure(plan, cluster=cluster, workload_spec=workload.spec, optimizer=workload.optimizer,
                       steps=STEPS, warmup=WARMUP, timeout_s=RUN_TIMEOUT_S, out_dir=out_dir)
        rec = _record(plan, pred, meas, out_dir, load_before, ref_probe_s)
        records.append(rec)
        err = f"{rec['step_time_err']:+.1%}" if "step_time_err" in rec else meas.status
        host = f", host probe {meas.probe_s * 1e3:.1f} ms" if meas.probe_s else ""
        print(f"[{i + 1}/{len(plans)}] {rec['label']}: predicted {pred.step_time_s:.3f} s, "
              f"measured {rec['meas_step_time_s'] or float('nan'):.3f} s ({err}; raw "
              f"{meas.step_time_s or float('nan'):.3f} s{host})", flush=True)
    return records


def test_fidelity(benchmark, ctx, cost, cluster, workload, profiles):
    plans = suite_plans(ctx)
    assert len(plans) >= MIN_PLANS, f"the suite has {len(plans)} plans, fewer than {MIN_PLANS}"
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    ref = profile_ref(profiles.models.values())
    records = benchmark.pedantic(run_suite, args=(plans, cost, cluster, workload, ref), rounds=1, iterations=1)
    failed = [f"{r['label']}: {r['status']}: {r.get('error', '')[-300:]}" for r in records if r["status"] != "ok"]
    acc = golden.accuracy_of(records)
    raw = golden.accuracy_of([dict(r, meas_step_time_s=r["meas_raw_step_time_s"]) for r in records])
    result = {
        "n_plans": acc.n_plans,
        "step_time_mape": acc.step_time_mape,
        "step_time_max_err": acc.step_time_max_err,
        "peak_mem_mape": acc.peak_mem_mape,
        "kendall_tau": acc.kendall_tau,
        "step_time_mape_raw": raw.step_time_mape,
        "kendall_tau_raw": raw.kendall_tau,
        "host_ref_probe_s": ref,
        "bounds": {"step_time_mape_max": golden.STEP_TIME_MAPE_MAX, "peak_mem_mape_max": golden.PEAK_MEM_MAPE_MAX,
                   "kendall_tau_min": golden.KENDALL_TAU_MIN},
        "n_suite": len(records),
        "n_failed": len(failed),
        "model": workload.spec,
        "optimizer": workload.optimizer,
        "cluster": cluster.spec,
        "emulated": cluster.emulated,
        "global_batch": GLOBAL_BATCH,
        "steps": STEPS,
        "warmup": WARMUP,
        "profiles": golden.profile_digests(RESULTS, workload.spec),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "load_avg_at_start": list(load_start),
                    "load_avg_at_end": list(os.getloadavg())},
        "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t0,
        "plans": records,
    }
    BENCH.mkdir(parents=True, exist_ok=True)
    (BENCH / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    benchmark.extra_info.update({k: result[k] for k in ("n_plans", "step_time_mape", "step_time_max_err",
                                                         "peak_mem_mape", "kendall_tau", "n_failed")})
    assert not failed, "plans predicted to fit did not run:\n" + "\n".join(failed)
    assert acc.n_plans >= MIN_PLANS
    bad = acc.violations()
    assert not bad, f"fidelity bounds broken over {acc.n_plans} plans: {'; '.join(bad)} (see {BENCH / 'fidelity.json'})"
