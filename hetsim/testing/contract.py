"""The checks of the strategy contract, as plain functions a test (ours or a third party's) calls on one family.

Every check raises AssertionError with what was expected and what came instead.  The cost model
they use is `structural_cost`: the workload's real blocks (parameter counts, output sizes, from
one forward pass) with synthetic timings, so that the checks need no recorded profile and no
live measurement, and give the same plans on every machine.  Timings do not matter here: the
contract is about plans, determinism, memory accounting and exact gradients, not speed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import optuna
import torch

from hetsim import strategies
from hetsim.errors import InfeasiblePlanError
from hetsim.execution.runner import device_dicts, launch
from hetsim.execution.worker import Job
from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.measure import script_params
from hetsim.profiling.store import BlockProfile, BlockTiming, CommProfile, ModelProfile, ProfileSet
from hetsim.serial import to_dict
from hetsim.strategies.base import Plan, Resource, SearchContext, Strategy
from hetsim.types import Fit
from hetsim.workloads import Workload, workload_from_spec

CLUSTER = "emu:1.0@4G,0.5@4G"
"""Two emulated devices of different speeds, roomy memory: every family has plans there."""
GLOBAL_BATCH = 8
GRAD_REL_TOL = 1e-4
"""Largest relative difference between a rank's gradient and the single-process full-batch one
(fp32 sums in another order differ by ~1e-7; a wrong loss scale or a missed micro-batch by >1e-2)."""
WORKLOADS_ENV = "HETSIM_CONTRACT_WORKLOADS"
"""Comma-separated workload specs checked for every family, on top of what each family claims
(e.g. `HETSIM_CONTRACT_WORKLOADS=gpt@tiny`)."""
EMU_KIND = "emu-cpu"


def families() -> list[str]:
    """Every registered family: built in, and third party through the `hetsim.strategies` entry points."""
    return strategies.names()


def workloads_for(name: str) -> tuple[str, ...]:
    """The workload specs family `name` is checked on: its `contract_workloads`, then `$HETSIM_CONTRACT_WORKLOADS`."""
    extra = [w.strip() for w in os.environ.get(WORKLOADS_ENV, "").split(",") if w.strip()]
    own = tuple(strategies.get(name).contract_workloads)
    return own + tuple(w for w in extra if w not in own)


def cases() -> list[tuple[str, str]]:
    """(family, workload spec) for every family and every workload it is checked on."""
    return [(name, wl) for name in families() for wl in workloads_for(name)]


# ----------------------------------------------------------------------------- the cost model


def _block_facts(workload: Workload) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, block, output bytes per sample in fp32) of each block, from one forward pass on one sample."""
    model = workload.model()
    x, _ = workload.make_batch(1, 0)
    out = []
    with torch.no_grad():
        for name, block in model.named_children():
            x = block(x)
            out.append((name, block, int(x.numel()) * 4))
    return out


def structural_profile(workload: Workload, device_kind: str = EMU_KIND) -> ModelProfile:
    """A model profile with the workload's real block structure and synthetic timings: forward
    1 us per thousand parameters and output values plus 50 us, backward twice that."""
    blocks = []
    for name, block, out_bytes in _block_facts(workload):
        params = list(block.parameters())
        count = sum(p.numel() for p in params)
        fwd = Fit(intercept=5e-5, slope=1e-9 * (count + out_bytes / 4))
        timing = BlockTiming(fwd_s=fwd, bwd_s=Fit(intercept=2 * fwd.intercept, slope=2 * fwd.slope))
        blocks.append(BlockProfile(
            name=name, param_count=count, param_bytes=4 * count,
            buffer_bytes=sum(b.numel() * b.element_size() for b in block.buffers()),
            timing={"fp32": timing, "bf16": timing}, act_bytes={p: Fit(intercept=0.0, slope=2.0 * out_bytes)
                                                               for p in ("fp32", "bf16")},
            out_bytes_per_sample=out_bytes, flops_per_sample=0.0, param_numels=tuple(p.numel() for p in params),
            scalar_params=sum(p.dim() == 0 for p in params), script_params=script_params(block),
        ))
    opt = Fit(intercept=1e-4, slope=1e-8)
    return ModelProfile(model=workload.spec or workload.name, device_kind=device_kind, fingerprint={},
                        micro_batches=(1,), blocks=tuple(blocks), opt_step_s={"adamw": opt, "adam": opt, "sgd": opt},
                        step_overhead_s=1e-4, input_bytes_per_sample=int(workload.make_batch(1, 0)[0].numel()) * 4)


