"""Which low precisions a model profile times: each one's gradient is compared with fp32's on one
batch first (`grad_cosine`, beside `rounding_cosine`: how far rounding the weights alone moves it),
and a precision whose plans would be refused, because the model fails under its autocast or its
gradient points elsewhere, is not timed (`screen_precisions`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetsim.model.costmodel import MIN_GRAD_COSINE, cosine_refuses
from hetsim.workloads.builtin import Workload
from hetsim.workloads.precision import autocast


def screen_precisions(workload: Workload, kind: str, device: torch.device, precisions: tuple[str, ...], mb: int,
                      progress: Callable[[str], None] | None) -> tuple[dict[str, float], dict[str, float],
                                                                     dict[str, str], tuple[str, ...]]:
    """(gradient cosine of each low precision, the cosine of rounding the weights to it, the error of each
    the model fails under, the precisions to time) for a profile of `workload` on `kind`, from one batch
    of `mb` samples."""
    cosines, floors, failed = {}, {}, {}
    for p in precisions:
        if p != "fp32":
            try:
                cosines[p] = grad_cosine(workload, device, p, mb)
            except (RuntimeError, TypeError, ValueError) as e:  # the model cannot run under this autocast here
                failed[p] = f"{type(e).__name__}: {' '.join(str(e).split()).split('. ')[0][:160]}"
                continue
            if cosines[p] < MIN_GRAD_COSINE:  # is the model's gradient this sensitive by itself?
                floors[p] = rounding_cosine(workload, device, p, mb)
    return cosines, floors, failed, _worth_timing(workload, kind, precisions, cosines, floors, failed, progress)


def _worth_timing(workload: Workload, kind: str, precisions: tuple[str, ...], cosines: dict[str, float],
                  floors: dict[str, float], failed: dict[str, str],
                  progress: Callable[[str], None] | None) -> tuple[str, ...]:
    """`precisions` less those `hetsim.model.costmodel.precision_problem` refuses (the model fails under
    their autocast, or their gradient's cosine to fp32's is too low for how far rounding moves it): no
    plan trains in them, so their timings and memory would never be read.  The profile keeps their
    failure or cosines, which is what refuses their plans."""
    refused = [p for p, c in cosines.items() if cosine_refuses(c, floors.get(p))]
    for p in refused:
        if progress:
            progress(f"not timing {workload.name} in {p} on {kind}: its gradient's cosine to the fp32 one is "
                     f"{cosines[p]:.2f}, below {MIN_GRAD_COSINE} (rounding the weights to {p} alone gives "
                     f"{floors[p]:.2f}), so no plan trains in {p}")
    for p, why in failed.items():
        if progress:
            progress(f"not timing {workload.name} in {p} on {kind}: it fails under {p} autocast ({why}), "
                     f"so no plan trains in {p}")
    return tuple(p for p in precisions if p not in refused and p not in failed)


def grad_cosine(workload: Workload, device: torch.device, precision: str, mb: int) -> float:
    """Cosine between the gradient of one batch under `precision` autocast and the fp32 gradient
    (same initial weights, same batch).  Seen on this project's CPUs: 0.16-0.19 for BatchNorm
    resnet50 (0.15 on an H200), 0.94 for resnet18, 0.9999 for a GroupNorm resnet."""
    model, x, y = _model_and_batch(workload, device, mb)
    return _cosine(_grads(workload, device, model, x, y, "fp32"), _grads(workload, device, model, x, y, precision))


def rounding_cosine(workload: Workload, device: torch.device, precision: str, mb: int) -> float:
    """Cosine between the fp32 gradient of that batch and the fp32 gradient at the weights rounded to
    `precision`: how far this model's gradient moves from rounding alone (a BatchNorm resnet50 at
    initialisation: 0.42-0.46 for bf16; resnet18 0.98; a GroupNorm resnet and gpt 0.9999)."""
    model, x, y = _model_and_batch(workload, device, mb)
    ref = _grads(workload, device, model, x, y, "fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    return _cosine(ref, _grads(workload, device, model, x, y, "fp32"))


def _model_and_batch(workload: Workload, device: torch.device, mb: int):
    torch.manual_seed(0)
    model = workload.model().to(device)
    x, y = workload.make_batch(mb, 7)
    return model, x.to(device), y.to(device)


def _grads(workload: Workload, device: torch.device, model, x, y, precision: str) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with autocast(device, precision):
        out = model(x)
    workload.loss_sum(out.float(), y).backward()
    return torch.cat([p.grad.detach().flatten().float() for p in model.parameters() if p.grad is not None])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))
