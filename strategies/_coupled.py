"""Batch-coupled (contrastive) losses on the simulation and search side of `ddp` and `zero`: the
gradient-cache knob, the checks that keep the objective exact, the outputs' all-gather task and
the memory terms (the torch side is `_contrastive`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetsim.errors import InfeasiblePlanError
from hetsim.model.memory import CoupledLoss
from hetsim.model.simulator import TaskGraph

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel

    from .base import SearchContext
    from .helpers import ParamName


GRAD_CACHE_CHOICES = (1, 2, 4, 8)
"""Gradient-cache chunks the search offers a batch-coupled workload."""


def choose_grad_cache(trial, ctx: SearchContext, name: ParamName) -> int:
    """Gradient-cache chunks per local batch: searched like accumulation, for batch-coupled losses only."""
    if not ctx.cost.facts.batch_coupled:
        return 1
    return trial.suggest_categorical(name("grad_cache_chunks"), list(GRAD_CACHE_CHOICES))


def check_chunks(plan, cost: CostModel, family: str) -> None:
    """Accumulation and the gradient cache: each where it keeps the objective (messages name the fix)."""
    if plan.grad_cache_chunks < 1:
        raise InfeasiblePlanError(f"{family} plan grad_cache_chunks {plan.grad_cache_chunks} must be >= 1")
    if cost.facts.batch_coupled and plan.accum_steps > 1:
        raise InfeasiblePlanError(
            f"{family} plan accum_steps {plan.accum_steps}: the workload's loss couples every sample of the batch "
            "(InfoNCE), so accumulating micro-batch losses would optimise a different objective (fewer negatives "
            "per sample); use grad_cache_chunks instead (the same memory saving, exact, one more forward)"
        )
    if not cost.facts.batch_coupled and plan.grad_cache_chunks > 1:
        raise InfeasiblePlanError(
            f"{family} plan grad_cache_chunks {plan.grad_cache_chunks}: the gradient cache is for batch-coupled "
            "losses; a per-sample loss accumulates exactly without its second forward: use accum_steps"
        )
    if plan.grad_cache_chunks > 1 and plan.precision == "fp16":
        raise InfeasiblePlanError("the gradient cache here runs without fp16 loss scaling; use bf16 or fp32")
    if min(plan.local_batch) < plan.chunks:
        raise InfeasiblePlanError(
            f"{family} plan local batches {list(plan.local_batch)} must each be >= {plan.chunks} "
            "(accum_steps x grad_cache_chunks)"
        )


def no_graph_forward_s(cost: CostModel, dev: int, m: int, precision: str = "fp32") -> float:
    """The gradient cache's first pass over one chunk of m samples on device dev: the whole model's
    forward without autograd recording, and that pass's overhead (`CostModel.overhead_s` with grad_cache)."""
    return cost.nograd_fwd_s(dev, 0, cost.facts.n_blocks, m, precision) + cost.overhead_s(dev, m, grad_cache=True, precision=precision)


def coupled_gather(g: TaskGraph, cost: CostModel, devices: tuple[int, ...], sizes: list[list[int]],
                   grad_cache: bool, precision: str = "fp32") -> int | None:
    """A batch-coupled loss's forward pass on every device (`sizes[i]`: device i's chunks, each
    forwarded without a graph under the gradient cache; its whole local batch otherwise) and the
    all-gather of the outputs after it; the gather's task id (None: a per-sample loss)."""
    if not cost.facts.batch_coupled:
        return None
    ends = []
    for d, chunks in zip(devices, sizes):
        for j, m in enumerate(chunks):
            t = no_graph_forward_s(cost, d, m, precision) if grad_cache else (
                cost.fwd_s(d, 0, cost.facts.n_blocks, m, precision) + cost.overhead_s(d, m, precision=precision))
            tid = g.add(f"dev{d}", "F", t, label=f"F{j} no graph" if grad_cache else "F")
        ends.append(tid)
    padded = cost.base_profile.blocks[-1].out_bytes_per_sample * max(sum(c) for c in sizes) * len(devices)
    moves = 1 if grad_cache else 2  # the differentiable gather's backward moves the gradients back
    return g.add("comm", "allgather", moves * cost.allgather_s(padded, tuple(devices)), ends,
                 label="gather outputs (global negatives)")


def coupled_terms(cost: CostModel, global_batch: int, local: int, grad_cache: bool) -> CoupledLoss | None:
    """The batch-coupled loss's memory terms of one rank (None for a per-sample loss)."""
    if not cost.facts.batch_coupled:
        return None
    return CoupledLoss(global_batch=global_batch, local_batch=local, grad_cache=grad_cache)
