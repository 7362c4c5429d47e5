"""Memory calibration of a model profile: one plain training step of the whole model, measured.

The per-block profile (hetsim.profiling.measure) measures each block alone.  Two things only the whole
model shows, and hetsim.model.memory needs them: how many saved bytes adjacent blocks share (a block's
output that the next block saves as its input is one tensor), and the temporaries at the peak of
a step.  Both are measured the way real runs are measured (MemTracker, step index 1, after a
warm-up step created the optimizer state) at two micro-batch sizes and fitted linearly.
"""

from __future__ import annotations

import torch

from hetsim.execution.memtrack import measure_step
from hetsim.profiling.saved import saved_storages, storage_ids
from hetsim.profiling.store import MemoryCalibration
from hetsim.types import Fit
from hetsim.workloads.builtin import Workload
from hetsim.workloads.precision import autocast


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor, device: torch.device, precision: str) -> int:
    """Distinct storages the whole model saves for backward (parameters excluded)."""
    with saved_storages(storage_ids(model.parameters())) as seen, autocast(device, precision):
        out = model(x)
    del out
    return sum(seen.values())


def _foreign_bytes(device: torch.device) -> int:
    """Bytes the CUDA allocator holds for tensors alive before a measurement starts.

    On CUDA the peak is the allocator's, and in the profiling process it counts whatever else is
    still alive (the device benchmark's matrices, tensors awaiting collection); a real run's worker
    has none of it.  MemTracker on CPU counts only the tensors of the step, so this is 0 there."""
    if device.type != "cuda":
        return 0
    import gc

    gc.collect()
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def _step_peak(workload: Workload, device: torch.device, precision: str, mb: int) -> tuple[int, int]:
    """(peak bytes of the second step, resident state bytes) of a plain one-process step."""
    foreign = _foreign_bytes(device)
    model = workload.model().to(device)
    opt = workload.make_optimizer(model.parameters())
    x, y = workload.make_batch(mb, 0)
    x, y = x.to(device), y.to(device)

    def step():
        with autocast(device, precision):
            out = model(x)
        (workload.loss_sum(out.float(), y) / mb).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()
    mem = measure_step(step, model, opt, device)
    state = sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1)  # params + grads (none if frozen)
                for p in model.parameters())
    state += sum(b.numel() * b.element_size() for b in model.buffers())
    state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor))
    return mem.total_bytes - foreign, state


def profile_memory(workload: Workload, device: torch.device, micro_batches: tuple[int, ...],
                   precisions: tuple[str, ...] = ("fp32",)) -> MemoryCalibration:
    """Whole-model saved bytes and step temporaries at the smallest and largest micro-batch."""
    sizes = sorted({min(micro_batches), max(micro_batches)})
    saved: dict[str, Fit] = {}
    temps: dict[str, Fit] = {}
    for prec in precisions:
        s_pts, t_pts = [], []
        for mb in sizes:
            torch.manual_seed(0)
            model = workload.model().to(device)
            x, _ = workload.make_batch(mb, 0)
            s = _saved_bytes(model, x.to(device), device, prec)
            del model, x
            peak, state = _step_peak(workload, device, prec, mb)
            s_pts.append(float(s))
            t_pts.append(float(peak - state - s))
        saved[prec] = Fit.least_squares([float(m) for m in sizes], s_pts)
        temps[prec] = Fit.least_squares([float(m) for m in sizes], t_pts)
    return MemoryCalibration(saved_bytes=saved, temp_bytes=temps)
