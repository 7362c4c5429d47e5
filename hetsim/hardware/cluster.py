"""Every `--cluster` form to one `Cluster`: `parse_cluster` is the entry (emulated, CUDA, catalog, TOML file).

The forms live beside it: devices.py (Device, Link, Cluster, sizes), emulated.py, catalog.py,
cuda.py, clusterfile.py; their public names are re-exported here.
"""

from __future__ import annotations

import os

from hetsim.errors import ClusterSpecError, shown
from hetsim.hardware.catalog import (
    CatalogEntry,
    catalog,
    catalog_capacity_bytes,
    catalog_device,
    link_matrix,
    load_catalog,
)
from hetsim.hardware.clusterfile import from_toml
from hetsim.hardware.cuda import detect_cuda
from hetsim.hardware.devices import (
    DEFAULT_EMULATED,
    HOST_LINK_BPS,
    MAX_DEVICES,
    MAX_EMULATED_DEVICES,
    NO_P2P_BPS,
    Cluster,
    Device,
    GiB,
    Link,
    host_memory_bytes,
    interchangeable_groups,
    parse_size,
)
from hetsim.hardware.emulated import emulated

__all__ = [
    "DEFAULT_EMULATED",
    "HOST_LINK_BPS",
    "NO_P2P_BPS",
    "CatalogEntry",
    "Cluster",
    "Device",
    "MAX_DEVICES",
    "MAX_EMULATED_DEVICES",
    "GiB",
    "Link",
    "link_matrix",
    "catalog",
    "catalog_capacity_bytes",
    "catalog_device",
    "detect_cuda",
    "emulated",
    "from_toml",
    "host_memory_bytes",
    "interchangeable_groups",
    "load_catalog",
    "parse_cluster",
    "parse_size",
]


def parse_cluster(spec: str | None) -> Cluster:
    """Any `--cluster` form; None picks `cuda` when GPUs are present, else the emulated default."""
    if spec is None:
        found = detect_cuda()
        return found if found is not None else emulated(DEFAULT_EMULATED)
    s = spec.strip()
    if not s:
        raise ClusterSpecError(f"--cluster {spec!r} is empty (an unset shell variable?); give a cluster such as "
                               f"{DEFAULT_EMULATED}, or leave --cluster out for the default")
    if s.startswith("emu:") or s == "emu":
        return emulated(s)
    if s.startswith("catalog:") or s == "catalog":
        return catalog(s)
    if s == "cuda":
        found = detect_cuda()
        if found is None:
            raise ClusterSpecError(
                "--cluster cuda: no NVIDIA GPU was found (nvidia-ml-py sees no device); "
                f"use an emulated cluster such as {DEFAULT_EMULATED}"
            )
        return found
    if s.endswith(".toml") or os.path.sep in s or os.path.exists(s):
        return from_toml(s)
    raise ClusterSpecError(
        f"--cluster {shown(spec)} is not a cluster; use emu:SPEED@MEM,... (e.g. {DEFAULT_EMULATED}), "
        "catalog:KEY[*N],... (e.g. catalog:rtx_3090,t4), cuda, or a path to a .toml file"
    )
