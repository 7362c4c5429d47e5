"""Emulated heterogeneity on CPU worker processes.

Speed: every block's forward and backward, and the optimizer step, is timed
and followed by a busy wait of (1/speed - 1) x its duration, so a device of speed
0.5 takes twice as long for whatever it really computed, while data and
communication stay real.  A busy wait, not a sleep: measured here, a rank that
slept between blocks computed its next block ~40% slower (an idle vCPU loses its
caches and clock), so a 0.5 device ran 2.85x slower instead of 2x; spinning gave
2.05x.  It needs one core per worker, which hetsim already asks for.  Memory: peak tensor bytes of one instrumented step
(PyTorch's MemTracker) are accounted against the device's cap; going over
raises a real out-of-memory error from the accounting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch
from torch import nn

from hetsim.errors import EmulatedOutOfMemoryError


class Emulator:
    def __init__(self, speed: float, cap_bytes: int, device_name: str = "emulated device", *,
                 adjustable: bool = False):
        """`adjustable`: hook every block even at full speed, so that `set_speed` can slow the
        device later (hetsim.search.train's emulated slowdown)."""
        self.adjustable = adjustable
        self.speed = speed
        self.cap_bytes = cap_bytes
        self.device_name = device_name
        self.factor = 1.0 / speed - 1.0
        self.throttled_s = 0.0
        self.enabled = True

    def throttle(self, compute_s: float) -> None:
        """Spin (1/speed - 1) x `compute_s`: for executors that place the throttle themselves (tensor
        parallelism spins before each collective, not after each block)."""
        self._sleep_for(compute_s)

    def _sleep_for(self, dt: float) -> None:
        if self.enabled and self.factor > 0 and dt > 0:
            extra = self.factor * dt
            self.throttled_s += extra
            if os.environ.get("HETSIM_THROTTLE") == "sleep":  # the old behaviour, for comparison
                time.sleep(extra)
            else:
                end = time.perf_counter() + extra
                while time.perf_counter() < end:
                    pass

    # ------------------------------------------------------------------ compute
    def attach(self, blocks: Iterable[nn.Module]) -> None:
        """Throttle forward and backward of each block (call before wrapping in DDP/FSDP/pipeline)."""
        if self.factor <= 0 and not self.adjustable:
            return
        for block in blocks:
            self._attach_block(block)

    def _attach_block(self, block: nn.Module) -> None:
        state = {"t_fwd": 0.0, "t_bwd": 0.0, "input_grad": False, "pending": 0}
        params = [p for p in block.parameters() if p.requires_grad]

        def fwd_pre(mod, args):
            state["t_fwd"] = time.perf_counter()
            state["input_grad"] = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)

        def fwd_post(mod, args, out):
            self._sleep_for(time.perf_counter() - state["t_fwd"])

        def bwd_pre(mod, grad_out):
            state["t_bwd"] = time.perf_counter()
            state["pending"] = len(params)

        def bwd_post(mod, grad_in, grad_out):
            # Fires after the input gradient; when no input needs a gradient it fires
            # before the weight gradients, and the last parameter's hook closes the block.
            if state["input_grad"] or not params:
                self._sleep_for(time.perf_counter() - state["t_bwd"])

        def param_done(p):
            if state["input_grad"]:
                return
            state["pending"] -= 1
            if state["pending"] == 0:
                self._sleep_for(time.perf_counter() - state["t_bwd"])

        block.register_forward_pre_hook(fwd_pre)
        block.register_forward_hook(fwd_post)
        block.register_full_backward_pre_hook(bwd_pre)
        block.register_full_backward_hook(bwd_post)
        for p in params:
            p.register_post_accumulate_grad_hook(param_done)

    def loss(self, fn, out: torch.Tensor) -> torch.Tensor:
        """`fn(out)`, the loss of a model's output, throttled forward and backward like a block: a slow GPU
        computes its loss slowly too.  Blocks' hooks never saw it, while profiles time the last block with
        the loss (`hetsim.profiling.measure`), so a slow device holding the last stage ran faster than
        simulated: bert@tiny@64 (vocabulary 30522), model parallelism over the default cluster, 2026-12-03,
        35-45 ms a step faster than simulated with the last stage on the slow device, 15-20 ms slower with
        it on the fast one.  The backward is timed from the loss's gradient to `out`'s."""
        if (self.factor <= 0 and not self.adjustable) or not out.requires_grad:
            return fn(out)
        clock = {"t": 0.0}

        def start() -> None:
            clock["t"] = time.perf_counter()

        t0 = time.perf_counter()
        value = fn(_OnBackward.apply(out, lambda: self._sleep_for(time.perf_counter() - clock["t"]), False))
        self._sleep_for(time.perf_counter() - t0)
        return _OnBackward.apply(value, start, True)

    def set_speed(self, speed: float) -> None:
        """From now on run at `speed` (relative to the measured profile); needs `adjustable` to
        slow a device that started at full speed."""
        self.speed = speed
        self.factor = 1.0 / speed - 1.0

    def wrap_optimizer(self, opt: torch.optim.Optimizer) -> None:
        if self.factor <= 0 and not self.adjustable:
            return
        t = {"t0": 0.0}
        opt.register_step_pre_hook(lambda o, a, k: t.__setitem__("t0", time.perf_counter()))
        opt.register_step_post_hook(lambda o, a, k: self._sleep_for(time.perf_counter() - t["t0"]))

    # ------------------------------------------------------------------ memory
    def check_memory(self, peak_bytes: int, breakdown: str = "") -> None:
        if peak_bytes > self.cap_bytes:
            raise EmulatedOutOfMemoryError(
                f"out of memory on {self.device_name}: the step's peak tensor memory is "
                f"{peak_bytes / 2**20:.1f} MiB, over its emulated capacity of {self.cap_bytes / 2**20:.1f} MiB "
                f"by {(peak_bytes - self.cap_bytes) / 2**20:.1f} MiB{(' (' + breakdown + ')') if breakdown else ''}; "
                "use a smaller local batch, checkpointing, sharding or a device with more memory"
            )


class _OnBackward(torch.autograd.Function):
    """Identity whose backward first calls `hook` (`Emulator.loss`'s clock).  `copy`: a copy, not a view,
    for the loss itself, which zero-bubble schedules detach in place after its input gradients (torch's
    `stage_backward_input`)."""

    @staticmethod
    def forward(ctx, x, hook, copy):
        ctx.hook = hook
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.hook()
        return g, None, None
