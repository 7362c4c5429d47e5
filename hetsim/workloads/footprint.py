"""Bytes one sample of a workload needs, found without allocating: its input and target tensors,
and the activations its forward pass saves for backward, traced on the meta device.

The CLI checks a batch against memory with these before anything is profiled.  The saved bytes
are counted as the profiler counts them (distinct storages, parameters excluded): on resnet18 at
64 px the trace gives 1.73 MiB per sample, the recorded profile's fitted slope 1.81 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetsim.errors import ConfigError
from hetsim.profiling.saved import saved_storages, storage_ids
from hetsim.workloads.builtin import Workload

_TRACE_BATCH = 2  # BatchNorm needs two samples per channel in training mode


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleFootprint:
    input_bytes: int
    """Inputs and targets of one sample (what make_batch allocates per sample)."""
    saved_bytes: int | None
    """Activations the forward pass saves for backward, per sample, in fp32; None when the
    workload cannot be traced on the meta device (user code that reads tensor values)."""


def sample_footprint(workload: Workload) -> SampleFootprint:
    try:
        x, y = workload.make_batch(_TRACE_BATCH, 0)
        input_bytes = (int(x.nbytes) + int(y.nbytes)) // _TRACE_BATCH
    except Exception as e:  # user workloads: make_batch is their code
        raise ConfigError(f"--model {workload.spec or workload.name}: make_batch({_TRACE_BATCH}, 0) raised "
                          f"{type(e).__name__}: {e}; fix the workload's make_batch") from None
    return SampleFootprint(input_bytes=max(1, input_bytes), saved_bytes=_traced_saved_bytes(workload, x, y))


def _traced_saved_bytes(workload: Workload, x: torch.Tensor, y: torch.Tensor) -> int | None:
    try:
        with torch.device("meta"):
            blocks = workload.build_blocks()
        params = storage_ids(p for _, b in blocks for p in b.parameters())
        with saved_storages(params) as seen:
            h = x.to("meta")
            for _, block in blocks:
                h = block.train()(h)
            workload.loss_sum(h, y.to("meta"))
    except Exception:  # an estimate only: a model that cannot run on meta is checked by its inputs
        return None
    return sum(seen.values()) // _TRACE_BATCH
