"""Obtain the profiles a cost model needs: load recorded ones while their fingerprint matches,
measure (and record) the rest."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from hetsim.cluster import Cluster
from hetsim.errors import ProfileCorruptError, ProfileMismatchError
from hetsim.profiles import CommProfile, DeviceProfile, ModelProfile, ProfileSet, load, save

Say = Callable[[str], None]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", text)


def micro_batch_sizes(global_batch: int, n_devices: int) -> tuple[int, ...]:
    """Sizes to profile: from small accumulation micro-batches up to the largest local batch a plan may use."""
    top = max(2, global_batch - (n_devices - 1))
    sizes = {2, max(2, global_batch // (2 * n_devices)), max(2, global_batch // n_devices), top}
    return tuple(sorted(sizes))


def _load_or(path: Path, cls, expect: dict[str, str], measure: Callable[[], object], reprofile: bool, say: Say):
    if path.exists() and not reprofile:
        try:
            obj = load(cls, path, expect)
            say(f"reusing {path}")
            return obj
        except ProfileMismatchError as e:
            say(f"{e}")
        except ProfileCorruptError as e:
            say(f"{e}; measuring again")
    obj = measure()
    save(obj, path)
    say(f"recorded {path}")
    return obj


def obtain_profiles(cluster: Cluster, workload, *, root: Path, global_batch: int, precisions: tuple[str, ...],
                    reprofile: bool = False, say: Say = print, launch_cfg=None) -> ProfileSet:
    import torch

    from hetsim.profiling import device_fingerprint, profile_device, profile_model
    from hetsim.runner import commbench

    torch.set_num_threads(1)  # each worker process computes with one thread
    measured_kinds = [k for k in cluster.kinds if any(d.kind == k and d.backend != "catalog" for d in cluster.devices)]
    if not measured_kinds:
        measured_kinds = ["emu-cpu"]  # catalog clusters scale from this machine's CPU profile
    models: dict[str, ModelProfile] = {}
    devices: dict[str, DeviceProfile] = {}
    sizes = micro_batch_sizes(global_batch, len(cluster.devices))
    for kind in measured_kinds:
        dev_obj = next((d for d in cluster.devices if d.kind == kind), None)
        device = torch.device("cuda", dev_obj.index) if dev_obj is not None and dev_obj.backend == "cuda" else torch.device("cpu")
        fp = device_fingerprint(kind, device)
        base = root / "profiles" / _safe(kind)
        devices[kind] = _load_or(base / "device.json", DeviceProfile, fp,
                                 lambda k=kind, d=device: profile_device(k, d), reprofile, say)
        mfp = dict(fp)
        mfp.update({"model": workload.spec, "micro_batches": ",".join(map(str, sizes)), "precisions": ",".join(precisions)})
        models[kind] = _load_or(
            base / f"model-{_safe(workload.spec)}.json", ModelProfile, mfp,
            lambda k=kind, d=device: profile_model(workload, k, d, sizes, precisions, progress=say),
            reprofile, say,
        )
    comm: dict[int, CommProfile] = {}
    n = len(cluster.devices)
    if cluster.links is None and n > 1:
        kind = cluster.devices[0].kind
        dev0 = cluster.devices[0]
        device = torch.device("cuda", dev0.index) if dev0.backend == "cuda" else torch.device("cpu")
        cfp = device_fingerprint(kind, device)
        for ws in sorted({2, n}):
            cfp_ws = dict(cfp, world_size=str(ws))
            comm[ws] = _load_or(root / "profiles" / _safe(kind) / f"comm-{ws}.json", CommProfile, cfp_ws,
                                lambda ws=ws, f=cfp_ws: commbench(cluster, ws, f, launch_cfg=launch_cfg), reprofile, say)
    return ProfileSet(models=models, devices=devices, comm=comm)