def synthetic_comm(world_size: int) -> CommProfile:
    """Collective timings of a plausible gloo-on-loopback link (100 us latency, 1 GB/s): checks need
    a value, not a measurement."""
    return CommProfile(backend="gloo", world_size=world_size, fingerprint={},
                       allreduce_s=Fit(intercept=1e-4, slope=1e-9), allgather_s=Fit(intercept=1e-4, slope=0.5e-9),
                       sendrecv_s=Fit(intercept=5e-5, slope=0.5e-9))


def synthetic_comms(n_devices: int) -> dict[int, CommProfile]:
    """`synthetic_comm` for every group size a cluster of `n_devices` can form (2 at least)."""
    return {k: synthetic_comm(k) for k in range(2, max(2, n_devices) + 1)}


_PROFILES: dict[str, ModelProfile] = {}


def structural_cost(workload_spec: str, cluster: str = CLUSTER, optimizer: str = "adamw") -> CostModel:
    """A cost model of `workload_spec` on the emulated `cluster` (see `structural_profile`)."""
    wl = workload_from_spec(workload_spec, optimizer)
    if workload_spec not in _PROFILES:
        _PROFILES[workload_spec] = structural_profile(wl)
    cl = parse_cluster(cluster)
    profiles = ProfileSet(models={EMU_KIND: _PROFILES[workload_spec]}, comm=synthetic_comms(len(cl.devices)))
    return CostModel(cl, profiles, optimizer, has_batchnorm=wl.has_batchnorm, batch_coupled=wl.batch_coupled,
                     logits_per_sample_sq=wl.logits_per_sample_sq)


def example_plans(name: str, cost: CostModel, global_batch: int = GLOBAL_BATCH) -> list[Plan]:
    """Family `name`'s own plans (baseline and examples) on `cost`'s cluster; at least one."""
    plans = strategies.get(name).own_plans(SearchContext(cost=cost, global_batch=global_batch))
    assert plans, f"strategy {name} gives no example plan on {CLUSTER} at global batch {global_batch}"
    return plans


# ----------------------------------------------------------------------------- the checks


def check_plan_roundtrip(strategy: Strategy, plan: Plan) -> None:
    """The plan survives JSON text and comes back as the family's own plan type."""
    assert isinstance(plan, strategy.plan_type), f"{strategy.name} built a {type(plan).__name__}, not its plan_type"
    again = strategies.plan_from_dict(json.loads(json.dumps(to_dict(plan))))
    assert again == plan, f"{strategy.name} plan changed through JSON: {plan} -> {again}"
    assert again.strategy == strategy.name, f"plan's strategy field {again.strategy!r} != {strategy.name!r}"


def check_simulation(strategy: Strategy, plan: Plan, cost: CostModel) -> None:
    """Two predictions of one plan are equal, and a prediction is a step of positive length."""
    a = strategy.predict(plan, cost)
    b = strategy.predict(plan, cost)
    assert a.prediction == b.prediction, f"{strategy.label(plan)}: two predictions differ"
    assert a.schedule == b.schedule, f"{strategy.label(plan)}: two schedules differ"
    p = a.prediction
    assert p.step_time_s > 0 and math.isfinite(p.step_time_s), f"{strategy.label(plan)}: step {p.step_time_s} s"
    assert math.isclose(p.samples_per_s, plan.global_batch / p.step_time_s, rel_tol=1e-9)
    assert 0.0 <= p.bubble_fraction <= 1.0, f"{strategy.label(plan)}: bubble {p.bubble_fraction}"
    on_devices = {t.resource for t in a.graph.tasks}
    missing = [d for d in plan.devices if Resource.device(d) not in on_devices]
    assert not missing, f"{strategy.label(plan)}: no task on plan device(s) {missing}"


