"""Predicted against measured peak memory per device, for ddp and zero plans (a script, not a test).

    python benchmarks/memory_fidelity.py [--model resnet50@64] [--cluster emu:1.0@2G,0.5@1G] [--plans ddp,zero3,...]

Profiles the model on this CPU (blocks and the whole-model memory calibration), predicts each
plan's per-device peak with the strategy's memory model, runs it for real through torchrun
(hetsim.execution.runner.measure: MemTracker peak of step index 1) and prints both with the error.  Exits
non-zero when a device is off by more than --tolerance.  Memory does not depend on collective
timings, so the cost model gets a nominal communication profile.
"""

from __future__ import annotations

import argparse
import sys
import time

PLANS = {
    # name: (family, knobs); local batches come from --batch
    "ddp": ("ddp", {}),
    "ddp-ckpt": ("ddp", {"checkpoint_blocks": -1}),
    "zero1": ("zero", {"zero_stage": 1}),
    "zero2": ("zero", {"zero_stage": 2}),
    "zero3": ("zero", {"zero_stage": 3}),
    "zero3-ckpt": ("zero", {"zero_stage": 3, "checkpoint_blocks": -1}),
    "zero2-offload": ("zero", {"zero_stage": 2, "offload": True}),
    "zero3-offload": ("zero", {"zero_stage": 3, "offload": True}),
    "zero2-accum": ("zero", {"zero_stage": 2, "accum_steps": 2}),
    "zero3-bf16": ("zero", {"zero_stage": 3, "precision": "bf16"}),
    "ddp-bf16": ("ddp", {"precision": "bf16"}),
}
DEFAULT = "ddp,ddp-ckpt,zero1,zero2,zero3,zero3-ckpt,zero2-offload,zero3-offload,zero2-accum"


def build_cost(model: str, cluster_spec: str, optimizer: str, cache: str | None = None):
    import os

    import torch

    from hetsim.hardware.cluster import parse_cluster
    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.measure import profile_device, profile_model
    from hetsim.profiling.store import CommProfile, ProfileSet
    from hetsim.types import Fit
    from hetsim.workloads.builtin import workload_from_spec

    torch.set_num_threads(1)
    wl = workload_from_spec(model, optimizer)
    cluster = parse_cluster(cluster_spec)
    if cache and os.path.exists(cache):
        from hetsim.profiling.store import ModelProfile, load

        prof = load(ModelProfile, cache)
    else:
        prof = profile_model(wl, "emu-cpu", torch.device("cpu"), (2, 4, 8), ("fp32", "bf16"), reps=1)
        if cache:
            from hetsim.profiling.store import save

            save(prof, cache)
    dev = profile_device("emu-cpu", torch.device("cpu"))
    n = len(cluster.devices)
    comm = {k: CommProfile(backend="gloo", world_size=k, fingerprint={}, allreduce_s=Fit(intercept=1e-4, slope=1e-9))
            for k in range(2, max(2, n) + 1)}
    ps = ProfileSet(models={"emu-cpu": prof}, devices={"emu-cpu": dev}, comm=comm)
    return CostModel(cluster, ps, optimizer, has_batchnorm=wl.has_batchnorm), cluster


def make_plan(name: str, batch: tuple[int, ...], n_blocks: int):
    from hetsim.strategies.ddp import DDPPlan
    from hetsim.strategies.zero import ZeROPlan

    family, knobs = PLANS[name]
    knobs = dict(knobs)
    if knobs.get("checkpoint_blocks") == -1:
        knobs["checkpoint_blocks"] = n_blocks // 2
    devices = tuple(range(len(batch)))
    cls = DDPPlan if family == "ddp" else ZeROPlan
    return cls(devices=devices, local_batch=batch, **knobs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50@64")
    ap.add_argument("--cluster", default="emu:1.0@2G,0.5@1G")
    ap.add_argument("--batch", default="5,3", help="local batch per device, e.g. 5,3")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--plans", default=DEFAULT, help=f"comma-separated, from: {', '.join(PLANS)}")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--profile-cache", default=None, help="JSON file: reuse this model profile (written if missing)")
    args = ap.parse_args(argv)

    from hetsim import strategies
    from hetsim.execution.runner import measure

    cost, cluster = build_cost(args.model, args.cluster, args.optimizer, args.profile_cache)
    batch = tuple(int(b) for b in args.batch.split(","))
    mib = 2**20
    worst = 0.0
    print(f"{args.model} on {cluster.describe()}, local batch {batch}, {args.optimizer}")
    print(f"{'plan':34s} {'dev':>3s} {'predicted':>10s} {'measured':>10s} {'error':>7s}   predicted split (MiB)")
    for name in args.plans.split(","):
        plan = make_plan(name, batch, cost.facts.n_blocks)
        strat = strategies.get(plan.strategy)
        pred = strat.memory(plan, cost)
        t = time.perf_counter()
        m = measure(plan, cluster=cluster, workload_spec=args.model, optimizer=args.optimizer, steps=1, warmup=2,
                    timeout_s=args.timeout)
        if m.status != "ok" or m.memory is None:
            print(f"{strat.label(plan):34s} run {m.status}: {(m.error or '')[-800:]}")
            worst = float("inf")
            continue
        for r, (p, q) in enumerate(zip(pred, m.memory)):
            err = p.total_bytes / q.total_bytes - 1
            worst = max(worst, abs(err))
            split = (f"p {p.params_bytes / mib:.1f} g {p.grads_bytes / mib:.1f} o {p.optim_bytes / mib:.1f} "
                     f"a {p.activations_bytes / mib:.1f} x {p.other_bytes / mib:.1f} host {p.host_bytes / mib:.1f}")
            print(f"{strat.label(plan):34s} {plan.devices[r]:>3d} {p.total_bytes / mib:>9.1f}M {q.total_bytes / mib:>9.1f}M "
                  f"{100 * err:>+6.1f}%   {split}")
        sys.stdout.flush()
        del t
    print(f"worst per-device error: {100 * worst:.1f}% (tolerance {100 * args.tolerance:.0f}%)")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
