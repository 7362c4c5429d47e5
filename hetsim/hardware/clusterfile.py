"""Clusters from a TOML file: a list of devices (named, catalog or emulated) and optional links."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import tomllib

from hetsim.errors import ClusterSpecError, UnknownNameError
from hetsim.hardware.catalog import catalog_device, link_matrix, load_catalog
from hetsim.hardware.devices import (
    Cluster,
    Device,
    GiB,
    host_memory_bytes,
    parse_size,
    parse_speed,
)

_TOML_DEVICE_FIELDS = frozenset({"name", "memory", "speed", "catalog"})


def from_toml(path: str) -> Cluster:
    """A TOML file: [[device]] tables with name, memory, and speed (emulated) or catalog key."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ClusterSpecError(f"cluster file {path!r} does not exist; give an existing TOML file or an emu:/catalog: spec") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ClusterSpecError(f"cluster file {path!r} cannot be read ({e}); check its permissions and encoding") from None
    except tomllib.TOMLDecodeError as e:
        raise ClusterSpecError(f"cluster file {path!r} is not valid TOML: {e}") from None
    entries = data.get("device")
    if not isinstance(entries, list) or not entries:
        found = f" (it has: {', '.join(sorted(data))})" if data else " (it is empty)"
        raise ClusterSpecError(
            f"cluster file {path!r} has no [[device]] tables{found}; each device needs at least "
            "'memory' and either 'speed' (emulated) or 'catalog' (a GPU key)"
        )
    table = None
    devices: list[Device] = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ClusterSpecError(f"cluster file {path!r}: device {i} is not a table")
        unknown = sorted(set(e) - _TOML_DEVICE_FIELDS)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(_TOML_DEVICE_FIELDS), n=1, cutoff=0.5)
            raise ClusterSpecError(
                f"cluster file {path!r}: device {i} has unknown field(s) {', '.join(map(repr, unknown))}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; a device takes {', '.join(sorted(_TOML_DEVICE_FIELDS))}"
            )
        if "catalog" in e:
            table = table or load_catalog()
            key = str(e["catalog"]).lower()
            if key not in table:
                close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.4)
                raise UnknownNameError("catalog GPU", key, list(table), f"did you mean {close[0]!r}?" if close else "")
            dev = catalog_device(table[key], i)
            if "memory" in e:
                dev = dataclasses.replace(dev, memory_bytes=parse_size(str(e["memory"]), what=f"device {i} memory"))
            devices.append(dev)
            continue
        missing = [k for k in ("speed", "memory") if k not in e]
        if missing:
            raise ClusterSpecError(
                f"cluster file {path!r}: device {i} misses field(s) {', '.join(missing)}; "
                "an emulated device needs speed (e.g. 0.5) and memory (e.g. \"2G\")"
            )
        speed = parse_speed(str(e["speed"]))
        mem = parse_size(str(e["memory"]), what=f"device {i} memory")
        devices.append(
            Device(
                name=str(e.get("name", f"emu{i} (x{speed:g}, {mem / GiB:.2g} GiB)")),
                kind="emu-cpu",
                memory_bytes=mem,
                speed=speed,
                backend="emulated",
                index=i,
            )
        )
    devs = tuple(devices)
    links = None if all(d.backend == "emulated" for d in devs) else link_matrix(devs)
    return Cluster(spec=str(path), source="file", devices=devs, links=links, host_memory_bytes=host_memory_bytes())
