"""Clusters from a TOML file: a list of devices (named, catalog or emulated) and optional links."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import tomllib

from hetsim.errors import ClusterSpecError, UnknownNameError, shown
from hetsim.hardware.catalog import CatalogEntry, catalog_device, link_matrix, load_catalog
from hetsim.hardware.devices import (
    MAX_CLUSTER_FILE_BYTES,
    MAX_DEVICES,
    MAX_EMULATED_DEVICES,
    Cluster,
    Device,
    GiB,
    check_count,
    host_memory_bytes,
    parse_size,
    parse_speed,
)

_TOML_DEVICE_FIELDS = frozenset({"name", "memory", "speed", "catalog"})
_MAX_NAME_CHARS = 100


def _read_cluster_file(path: str) -> dict:
    """The parsed TOML of a cluster file: a regular file of at most MAX_CLUSTER_FILE_BYTES (a FIFO or
    /dev/zero would never end), valid UTF-8 and valid TOML."""
    p = Path(path)
    try:
        if not p.exists():
            raise ClusterSpecError(f"cluster file {shown(path)} does not exist; give an existing TOML file or an "
                                   "emu:/catalog: spec")
        if not p.is_file():
            what = "a folder" if p.is_dir() else "not a regular file (a device, a pipe or a socket)"
            raise ClusterSpecError(f"cluster file {shown(path)} cannot be read: it is {what}; give a TOML file")
        with p.open("rb") as f:
            raw = f.read(MAX_CLUSTER_FILE_BYTES + 1)
    except OSError as e:
        raise ClusterSpecError(f"cluster file {shown(path)} cannot be read ({e.strerror or e}); check its "
                               "permissions") from None
    if len(raw) > MAX_CLUSTER_FILE_BYTES:
        raise ClusterSpecError(f"cluster file {shown(path)} is larger than 64 KiB; a cluster file lists at most "
                               f"{MAX_DEVICES} [[device]] tables (about 30 KiB): is it the right file?")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ClusterSpecError(f"cluster file {shown(path)} cannot be read: it is not UTF-8 text ({e.reason} at "
                               f"byte {e.start}); save it as UTF-8") from None
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as e:  # ValueError: a 5,000-digit integer
        why = str(e) if isinstance(e, tomllib.TOMLDecodeError) else f"{type(e).__name__}: {str(e)[:200]}"
        raise ClusterSpecError(f"cluster file {shown(path)} is not valid TOML: {why}") from None


def _toml_text(value: object, field_name: str, i: int, path: str, example: str) -> str:
    """A TOML field that must be a string or a number: a table, list or boolean is a mistake."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ClusterSpecError(f"cluster file {shown(path)}: device {i} {field_name} is a "
                               f"{type(value).__name__} ({shown(value, 40)}); write e.g. {field_name} = {example}")
    return str(value)


def _toml_device(e: object, i: int, path: str, catalog_table: dict[str, CatalogEntry] | None) -> Device:
    if not isinstance(e, dict):
        raise ClusterSpecError(f"cluster file {shown(path)}: device {i} is not a table; write [[device]] tables")
    unknown = sorted(set(e) - _TOML_DEVICE_FIELDS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(_TOML_DEVICE_FIELDS), n=1, cutoff=0.5)
        raise ClusterSpecError(
            f"cluster file {shown(path)}: device {i} has unknown field(s) {', '.join(shown(u, 40) for u in unknown[:5])}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; a device takes {', '.join(sorted(_TOML_DEVICE_FIELDS))}"
        )
    name = e.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > _MAX_NAME_CHARS
                             or not name.isprintable()):
        raise ClusterSpecError(f"cluster file {shown(path)}: device {i} name {shown(name, 40)} must be a non-empty "
                               f"string of at most {_MAX_NAME_CHARS} printable characters, e.g. name = \"gpu0\"")
    if "catalog" in e:
        if not isinstance(e["catalog"], str):
            raise ClusterSpecError(f"cluster file {shown(path)}: device {i} catalog is a "
                                   f"{type(e['catalog']).__name__}; write a GPU key such as catalog = \"t4\"")
        table = catalog_table if catalog_table is not None else load_catalog()
        key = e["catalog"].strip().lower()
        if key not in table:
            close = difflib.get_close_matches(key[:100], list(table), n=1, cutoff=0.4)
            raise UnknownNameError("catalog GPU", key if len(key) <= 100 else shown(key), list(table),
                                   f"did you mean {close[0]!r}?" if close else "")
        dev = catalog_device(table[key], i)
        if "memory" in e:
            mem = parse_size(_toml_text(e["memory"], "memory", i, path, '"24G"'), what=f"device {i} memory")
            dev = dataclasses.replace(dev, memory_bytes=mem)
        return dataclasses.replace(dev, name=name) if name else dev
    missing = [k for k in ("speed", "memory") if k not in e]
    if missing:
        raise ClusterSpecError(
            f"cluster file {shown(path)}: device {i} misses field(s) {', '.join(missing)}; "
            "an emulated device needs speed (e.g. 0.5) and memory (e.g. \"2G\"), a GPU needs catalog (e.g. \"t4\")"
        )
    speed = parse_speed(_toml_text(e["speed"], "speed", i, path, "0.5"))
    mem = parse_size(_toml_text(e["memory"], "memory", i, path, '"2G"'), what=f"device {i} memory")
    return Device(name=name or f"emu{i} (x{speed:g}, {mem / GiB:.2g} GiB)", kind="emu-cpu", memory_bytes=mem,
                  speed=speed, backend="emulated", index=i)


def from_toml(path: str) -> Cluster:
    """A TOML file: [[device]] tables with name, memory, and speed (emulated) or catalog key."""
    data = _read_cluster_file(path)
    entries = data.get("device")
    if not isinstance(entries, list) or not entries:
        found = f" (it has: {', '.join(shown(k, 30) for k in sorted(data)[:10])})" if data else " (it is empty)"
        raise ClusterSpecError(
            f"cluster file {shown(path)} has no [[device]] tables{found}; each device needs at least "
            "'memory' and either 'speed' (emulated) or 'catalog' (a GPU key)"
        )
    other = sorted(set(data) - {"device"})
    if other:
        raise ClusterSpecError(f"cluster file {shown(path)} has unknown top-level key(s) "
                               f"{', '.join(shown(k, 30) for k in other[:5])}; a cluster file holds only "
                               "[[device]] tables")
    check_count(len(entries), MAX_DEVICES, "devices", path)
    table = load_catalog() if any(isinstance(e, dict) and "catalog" in e for e in entries) else None
    devs = tuple(_toml_device(e, i, path, table) for i, e in enumerate(entries))
    n_emulated = sum(d.backend == "emulated" for d in devs)
    check_count(n_emulated, MAX_EMULATED_DEVICES, "emulated devices", path)
    links = None if n_emulated == len(devs) else link_matrix(devs)
    return Cluster(spec=str(path), source="file", devices=devs, links=links, host_memory_bytes=host_memory_bytes())
