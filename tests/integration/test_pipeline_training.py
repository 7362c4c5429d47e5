"""Real pipeline and hybrid training steps (torchrun, 2 emulated ranks) follow single-process training.

The contract suite checks one gradient; this checks `step()` over several optimizer steps
(DDP inside the pipeline stages, the optimizer on each rank's stages, grads zeroed between
steps): the loss of every step, summed over the ranks that hold the last stage, equals the
full-batch loss of a single process doing the same AdamW steps.
"""

from __future__ import annotations

import pytest
from hetsim.strategies.base import SearchContext

from hetsim import strategies
from hetsim.execution.runner import device_dicts, launch
from hetsim.execution.worker import Job
from hetsim.serial import to_dict

GLOBAL_BATCH = 8
WARMUP, STEPS = 2, 2


def reference_losses(n_steps: int) -> list[float]:
    import torch

    from hetsim.workloads.builtin import load_workload

    torch.set_num_threads(1)
    wl = load_workload("gn_resnet", 32)
    model = wl.model()
    opt = wl.make_optimizer(model.parameters())
    x, y = wl.make_batch(GLOBAL_BATCH, 0)
    out = []
    for _ in range(n_steps):
        loss = wl.loss_sum(model(x), y) / GLOBAL_BATCH
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        out.append(float(loss.detach()))
    return out


def _plans(make_cost):
    cost = make_cost("emu:1.0@4G,0.5@4G")
    ctx = SearchContext(cost=cost, global_batch=GLOBAL_BATCH)
    pipe = strategies.get("pipeline")
    hyb = strategies.get("hybrid")
    devs = (0, 1)
    return cost, [
        pipe.solve(cost, devs, schedule="1F1B", microbatches=2, batch=GLOBAL_BATCH),
        pipe.solve(cost, devs, schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=4, batch=GLOBAL_BATCH),
        hyb.solve(cost, devs, replicas=2, schedule="GPipe", microbatches=2, global_batch=GLOBAL_BATCH),
    ], ctx


@pytest.mark.slow
def test_training_steps_follow_single_process(make_cost, tmp_path):
    cost, plans, _ = _plans(make_cost)
    ref = reference_losses(WARMUP + STEPS)
    for i, plan in enumerate(plans):
        job = Job(task="train", plan=to_dict(plan), workload="gn_resnet@32", global_batch=plan.global_batch,
                  devices=device_dicts(cost.cluster, plan.devices), steps=STEPS, warmup=WARMUP,
                  out_dir=str(tmp_path / f"p{i}"))
        results, tail, timed_out = launch(job, len(plan.devices), timeout_s=180)
        assert not timed_out, tail
        assert len(results) == len(plan.devices), tail
        assert all(r.status == "ok" for r in results), [r.error for r in results]
        with_loss = [r.losses for r in results if r.losses]
        assert with_loss, "no rank reported a loss"
        got = [sum(step) for step in zip(*with_loss)]
        assert got == pytest.approx(ref, rel=1e-4), (strategies.get(plan.strategy).label(plan), got, ref)


@pytest.mark.slow
def test_hybrid_two_by_two_matches_full_batch_gradient(make_cost, tmp_path):
    """2 replicas x 2 pipeline ranks on 4 ranks: per-stage DDP groups, pipeline groups, uneven batch."""
    cost = make_cost("emu:1.0@4G,1.0@4G,0.5@4G,0.5@4G")
    hyb = strategies.get("hybrid")
    plan = hyb.solve(cost, (0, 1, 2, 3), replicas=2, schedule="1F1B", microbatches=2, global_batch=GLOBAL_BATCH)
    assert plan.replica_batch[0] > plan.replica_batch[1]  # the faster replica takes more
    job = Job(task="grads", plan=to_dict(plan), workload="gn_resnet@32", global_batch=plan.global_batch,
              devices=device_dicts(cost.cluster, plan.devices), out_dir=str(tmp_path / "grads"))
    results, tail, timed_out = launch(job, 4, timeout_s=240)
    assert not timed_out, tail
    assert len(results) == 4, tail
    for r in results:
        assert r.status == "ok", r.error
        assert r.grad_rel_err is not None and r.grad_rel_err < 1e-4, (r.rank, r.grad_rel_err)
    # Each replica covers the model; replica 0's ranks hold exactly what replica 1's hold.
    by_rank = {r.rank: set(r.grad_names) for r in results}
    assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3] and not by_rank[0] & by_rank[1]
