"""Workloads: a model as an ordered list of blocks (the cut points), a batch maker, a loss and an optimizer."""

from __future__ import annotations

from hetsim.workloads.builtin import (
    BUILTIN,
    IMAGE_MODELS,
    OPTIMIZER_STATE_PER_PARAM,
    OPTIMIZERS,
    Workload,
    default_image_size,
    load_workload,
    make_optimizer,
    workload_from_spec,
)
from hetsim.workloads.usermodel import UserModel

__all__ = [
    "BUILTIN",
    "IMAGE_MODELS",
    "OPTIMIZER_STATE_PER_PARAM",
    "OPTIMIZERS",
    "UserModel",
    "Workload",
    "default_image_size",
    "load_workload",
    "make_optimizer",
    "workload_from_spec",
]
