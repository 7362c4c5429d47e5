"""Emulated clusters (`--cluster emu:SPEED@MEM,...`): CPU worker processes with a relative speed and a memory cap."""

from __future__ import annotations

import os

from hetsim.errors import ClusterSpecError, shown
from hetsim.hardware.devices import (
    MAX_EMULATED_DEVICES,
    Cluster,
    Device,
    GiB,
    check_count,
    host_memory_bytes,
    parse_size,
    parse_speed,
)


def emulated(spec: str) -> Cluster:
    """`emu:SPEED@MEM,...`, e.g. `emu:1.0@4G,0.5@2G`."""
    body = spec.split(":", 1)[1] if ":" in spec else ""
    items = [s.strip() for s in body.split(",")]
    if not body.strip() or any(not s for s in items):
        raise ClusterSpecError(
            f"--cluster {shown(spec)}: an emulated cluster lists devices as SPEED@MEM separated by commas, "
            "e.g. emu:1.0@4G,0.5@2G"
        )
    check_count(len(items), MAX_EMULATED_DEVICES, "emulated devices", spec)
    devices = []
    for i, item in enumerate(items):
        if "@" not in item:
            raise ClusterSpecError(
                f"--cluster {shown(spec)}: device {shown(item)} has no memory; write SPEED@MEM, e.g. 0.5@2G"
            )
        speed_s, mem_s = item.split("@", 1)
        speed = parse_speed(speed_s)
        mem = parse_size(mem_s, what=f"emulated device {i} memory")
        devices.append(
            Device(
                name=f"emu{i} (x{speed:g}, {mem / GiB:.2g} GiB)",
                kind="emu-cpu",
                memory_bytes=mem,
                speed=speed,
                backend="emulated",
                index=i,
            )
        )
    ncores = os.cpu_count() or 1
    notes = ()
    if len(devices) > ncores:
        notes = (
            f"{len(devices)} emulated devices on {ncores} CPU cores: workers share cores, so measured "
            "times are inexact",
        )
    return Cluster(spec=spec, source="emulated", devices=tuple(devices), host_memory_bytes=host_memory_bytes(), notes=notes)


# ----------------------------------------------------------------------------- catalog
