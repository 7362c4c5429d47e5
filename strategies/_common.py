"""Helpers shared by the strategy families' real runs (torch side)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

CKPT_PREFIX = "_checkpoint_wrapped_module."


def apply_checkpointing(model: nn.Sequential, k: int) -> None:
    """Wrap the first k blocks in non-reentrant activation checkpointing (torch's own wrapper)."""
    if k <= 0:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    names = [n for n, _ in model.named_children()][:k]
    for n in names:
        setattr(model, n, checkpoint_wrapper(getattr(model, n), checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def clean_name(name: str) -> str:
    """Parameter name in the unwrapped model (drops DDP, FSDP, checkpoint and compile prefixes)."""
    for prefix in ("module.", "_orig_mod."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name.replace(CKPT_PREFIX, "")


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "full_tensor"):  # DTensor (FSDP2)
            g = g.full_tensor()
        out[clean_name(name)] = g.detach().clone()
    return out
