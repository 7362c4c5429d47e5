"""Measured peak tensor memory of one training step, on CUDA or CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hetsim.types import MemoryBreakdown


def measure_step(fn: Callable[[], object], model: nn.Module, optimizer, device: torch.device) -> MemoryBreakdown:
    """Run fn() once and return its peak allocated tensor bytes by category."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        # The CUDA allocator knows only a total: report it as 'other' beside the exact state sizes.
        peak = int(torch.cuda.max_memory_allocated(device))
        params = 0
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard only
            if local.device == device:  # offloaded shards live on the host
                params += local.numel() * local.element_size()
        return MemoryBreakdown(params_bytes=params, other_bytes=max(0, peak - params))
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    _skip_frozen_parameters(mt)
    mt.track_external(*(m for m in (model, optimizer) if m is not None))
    # MemTracker refuses a second top-level forward in one context (accumulation micro-steps,
    # pipeline micro-batches) unless its module stats are reset; the device peak survives the reset.
    depth = [0]

    def in_backward() -> bool:
        return bool(getattr(getattr(mt, "_mod_tracker", None), "is_bw", False))

    def pre(mod, args):
        if in_backward():  # checkpoint recomputation: MemTracker handles it
            return
        if depth[0] == 0 and mod in mt.memory_tracking:
            mt.reset_mod_stats()
        depth[0] += 1

    def post(mod, args, out):
        if not in_backward():
            depth[0] -= 1

    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]
    try:
        with mt:
            fn()
    finally:
        for h in handles:
            h.remove()
    return peak_breakdown(mt)


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen_parameters(mt) -> None:
    """torch's MemTracker registers a gradient hook on every parameter of each module it enters, and
    `Tensor.register_hook` raises on a parameter that does not require a gradient ("cannot register a
    hook on a tensor that doesn't require gradient"): a model with a frozen backbone could not be
    measured.  MemTracker skips a parameter it has hooked already; each frozen one is entered as hooked,
    with handles that remove nothing, as the module is entered (FSDP2 swaps in unsharded parameters
    at each forward, so they are new objects every time).  It never gets a gradient: nothing goes
    untracked."""
    handles = getattr(mt, "_param_to_grad_hook_handles", None)
    track = getattr(mt, "_track_module_params_and_buffers", None)
    if handles is None or track is None:
        return

    def track_skipping_frozen(module: nn.Module, install_grad_hooks: bool = True):
        for p in module.parameters():
            if not p.requires_grad and handles.get(p, None) is None:
                handles[p] = (_NoHook(), _NoHook())
        return track(module, install_grad_hooks)

    mt._track_module_params_and_buffers = track_skipping_frozen


def peak_breakdown(mt) -> MemoryBreakdown:
    """A MemTracker's peak snapshot (its one device) by hetsim's categories."""
    snap = mt.get_tracker_snapshot("peak")
    dev_snap = next(iter(snap.values())) if snap else {}
    by = {str(k).rsplit(".", 1)[-1]: int(v) for k, v in dev_snap.items()}
    return MemoryBreakdown(
        params_bytes=by.get("PARAM", 0) + by.get("BUFFER", 0),
        grads_bytes=by.get("GRAD", 0),
        optim_bytes=by.get("OPT", 0),
        activations_bytes=by.get("ACT", 0),
        other_bytes=by.get("TEMP", 0) + by.get("OTH", 0),
    )
