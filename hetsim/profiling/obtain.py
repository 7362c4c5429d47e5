"""The profiles step: load the profiles a cost model needs while their fingerprint matches, measure
and record the rest (device, model blocks, collectives) under one profiles folder.

Nothing here runs a training plan: the calibration terms that need real runs of strategies are
added afterwards by `hetsim.search.calibrate`.  The main job's folder is its `--out` (an ignored
cache by default); the committed recordings under results/profiles/ are read by the regression
tests and written only by the bench that records them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hetsim.errors import ProfileMismatchError
from hetsim.execution.runner import Launch, commbench
from hetsim.hardware.cluster import Cluster, Device
from hetsim.hardware.hostalloc import steady_malloc
from hetsim.names import CALIB_REPEATS
from hetsim.profiling.measure import device_fingerprint, profile_device, profile_model
from hetsim.profiling.store import (
    CommProfile,
    DeviceProfile,
    ModelProfile,
    ProfileSet,
    comm_fingerprint,
    comm_profile_path,
    device_profile_path,
    load,
    model_fingerprint,
    model_profile_path,
    save,
)

Say = Callable[[str], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileRequest:
    """What to profile for and where the profiles live."""

    root: Path
    """Folder that holds `profiles/` (the main job's --out; the bench: results/)."""
    global_batch: int
    """The search's global batch: it sets the micro-batch sizes a model is timed at."""
    precisions: tuple[str, ...]
    reprofile: bool = False
    """Measure again even where a recorded profile's fingerprint matches."""
    launch: Launch | None = None
    """torchrun settings of the collective benchmark (multi-node runs)."""
    strategies: tuple[str, ...] | None = None
    """The families the search will run: calibration measures only their terms (None: every term)."""
    repeats: int = CALIB_REPEATS
    """Real runs of each calibration plan (the search's --calib-repeats; more while no two agree)."""


COUPLED_CHUNKS = (4, 8)
"""Gradient-cache chunk counts whose chunk of an even local batch a batch-coupled workload is also
profiled at: its plans run many small chunks, and block time per sample is not constant in the batch."""


def micro_batch_sizes(global_batch: int, n_devices: int, coupled: bool = False) -> tuple[int, ...]:
    """Sizes to profile: from small accumulation micro-batches up to the largest local batch a plan may use
    (`coupled`: with the gradient cache's chunks of an even local batch, `COUPLED_CHUNKS`)."""
    top = max(2, global_batch - (n_devices - 1))
    sizes = {2, max(2, global_batch // (2 * n_devices)), max(2, global_batch // n_devices), top}
    if coupled:
        sizes |= {max(2, global_batch // (c * n_devices)) for c in COUPLED_CHUNKS}
    return tuple(sorted(sizes))


def load_or_measure(path: Path, cls, expect: dict[str, str], measure: Callable[[], object], reprofile: bool,
                    say: Say):
    """The profile recorded at `path` if its fingerprint matches `expect`, else `measure()`, recorded there."""
    if path.exists() and not reprofile:
        try:
            obj = load(cls, path, expect)
            say(f"reusing {path}")
            return obj
        except ProfileMismatchError as e:  # not an error: the setup changed, so measure again and say so
            say(f"{e}")
        # A ProfileCorruptError propagates: the CLI names the file and says to delete it or pass
        # --reprofile, rather than silently overwriting a file someone may have edited.
    obj = measure()
    save(obj, path)
    say(f"recorded {path}")
    return obj


def measured_kinds(cluster: Cluster) -> list[str]:
    """Device kinds to profile on this machine (catalog clusters scale from this machine's CPU)."""
    kinds = [k for k in cluster.kinds if any(d.kind == k and d.backend != "catalog" for d in cluster.devices)]
    return kinds or ["emu-cpu"]


def torch_device(dev: Device | None) -> torch.device:
    return torch.device("cuda", dev.index) if dev is not None and dev.backend == "cuda" else torch.device("cpu")


def measure_profiles(cluster: Cluster, workload, req: ProfileRequest, say: Say = print,
                     kinds: list[str] | None = None) -> ProfileSet:
    """Device and model profiles of every measured device kind, and collectives for groups of 2 and
    of the whole cluster, each reused from `req.root`/profiles/ while its fingerprint matches."""
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # each worker process computes with one thread
    steady_malloc()  # as every rank of a real run does (hetsim.hardware.hostalloc)
    models: dict[str, ModelProfile] = {}
    devices: dict[str, DeviceProfile] = {}
    sizes = micro_batch_sizes(req.global_batch, len(cluster.devices), coupled=workload.batch_coupled)
    for kind in measured_kinds(cluster) if kinds is None else kinds:
        device = torch_device(next((d for d in cluster.devices if d.kind == kind), None))
        fp = device_fingerprint(kind, device)
        devices[kind] = load_or_measure(device_profile_path(req.root, kind), DeviceProfile, fp,
                                        lambda k=kind, d=device: profile_device(k, d), req.reprofile, say)
        models[kind] = load_or_measure(
            model_profile_path(req.root, kind, workload.spec), ModelProfile,
            model_fingerprint(fp, workload.spec, sizes, req.precisions),
            lambda k=kind, d=device: profile_model(workload, k, d, sizes, req.precisions, progress=say),
            req.reprofile, say)
    comm = measure_collectives(cluster, req, say)
    say(f"profiles ready in {time.perf_counter() - t0:.0f} s ({Path(req.root) / 'profiles'})")
    return ProfileSet(models=models, devices=devices, comm=comm)


def measure_collectives(cluster: Cluster, req: ProfileRequest, say: Say) -> dict[int, CommProfile]:
    """All-reduce, all-gather and send/recv over real groups of 2 and of every device (no link
    matrix given); nothing for one device or a cluster whose links are known."""
    n = len(cluster.devices)
    if cluster.links is not None or n < 2:
        return {}
    kind = cluster.devices[0].kind
    fp = device_fingerprint(kind, torch_device(cluster.devices[0]))
    comm: dict[int, CommProfile] = {}
    for ws in sorted({2, n}):
        fp_ws = comm_fingerprint(fp, ws)
        comm[ws] = load_or_measure(comm_profile_path(req.root, kind, ws), CommProfile, fp_ws,
                                   lambda ws=ws, f=fp_ws: commbench(cluster, ws, f, launch_cfg=req.launch),
                                   req.reprofile, say)
    return comm
