"""What the report says about a batch-coupled (contrastive) workload: why plain accumulation is not
offered, and what the gradient cache that replaces it costs on this cluster (predicted)."""

from __future__ import annotations

from hetsim.strategies import get
from hetsim.strategies._coupled import no_graph_forward_s
from hetsim.strategies.ddp import DDPPlan, balance_batch, split_evenly

from hetsim.model.costmodel import CostModel
from hetsim.model.memory import CoupledLoss, coupled_loss_bytes


def coupled_notes(workload_name: str, plans: list, cost: CostModel, global_batch: int) -> list[str]:
    """Note lines for a batch-coupled workload (none for a per-sample loss).

    `plans`: the executed candidates' plans, best first; the cost is shown for the first one that
    uses the gradient cache, else for a ddp plan on every device with 2 chunks."""
    if not cost.facts.batch_coupled:
        return []
    out = [
        f"plain gradient accumulation is not offered for {workload_name}: its InfoNCE loss couples every sample "
        "of the global batch (every other sample is a negative), so summing the losses of micro-batches would "
        "optimise a different objective with fewer negatives per sample; the gradient cache (grad_cache_chunks, "
        "Gao et al. 2021) replaces it and keeps the loss exact: every rank's outputs are gathered, so the "
        "negatives are the whole global batch on every family"
    ]
    plan = next((p for p in plans if getattr(p, "grad_cache_chunks", 1) > 1), None)
    if plan is None:
        devs = tuple(range(cost.n_devices))
        try:
            local = balance_batch(cost, devs, global_batch, 2, "fp32", 0, 2, grad_cache=True)
        except Exception:  # too small a batch for 2 chunks per device: nothing to cost
            return out
        plan = DDPPlan(devices=devs, local_batch=local, grad_cache_chunks=2)
    out.append(_cost_line(plan, cost))
    return out


def _cost_line(plan, cost: CostModel) -> str:
    """The gradient cache's second forward and embedding cache for `plan`, from the cost and memory models."""
    pred = get(plan.strategy).predict(plan, cost)[0]
    second = max(sum(no_graph_forward_s(cost, d, m, plan.precision) for m in split_evenly(b, plan.chunks))
                 for d, b in zip(plan.devices, plan.local_batch))
    cache = max(coupled_loss_bytes(cost, CoupledLoss(global_batch=plan.global_batch, local_batch=b,
                                                     grad_cache=True))[1] for b in plan.local_batch)
    label = get(plan.strategy).label(plan)
    return (f"the gradient cache's cost for {label}: a second forward of {second:.2f} s per step on the slowest "
            f"device ({100 * second / pred.step_time_s:.0f}% of the predicted {pred.step_time_s:.2f} s step) and an "
            f"embedding cache of {cache / 2**10:.0f} KiB per device; in exchange only one chunk's activations "
            f"({plan.chunks} chunks) live at a time")
