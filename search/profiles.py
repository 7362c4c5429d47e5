"""The profiles step: catalog GPUs from the model's traced shapes (roofline, nothing timed), every
other device kind measured (hetsim.profiling.obtain); and `obtain_profiles`, that step followed by
calibration (hetsim.search.calibrate), as the bench records its profiles."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from hetsim.errors import ProfileCorruptError
from hetsim.execution.runner import Launch
from hetsim.hardware.cluster import Cluster
from hetsim.model.roofline import ModelShapes, catalog_profile
from hetsim.profiling.obtain import (
    ProfileRequest,
    Say,
    load_or_measure,
    measure_profiles,
    micro_batch_sizes,
)
from hetsim.profiling.shapes import shapes_fingerprint, trace
from hetsim.profiling.store import ModelProfile, ProfileSet, safe_name

from .calibrate import calibrate


def obtain_profiles(cluster: Cluster, workload, *, root: Path, global_batch: int, precisions: tuple[str, ...],
                    reprofile: bool = False, say: Say = print, launch_cfg: Launch | None = None) -> ProfileSet:
    """Measured and calibrated profiles under root/profiles/: the profiles step, then calibration."""
    req = ProfileRequest(root=root, global_batch=global_batch, precisions=precisions, reprofile=reprofile,
                         launch=launch_cfg)
    return calibrate(cluster, workload, profiles_step(cluster, workload, req, say), req, say)


def profiles_step(cluster: Cluster, workload, req: ProfileRequest, say: Say = print) -> ProfileSet:
    """The profiles step: catalog GPUs from the model's traced shapes (nothing timed here), every
    other device kind measured (hetsim.profiling.obtain); measured kinds first, since the cost
    model's reference profile (memory calibration) is the first one."""
    sizes = micro_batch_sizes(req.global_batch, len(cluster.devices), coupled=workload.batch_coupled)
    catalog = catalog_profiles(cluster, workload, sizes, req.precisions, say, root=req.root, reprofile=req.reprofile)
    own = [k for k in cluster.kinds if any(d.kind == k and d.backend != "catalog" for d in cluster.devices)]
    kinds = own if (own or catalog) else ["emu-cpu"]  # untraceable model: catalog GPUs scale this CPU's profile
    profiles = measure_profiles(cluster, workload, req, say, kinds=kinds)
    return replace(profiles, models={**profiles.models, **catalog})


def catalog_profiles(cluster: Cluster, workload, sizes: tuple[int, ...], precisions: tuple[str, ...],
                     say: Say, root: Path | None = None, reprofile: bool = False) -> dict[str, ModelProfile]:
    """Roofline profiles of the cluster's catalog GPUs from the model's traced shapes (meta device):
    nothing is timed on this machine, at any precision or input size (hetsim.model.roofline).  With
    `root`, the shapes are kept in ROOT/profiles/catalog/ and reused while torch's version matches."""
    kinds = {d.kind: d for d in cluster.devices if d.backend == "catalog"}
    if not kinds:
        return {}
    t0 = time.perf_counter()

    def traced() -> ModelShapes:
        return replace(trace(workload), fingerprint=shapes_fingerprint(workload.spec))

    try:
        if root is None:
            shapes = traced()
        else:
            path = root / "profiles" / "catalog" / f"shapes-{safe_name(workload.spec)}.json"
            shapes = load_or_measure(path, ModelShapes, shapes_fingerprint(workload.spec), traced, reprofile, lambda m: None)
    except ProfileCorruptError:
        raise
    except Exception as e:  # a model the meta device cannot run (data-dependent shapes, .item())
        say(f"{workload.spec} cannot be traced on the meta device ({type(e).__name__}: {e}); catalog GPUs "
            f"are scaled from this machine's CPU profile instead (one FLOP ratio, less accurate)")
        return {}
    out = {}
    for kind, dev in kinds.items():
        fp = {"kind": kind, "model": workload.spec, "roofline": "1"}
        out[kind] = catalog_profile(shapes, dev, precisions, sizes, fp)
    say(f"catalog GPUs ({', '.join(kinds)}): roofline from the traced shapes of {workload.spec} "
        f"in {time.perf_counter() - t0:.1f} s, nothing timed on this machine")
    return out