def check_memory(strategy: Strategy, plan: Plan, cost: CostModel) -> None:
    """Per device of the plan, a positive peak made of non-negative parts; the whole model's parameters
    held somewhere (a device or the host); feasibility that agrees with the capacities."""
    pred = strategy.predict(plan, cost).prediction
    label = strategy.label(plan)
    assert len(pred.memory) == len(plan.devices), f"{label}: {len(pred.memory)} memory entries for {len(plan.devices)} devices"
    for d, m in zip(plan.devices, pred.memory):
        parts = (m.params_bytes, m.grads_bytes, m.optim_bytes, m.activations_bytes, m.other_bytes, m.host_bytes)
        assert all(x >= 0 for x in parts), f"{label}: device {d} has a negative category: {m}"
        assert m.total_bytes > 0, f"{label}: device {d} holds nothing"
    assert pred.peak_mem_bytes == tuple(m.total_bytes for m in pred.memory)
    held = sum(m.params_bytes + m.host_bytes for m in pred.memory)
    assert held >= cost.param_bytes(), (f"{label}: parameters held {held} B over devices and host < the model's "
                                        f"{cost.param_bytes()} B")
    over = [d for d, m, c in zip(plan.devices, pred.memory, pred.capacity_bytes) if m.total_bytes > c]
    assert pred.feasible == (not over and not [v for v in pred.violations if v.startswith("host")]), (
        f"{label}: feasible={pred.feasible} but devices over capacity: {over}")


def drawn_plans(strategy: Strategy, ctx: SearchContext, trials: int, seed: int = 0):
    """(trial, plan) for each of `trials` random draws of the family's space that builds a plan (a
    draw that raises InfeasiblePlanError is pruned and skipped); each trial is told complete after
    the caller has looked at it."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    for _ in range(trials):
        trial = study.ask()
        try:
            plan = strategy.space(trial, ctx)
        except InfeasiblePlanError:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        yield trial, plan
        study.tell(trial, 0.0)


def check_search_space(strategy: Strategy, cost: CostModel, trials: int = 48, seed: int = 0) -> None:
    """Random trials of the family's space give valid plans of its type (or InfeasiblePlanError),
    and every parameter it suggests carries its prefix (`Strategy.param`)."""
    ctx = SearchContext(cost=cost, global_batch=GLOBAL_BATCH)
    if strategy.unavailable(ctx) is not None:
        return
    # The family's own prefix, unless it opted out with param_prefix = "" (the built-ins, for now).
    prefix = "" if strategy.param_prefix == "" else f"{strategy.param_prefix or strategy.name}."
    built = 0
    for trial, plan in drawn_plans(strategy, ctx, trials, seed):
        strategy.validate(plan, cost)
        assert isinstance(plan, strategy.plan_type) and plan.global_batch == GLOBAL_BATCH, plan
        built += 1
        wrong = [n for n in trial.params if not n.startswith(prefix)]
        assert not wrong, f"{strategy.name}: search parameters {wrong} lack its prefix {prefix!r} (use Strategy.param)"
    assert built, f"{strategy.name}: {trials} random trials gave no valid plan on {CLUSTER}"


def model_param_names(workload_spec: str) -> set[str]:
    """The parameters a run must give gradients for: the trainable ones (a frozen stem has none)."""
    return {n for n, p in workload_from_spec(workload_spec).model().named_parameters() if p.requires_grad}


def check_real_run_gradient(strategy: Strategy, plan: Plan, cost: CostModel, workload_spec: str,
                            out_dir: str | Path, timeout_s: float = 300) -> None:
    """A real run of the plan (torchrun, one process per plan device) computes, on every rank, the
    single-process full-batch gradient of the parameters it holds, and the ranks together hold all."""
    job = Job(task="grads", plan=to_dict(plan), workload=workload_spec, global_batch=plan.global_batch,
              devices=device_dicts(cost.cluster, plan.devices), out_dir=str(out_dir))
    results, tail, timed_out = launch(job, len(plan.devices), timeout_s=timeout_s)
    label = strategy.label(plan)
    assert not timed_out, f"{label} on {workload_spec}: timed out after {timeout_s} s\n{tail}"
    assert len(results) == len(plan.devices), f"{label}: {len(results)} rank results of {len(plan.devices)}\n{tail}"
    for r in results:
        assert r.status == "ok", f"{label} on {workload_spec}, rank {r.rank}: {r.status}: {r.error}"
        assert r.grad_rel_err is not None and r.grad_rel_err < GRAD_REL_TOL, (
            f"{label} on {workload_spec}, rank {r.rank}: gradient relative error {r.grad_rel_err} >= {GRAD_REL_TOL}")
    covered = set().union(*(set(r.grad_names) for r in results))
    missing = model_param_names(workload_spec) - covered
    assert not missing, f"{label} on {workload_spec}: no rank has a gradient for {sorted(missing)}"
