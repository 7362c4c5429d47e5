"""Contrastive workloads and the gradient cache's models, without launching anything."""

from __future__ import annotations

import pytest
import torch
from hetsim.strategies.ddp import DDP, DDPPlan
from hetsim.strategies.zero import ZeRO, ZeROPlan

from hetsim.errors import InfeasiblePlanError
from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.store import ProfileSet
from hetsim.testing import synthetic_comm
from hetsim.workloads import load_workload
from hetsim.workloads.contrastive import clip_loss, nt_xent


@pytest.mark.parametrize("name", ["simclr", "clip"])
def test_workload_shapes_and_objective(name):
    wl = load_workload(name, 32)
    assert wl.batch_coupled and wl.batch_loss is not None
    x, y = wl.make_batch(4, 3)
    x2, _ = wl.make_batch(4, 3)
    assert torch.equal(x, x2)  # deterministic from the seed
    out = wl.model()(x)
    assert out.shape[:2] == (4, 2)
    # loss_sum / n is the objective when the whole batch is present
    assert float(wl.loss_sum(out, y).detach() / 4) == pytest.approx(float(wl.full_batch_loss(out, y).detach()))


@pytest.mark.parametrize("loss", [nt_xent, clip_loss])
def test_loss_couples_the_batch(loss):
    """A sample's loss gradient depends on the other samples (they are its negatives)."""
    torch.manual_seed(0)
    out = torch.randn(4, 2, 8, requires_grad=True)
    (g,) = torch.autograd.grad(loss(out), out)
    other = out.detach().clone()
    other[3] += 1.0
    other.requires_grad_(True)
    (g2,) = torch.autograd.grad(loss(other), other)
    assert not torch.allclose(g[0], g2[0])


def test_simclr_views_differ_but_share_content():
    wl = load_workload("simclr", 32)
    x, _ = wl.make_batch(8, 0)
    a, b = x[:, 0].flatten(1), x[:, 1].flatten(1)
    same = torch.nn.functional.cosine_similarity(a, b).mean()
    cross = torch.nn.functional.cosine_similarity(a, b.roll(1, 0)).mean()
    assert not torch.equal(a, b) and same > cross


@pytest.fixture
def coupled_cost(gn_profile):
    """The gn_resnet profile standing in for a contrastive model (the models only need block figures)."""
    _, model, dev = gn_profile
    ps = ProfileSet(models={"emu-cpu": model}, devices={"emu-cpu": dev}, comm={2: synthetic_comm(2)})
    return CostModel(parse_cluster("emu:1.0@4G,0.5@4G"), ps, "adamw", batch_coupled=True, logits_per_sample_sq=4)


def test_accumulation_refused_grad_cache_required(coupled_cost, make_cost):
    with pytest.raises(InfeasiblePlanError, match="grad_cache_chunks"):
        DDP().validate(DDPPlan(devices=(0, 1), local_batch=(8, 8), accum_steps=2), coupled_cost)
    DDP().validate(DDPPlan(devices=(0, 1), local_batch=(8, 8), grad_cache_chunks=4), coupled_cost)
    with pytest.raises(InfeasiblePlanError, match="accum_steps"):  # a per-sample loss: accumulate instead
        DDP().validate(DDPPlan(devices=(0, 1), local_batch=(8, 8), grad_cache_chunks=2), make_cost())


@pytest.mark.parametrize("family,plan_of", [
    (DDP(), lambda gc: DDPPlan(devices=(0, 1), local_batch=(24, 8), grad_cache_chunks=gc)),
    (ZeRO(), lambda gc: ZeROPlan(devices=(0, 1), local_batch=(24, 8), zero_stage=3, grad_cache_chunks=gc)),
])
def test_grad_cache_costs_a_forward_and_saves_activations(coupled_cost, family, plan_of):
    plain, _, g_plain = family.predict(plan_of(1), coupled_cost)
    cached, _, g_cached = family.predict(plan_of(4), coupled_cost)
    # a second forward: 4 chunks forwarded twice against one forward of the whole local batch
    assert cached.step_time_s > plain.step_time_s
    assert sum(t.kind == "F" for t in g_cached.tasks) > sum(t.kind == "F" for t in g_plain.tasks)
    assert any("gather outputs" in t.label for t in g_plain.tasks)
    for a, b in zip(plain.memory, cached.memory):
        assert b.activations_bytes < a.activations_bytes


