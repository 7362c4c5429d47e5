"""Batch-coupled (contrastive) losses on data-parallel ranks: exact global negatives and the gradient cache.

Global negatives: every rank's output rows are gathered with `torch.distributed.nn.functional.all_gather`
(differentiable), padded to the largest local batch because a collective moves equal shapes, so that
every rank computes the InfoNCE of the whole global batch.  The gather's backward sums, over the
ranks, each rank's loss gradient for this rank's rows: every rank computes the same loss, so a rank
receives world_size times the gradient of the loss for its rows, and DDP's (or FSDP's) average over
the ranks gives the full-batch gradient exactly, with no other scaling, whatever the split.

Gradient cache (Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"): the local batch in chunks; (1) every chunk's outputs without an autograd graph,
(2) gathered from every rank (no gradient needed), the loss and its gradient with respect to the
gathered outputs, (3) each chunk run again with a graph and backpropagated from its rows of that
gradient (times world_size, for the ranks' average), under `no_sync` for all but the last chunk.
Only one chunk's activations live at a time; the cost is a second forward.  The models here have
no dropout and no BatchNorm, so the second forward reproduces the first exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from .helpers import autocast


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad])


def gather_rows(t: torch.Tensor, sizes: Sequence[int], differentiable: bool, group=None) -> torch.Tensor:
    """Every rank's rows of t, in group rank order; rank r contributes sizes[r] rows (uneven allowed)."""
    rows = max(sizes)
    local = _padded(t.contiguous(), rows)
    if differentiable:
        parts = dist_fn.all_gather(local, group=group if group is not None else dist.group.WORLD)
    else:
        parts = [torch.empty_like(local) for _ in sizes]
        dist.all_gather(parts, local, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def pipeline_loss(workload, replica_batches: Sequence[int], dp_group, scale: float) -> Callable:
    """The last stage's loss function for a batch-coupled workload (one micro-batch: the whole
    replica batch).  With replicas, every replica's last stage gathers the others' outputs over
    `dp_group` (the ranks holding the same stages), and the loss is divided by the replica count:
    the gather's backward sums the replicas' gradients for each replica's rows, and the pipeline
    executor then sums the replicas' parameter gradients (it does not average)."""
    sizes = list(replica_batches)
    if len(sizes) == 1:
        return lambda out, y: workload.full_batch_loss(out.float(), y) * scale

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = gather_rows(out.float(), sizes, differentiable=True, group=dp_group)
        ys = gather_rows(y, sizes, differentiable=False, group=dp_group)
        return workload.full_batch_loss(z, ys) * scale / len(sizes)

    return loss_fn


class GlobalBatchLoss:
    """The full-batch loss of one data-parallel rank's outputs, for plain steps and the gradient cache."""

    def __init__(self, workload, sizes: Sequence[int], rank: int, device: torch.device, precision: str):
        self.wl = workload
        self.sizes = tuple(sizes)
        self.rank = rank
        self.device = device
        self.precision = precision
        self.lo = sum(self.sizes[:rank])

    def plain(self, module: Callable, x: torch.Tensor, y: torch.Tensor, low_precision: bool) -> torch.Tensor:
        """Forward this rank's whole local batch and return the global-batch loss (differentiable)."""
        with autocast(self.device, self.precision) if low_precision else contextlib.nullcontext():
            out = module(x)
        z = gather_rows(out.float(), self.sizes, differentiable=True)
        return self.wl.full_batch_loss(z, gather_rows(y, self.sizes, differentiable=False))

    def grad_cache(self, plain_module: Callable, synced_module: Callable, chunks: Sequence[tuple], no_sync,
                   low_precision: bool, world_size: int) -> float:
        """One gradient-cache step over this rank's chunks [(x, y), ...]; returns the global loss.

        `plain_module` runs the no-graph pass (the bare model: no DDP bookkeeping); `synced_module`
        the chunks' second pass; `no_sync()` is the context that defers gradient synchronisation
        (a null context for FSDP, which reduce-scatters every chunk)."""
        amp = (lambda: autocast(self.device, self.precision)) if low_precision else contextlib.nullcontext
        with torch.no_grad(), amp():
            cached = torch.cat([plain_module(x).float() for x, _ in chunks])
        y = torch.cat([c[1] for c in chunks])
        z = gather_rows(cached, self.sizes, differentiable=False).requires_grad_(True)
        loss = self.wl.full_batch_loss(z, gather_rows(y, self.sizes, differentiable=False))
        (grad,) = torch.autograd.grad(loss, z)
        mine = grad[self.lo:self.lo + self.sizes[self.rank]] * world_size  # DDP/FSDP average the ranks
        del z, grad
        start = 0
        for j, (x, _) in enumerate(chunks):
            last = j == len(chunks) - 1
            with contextlib.nullcontext() if last else no_sync():
                with amp():
                    out = synced_module(x)
                out.float().backward(mine[start:start + len(x)])
            start += len(x)
        return float(loss.detach())
