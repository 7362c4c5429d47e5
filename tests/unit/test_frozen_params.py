"""Frozen parameters (fine-tuning a fixed backbone): held, sharded and gathered like the others, but
without gradients, optimizer state, gradient all-reduce or optimizer steps in the cost model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hetsim.search import golden
from torch import nn

from hetsim import strategies
from hetsim.model.costmodel import CostModel
from hetsim.model.memory import zero1_owned_counts
from hetsim.profiling.store import trainable_flags

ASSETS = Path(__file__).resolve().parents[1] / "assets"
CASE = next(c for c in golden.CASES if c.name == "emu-default")


def test_trainable_flags_are_empty_unless_something_is_frozen():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert trainable_flags(m) == ()
    m[0].requires_grad_(False)
    assert trainable_flags(m) == (False, False, True, True)


def test_the_trace_records_a_frozen_stem(monkeypatch):
    """user_models:frozen_stem joins its frozen stem to the first body layer: that block is mixed."""
    from hetsim.profiling.shapes import trace
    from hetsim.workloads.builtin import load_workload

    monkeypatch.syspath_prepend(str(ASSETS))
    blocks = trace(load_workload("user_models:frozen_stem")).blocks
    first = blocks[0]
    assert first.param_trainable[:2] == (False, False) and all(first.param_trainable[2:])
    assert all(b.param_trainable == () for b in blocks[1:])


@pytest.fixture(scope="module")
def costs():
    """The golden emu-default context's cost model, and the same with its first half of blocks frozen."""
    ctx = golden._context(CASE, golden.RESULTS)
    base = ctx.cost
    model = base.base_profile
    half = len(model.blocks) // 2
    blocks = tuple(replace(b, param_trainable=(False,) * len(b.param_numels)) if k < half else b
                   for k, b in enumerate(model.blocks))
    frozen = CostModel(base.cluster, replace(base.profiles, models={model.device_kind: replace(model, blocks=blocks)}),
                       base.optimizer, has_batchnorm=base.facts.has_batchnorm)
    return ctx, base, frozen, sum(b.param_count for b in model.blocks[:half])


def test_counts_and_bytes(costs):
    _, base, frozen, n_frozen = costs
    assert n_frozen > 0
    assert frozen.param_count() == base.param_count() == base.trainable_count()
    assert frozen.trainable_count() == base.param_count() - n_frozen
    assert frozen.grad_bytes() == base.param_bytes() - 4 * n_frozen
    assert sum(zero1_owned_counts(frozen, 2)) == frozen.trainable_count()


@pytest.mark.parametrize("family, knobs", [("ddp", {}), ("zero", {"zero_stage": 1}), ("zero", {"zero_stage": 3})])
def test_frozen_parameters_cost_neither_state_nor_sync(costs, family, knobs):
    """The same plan on the half-frozen model: parameters held alike; per device at least AdamW's
    8 bytes of state (sharded: its share) less; a step no slower."""
    ctx, base, frozen, n_frozen = costs
    strat = strategies.get(family)
    plan = next(p for p in strat.own_plans(ctx) if all(getattr(p, k) == v for k, v in knobs.items())
                and p.precision == "fp32" and p.checkpoint_blocks == 0 and not getattr(p, "offload", False))
    a, b = strat.predict(plan, base)[0], strat.predict(plan, frozen)[0]
    assert b.step_time_s < a.step_time_s
    for m_base, m_frozen in zip(a.memory, b.memory, strict=True):
        assert m_frozen.params_bytes == m_base.params_bytes
        assert m_frozen.optim_bytes < m_base.optim_bytes
        saved = (m_base.optim_bytes + m_base.grads_bytes) - (m_frozen.optim_bytes + m_frozen.grads_bytes)
        share = 1 if family == "ddp" else 2
        assert saved >= 8 * n_frozen / share * 0.9, (saved, n_frozen)


def test_memory_of_a_step_with_a_frozen_backbone_is_measured():
    """torch's MemTracker raised on a frozen parameter ("cannot register a hook on a tensor that doesn't
    require gradient"), so a fine-tuning step could be neither profiled nor executed on the CPU."""
    import torch

    from hetsim.execution.memtrack import measure_step

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    m[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])

    def step():
        m(torch.randn(8, 64)).sum().backward()
        opt.step()

    step()
    mem = measure_step(step, m, opt, torch.device("cpu"))
    assert mem.params_bytes == sum(p.numel() * 4 for p in m.parameters())
    assert mem.optim_bytes == 2 * 4 * (64 * 4 + 4) + 2 * 4  # exp_avg and exp_avg_sq, two 4-byte step counters
    assert m[0].weight.grad is None


def test_a_step_with_small_activations_peaks_in_the_optimizer_step():
    """AdamW (foreach=False) holds two temporaries the size of the parameter it updates: where the
    activations are small the step peaks there.  Only trainable parameters are stepped (a linear probe
    on a frozen MLP measured exactly params + gradients + state + twice its largest trainable weight)."""
    from pipeline_synth import synthetic_cost

    from hetsim.model.memory import data_parallel_memory

    base = synthetic_cost([1.0], [1e-3, 1e-3], param_counts=[5000, 100], act_bytes=[1.0, 1.0], out_bytes=[4, 4])
    model = next(iter(base.profiles.models.values()))
    blocks = (replace(model.blocks[0], param_numels=(4000, 1000), param_trainable=(False, True)),
              replace(model.blocks[1], param_numels=(100,)))
    cost = CostModel(base.cluster, replace(base.profiles, models={model.device_kind: replace(model, blocks=blocks)}),
                     "adamw")
    mem = data_parallel_memory(cost, 0, 1, "fp32", 0)
    assert mem.other_bytes == 2 * 4 * 1000  # the largest trainable parameter, not the frozen 4000
    assert mem.grads_bytes == 4 * 1100 and mem.optim_bytes == 8 * 1100
