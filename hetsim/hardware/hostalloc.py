"""One allocator behaviour for every process that times CPU work (profiling, real runs, calibration).

glibc's malloc serves a large block with a fresh `mmap` (every page of it zero-filled on first touch,
then handed back to the kernel on `free`) until a block of that size has been freed once; from then
on the threshold rises and blocks of that size come from the heap, page faults gone.  Which tensors
cross the threshold therefore depends on the order of a process's first frees, and a CPU training
process settles in one of two speeds for its whole life.  Measured on 2026-12-04 (2-vCPU AMD EPYC,
gpt@tiny@64, bf16, batch 32, one rank, median of 12 steps per process): 108-117 ms in some processes
and 124-138 ms in others under torchrun, while a process with the threshold fixed as below read
107-115 ms every time (and 126-138 ms without it).  The same plan's real runs spread as widely
(128-149 ms over eight runs), and block profiles timed in one mode and steps run in the other are
wrong by that much.

`steady_malloc()` fixes the threshold at its largest allowed value and stops trimming, so every
process runs in the fast mode from its first step: the emulated devices' speed no longer depends on
which run it is.  It is a setting of the host's C library, not of the training: GPU memory, the
emulated memory caps (counted tensor bytes) and the model are untouched.  `HETSIM_MALLOC=default`
leaves the allocator as it is (for comparison)."""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter numbers (malloc.h)."""

MMAP_THRESHOLD_BYTES = 32 * 1024**2
"""The largest mmap threshold glibc accepts on 64-bit hosts (half its 64 MiB heap limit): blocks
below it come from the heap.  Setting it also turns off the threshold's dynamic adjustment."""
TRIM_THRESHOLD_BYTES = 1024**3
"""Free memory kept at the top of the heap before it is returned to the kernel: above the peak of a
worker's step, so a step never returns pages that the next one faults in again."""
TOP_PAD_BYTES = 64 * 1024**2
"""Extra heap grown at a time, so a growing heap asks the kernel rarely."""

@functools.cache
def steady_malloc() -> bool:
    """Fix this process's malloc thresholds (once; see the module docstring).  True when set; False
    off glibc (macOS, musl) or with HETSIM_MALLOC=default, where nothing changes."""
    if not sys.platform.startswith("linux") or os.environ.get("HETSIM_MALLOC") == "default":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES)))