def test_search_offers_grad_cache_not_accumulation(coupled_cost):
    from hetsim.strategies.base import SearchContext

    from hetsim.testing.contract import drawn_plans

    ctx = SearchContext(cost=coupled_cost, global_batch=32)
    seen = set()
    for _, plan in drawn_plans(DDP(), ctx, 20):  # a trial that chose no device is skipped
        assert plan.accum_steps == 1
        seen.add(plan.grad_cache_chunks)
    assert seen - {1}


def test_report_says_why_no_accumulation_and_what_the_cache_costs(coupled_cost, make_cost):
    from hetsim.search.coupled import coupled_notes

    lines = coupled_notes("simclr", [], coupled_cost, 32)
    assert len(lines) == 2
    assert "accumulation is not offered" in lines[0] and "fewer negatives" in lines[0]
    assert "second forward" in lines[1] and "embedding cache" in lines[1]
    assert coupled_notes("gn_resnet", [], make_cost(), 32) == []


def _with_no_grad_forward(cost, factor: float):
    """`cost` with its profile's no-graph forward timed at `factor` x the forward with a graph."""
    from dataclasses import replace

    from hetsim.types import Fit

    prof = cost.base_profile
    blocks = tuple(replace(b, timing={p: replace(t, nograd_fwd_s=Fit(intercept=t.fwd_s.intercept * factor,
                                                                      slope=t.fwd_s.slope * factor))
                                      for p, t in b.timing.items()}) for b in prof.blocks)
    ps = replace(cost.profiles, models={prof.device_kind: replace(prof, blocks=blocks)})
    return CostModel(cost.cluster, ps, "adamw", batch_coupled=True, logits_per_sample_sq=4)


def test_first_pass_is_charged_as_a_forward_without_graph(coupled_cost):
    """The gradient cache's first pass records no graph: it costs the profile's no-grad forward."""
    plan = DDPPlan(devices=(0, 1), local_batch=(24, 8), grad_cache_chunks=4)
    same = _with_no_grad_forward(coupled_cost, 1.0)
    half = _with_no_grad_forward(coupled_cost, 0.5)
    _, _, g = DDP().predict(plan, half)
    first = [t for t in g.tasks if t.label.endswith("no graph") and t.resource == "dev0"]
    assert len(first) == 4
    n = half.facts.n_blocks
    assert first[0].duration_s == pytest.approx(half.nograd_fwd_s(0, 0, n, 6) + half.overhead_s(0, 6))
    assert half.nograd_fwd_s(0, 0, n, 6) == pytest.approx(0.5 * half.fwd_s(0, 0, n, 6))
    assert DDP().predict(plan, half)[0].step_time_s < DDP().predict(plan, same)[0].step_time_s


def test_grad_cache_holds_every_chunks_input(coupled_cost):
    """Chunks of one local batch: each chunk's activations in turn, but every chunk's input (and the
    embedding cache) for the whole step, as MemTracker and the CUDA allocator count them."""
    from hetsim.model.memory import CoupledLoss, data_parallel_memory

    cost = coupled_cost
    prof = cost.base_profile
    one = data_parallel_memory(cost, 0, 6, "fp32", 0, coupled=CoupledLoss(global_batch=32, local_batch=6,
                                                                         grad_cache=True))
    four = data_parallel_memory(cost, 0, 6, "fp32", 0, coupled=CoupledLoss(global_batch=32, local_batch=24,
                                                                          grad_cache=True))
    per_sample = prof.input_bytes_per_sample + 2 * prof.blocks[-1].out_bytes_per_sample
    assert four.total_bytes - one.total_bytes == pytest.approx(18 * per_sample, abs=2)
