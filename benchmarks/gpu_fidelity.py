"""Fidelity on real GPUs: the fidelity suite's plans predicted, then run, on `--cluster cuda`.

    python benchmarks/gpu_fidelity.py --out results/gpu/h200 [--model resnet50] [--global-batch 64]

Profiles are obtained as the CLI obtains them (measured, calibrated, recorded under OUT/profiles/),
then each plan of the suite is predicted and executed through the same runner; the records are
written to OUT/fidelity.json after every plan, so a run cut short keeps what it measured.
Not part of `nox -s bench` (CI has no GPU): run it where GPUs are.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from fidelity_suite import suite_plans
from hetsim.search import golden
from hetsim.search.profiles import obtain_profiles
from hetsim.strategies.base import SearchContext
from test_fidelity import _record

from hetsim import strategies
from hetsim.execution.runner import measure
from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.hostspeed import profile_ref
from hetsim.workloads.builtin import default_image_size, load_workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cluster", default="cuda")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--model-size", default=None, help="gpt/bert/vit preset (tiny, small, base, ...)")
    p.add_argument("--seq-len", type=int, default=None, help="gpt/bert sequence length")
    p.add_argument("--precisions", default="fp32,bf16,fp16")
    p.add_argument("--plans", type=int, default=12, help="suite size")
    p.add_argument("--strategies", default="", help="run only the suite's plans of these families (comma list)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--budget-s", type=float, default=240.0,
        help="start no new plan's run after this many seconds of runs (profiling and calibration not counted: "
        "on an H200, 2026-12-04, calibration took 280 s and a budget counted from the start left 2 of 12 plans run)",
    )
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = parse_cluster(a.cluster)
    print(cluster.describe(), flush=True)
    size = a.image_size or default_image_size(a.model, cluster.source != "cuda")
    workload = load_workload(a.model, size, size=a.model_size, seq_len=a.seq_len)
    precisions = tuple(s for s in a.precisions.split(",") if s)
    precisions = tuple(
        pr for pr in precisions if pr == "fp32" or all(_supports(d, pr) for d in cluster.devices)
    )
    profiles = obtain_profiles(
        cluster,
        workload,
        root=out,
        global_batch=a.global_batch,
        precisions=precisions,
        say=lambda s: print(s, flush=True),
    )
    cost = CostModel(
        cluster,
        profiles,
        workload.optimizer,
        has_batchnorm=workload.has_batchnorm,
        batch_coupled=workload.batch_coupled,
    )
    ctx = SearchContext(cost=cost, global_batch=a.global_batch, precisions=precisions)
    plans = suite_plans(ctx, a.plans)
    ref = profile_ref(profiles.models.values())  # 0 on GPUs: their times are not host-speed probed
    if a.strategies:
        plans = [p for p in plans if p.strategy in a.strategies.split(",")]
    print(f"{len(plans)} plans; profiles after {time.perf_counter() - t0:.0f} s", flush=True)
    records: list[dict] = []
    t_runs = time.perf_counter()
    for i, plan in enumerate(plans):
        if time.perf_counter() - t_runs > a.budget_s:
            print(f"budget of {a.budget_s:.0f} s spent: {len(plans) - i} plans not run", flush=True)
            break
        pred, _, _ = strategies.get(plan.strategy).predict(plan, cost)
        run_dir = out / "runs" / f"plan-{i:02d}"
        meas = measure(
            plan,
            cluster=cluster,
            workload_spec=workload.spec,
            optimizer=workload.optimizer,
            steps=a.steps,
            warmup=a.warmup,
            timeout_s=180,
            out_dir=str(run_dir),
        )
        rec = _record(plan, pred, [(meas, str(run_dir), os.getloadavg()[0])], ref)
        records.append(rec)
        err = (
            f"{rec['step_time_err']:+.1%}"
            if "step_time_err" in rec
            else f"{meas.status}: {(meas.error or '')[-300:]}"
        )
        mem = ", ".join(f"{e:+.1%}" for e in rec.get("peak_mem_err", []))
        print(
            f"[{i + 1}/{len(plans)}] {rec['label']}: predicted {pred.step_time_s * 1e3:.1f} ms, measured "
            f"{(rec['meas_step_time_s'] or float('nan')) * 1e3:.1f} ms ({err}); peak memory error {mem or '-'}",
            flush=True,
        )
        _write(out, a, cluster, workload, records, t0)
    acc = _write(out, a, cluster, workload, records, t0)
    if acc is None:
        print(
            f"{sum(r['status'] == 'ok' for r in records)} of {len(records)} runs finished: no accuracy figures",
            flush=True,
        )
        return 1
    print(
        f"step-time MAPE {acc.step_time_mape:.3f} (max {acc.step_time_max_err:.3f}), peak-memory MAPE "
        f"{acc.peak_mem_mape:.3f}, Kendall tau {acc.kendall_tau:.2f}, top-1 regret {acc.top1_regret:.1%} "
        f"over {acc.n_plans} plans",
        flush=True,
    )
    return 0


def _supports(dev, precision: str) -> bool:
    """bf16 where the device has it (compute capability >= 8.0); fp16 with loss scaling on CUDA only."""
    if precision == "bf16":
        return dev.supports_bf16
    return precision != "fp16" or dev.backend == "cuda"


def _write(out: Path, a, cluster, workload, records: list[dict], t0: float):
    import torch

    try:
        acc = golden.accuracy_of(records)
    except ValueError:  # fewer than two finished runs so far
        acc = None
    result = {
        "n_plans": acc.n_plans if acc else 0,
        "step_time_mape": acc.step_time_mape if acc else None,
        "step_time_max_err": acc.step_time_max_err if acc else None,
        "peak_mem_mape": acc.peak_mem_mape if acc else None,
        "kendall_tau": acc.kendall_tau if acc else None,
        "top1_regret": acc.top1_regret if acc else None,
        "model": workload.spec,
        "optimizer": workload.optimizer,
        "cluster": cluster.spec,
        "devices": [d.name for d in cluster.devices],
        "global_batch": a.global_batch,
        "steps": a.steps,
        "warmup": a.warmup,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t0,
        "plans": records,
    }
    (out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    return acc


if __name__ == "__main__":
    sys.exit(main())
