"""Training precisions: their names, their bytes per value, and the autocast context every real step runs under."""

from __future__ import annotations

import contextlib

import torch

from hetsim.names import PRECISIONS  # noqa: F401 (re-exported)


def low_precision_dtype(precision: str) -> torch.dtype:
    """The autocast dtype of a low precision ('bf16' or 'fp16')."""
    return torch.bfloat16 if precision == "bf16" else torch.float16


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """torch.autocast for `precision` on `device`'s type; a no-op for fp32.  Profiling, memory
    calibration and every family's real step use this one context, so what is measured is what runs."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=low_precision_dtype(precision))
