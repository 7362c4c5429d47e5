"""Which low precisions a model profile times: each one's gradient is compared with fp32's on one
batch first (`grad_cosine`), and a precision whose plans would be refused, because the model fails
under its autocast or its gradient points elsewhere, is not timed (`screen_precisions`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetsim.model.costmodel import MIN_GRAD_COSINE
from hetsim.workloads.builtin import Workload
from hetsim.workloads.precision import autocast


def screen_precisions(workload: Workload, kind: str, device: torch.device, precisions: tuple[str, ...], mb: int,
                      progress: Callable[[str], None] | None) -> tuple[dict[str, float], dict[str, str], tuple[str, ...]]:
    """(gradient cosine of each low precision, the error of each the model fails under, the precisions
    to time) for a profile of `workload` on `kind`, from one batch of `mb` samples."""
    cosines, failed = {}, {}
    for p in precisions:
        if p != "fp32":
            try:
                cosines[p] = grad_cosine(workload, device, p, mb)
            except (RuntimeError, TypeError, ValueError) as e:  # the model cannot run under this autocast here
                failed[p] = f"{type(e).__name__}: {' '.join(str(e).split()).split('. ')[0][:160]}"
    return cosines, failed, _worth_timing(workload, kind, precisions, cosines, failed, progress)


def _worth_timing(workload: Workload, kind: str, precisions: tuple[str, ...], cosines: dict[str, float],
                  failed: dict[str, str], progress: Callable[[str], None] | None) -> tuple[str, ...]:
    """`precisions` less those `hetsim.model.costmodel.precision_problem` refuses (the model fails under
    their autocast, or their gradient's cosine to fp32's is too low): no plan trains in them, so their
    timings and memory would never be read (resnet50's bf16 under CPU autocast, cosine 0.19, took
    about 10 of the main job's 13 profiling minutes on a CPU without bf16).  The profile keeps their
    failure or cosine, which is what refuses their plans."""
    refused = {p: c for p, c in cosines.items() if c < MIN_GRAD_COSINE}
    for p, c in refused.items():
        if progress:
            progress(f"not timing {workload.name} in {p} on {kind}: its gradient's cosine to the fp32 one is "
                     f"{c:.2f}, below {MIN_GRAD_COSINE}, so no plan trains in {p}")
    for p, why in failed.items():
        if progress:
            progress(f"not timing {workload.name} in {p} on {kind}: it fails under {p} autocast ({why}), "
                     f"so no plan trains in {p}")
    return tuple(p for p in precisions if p not in refused and p not in failed)


def grad_cosine(workload: Workload, device: torch.device, precision: str, mb: int) -> float:
    """Cosine between the gradient of one batch under `precision` autocast and the fp32 gradient
    (same initial weights, same batch).  Seen on this project's CPUs: 0.19 for BatchNorm resnet50,
    0.94 for resnet18, 0.9999 for a GroupNorm resnet."""
    torch.manual_seed(0)
    model = workload.model().to(device)
    x, y = workload.make_batch(mb, 7)
    x, y = x.to(device), y.to(device)

    def grads(prec: str) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with autocast(device, prec):
            out = model(x)
        workload.loss_sum(out.float(), y).backward()
        return torch.cat([p.grad.detach().flatten().float() for p in model.parameters() if p.grad is not None])

    ref = grads("fp32")
    low = grads(precision)
    return float(torch.nn.functional.cosine_similarity(ref, low, dim=0))
