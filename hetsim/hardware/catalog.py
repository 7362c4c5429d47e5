"""Catalog clusters (`--cluster catalog:KEY[*N],...`): GPUs from a table of public specifications, for what-if planning."""

from __future__ import annotations

import csv
import difflib
from dataclasses import dataclass
from importlib import resources

from hetsim.errors import ClusterSpecError, UnknownNameError
from hetsim.hardware.devices import (
    HOST_LINK_BPS,
    NO_P2P_BPS,
    Cluster,
    Device,
    GiB,
    Link,
    host_memory_bytes,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class CatalogEntry:
    key: str
    name: str
    compute_capability: tuple[int, int]
    mem_gib: float
    mem_bw_gbs: float
    fp32_tflops: float
    fp16_tensor_tflops: float
    bf16_tflops: float
    host_link: str
    nvlink_gbs_bidir: float
    notes: str


def load_catalog() -> dict[str, CatalogEntry]:
    text = resources.files("hetsim").joinpath("data/gpu_specs.csv").read_text()
    out = {}
    for row in csv.DictReader(text.splitlines()):
        major, minor = row["compute_capability"].split(".")
        out[row["key"]] = CatalogEntry(
            key=row["key"],
            name=row["name"],
            compute_capability=(int(major), int(minor)),
            mem_gib=float(row["mem_gib"]),
            mem_bw_gbs=float(row["mem_bw_gbs"]),
            fp32_tflops=float(row["fp32_tflops"]),
            fp16_tensor_tflops=float(row["fp16_tensor_tflops"]),
            bf16_tflops=float(row["bf16_tflops"]),
            host_link=row["host_link"],
            nvlink_gbs_bidir=float(row["nvlink_gbs_bidir"]),
            notes=row["notes"],
        )
    return out


def catalog_device(entry: CatalogEntry, index: int) -> Device:
    # 'about 15 GiB usable with ECC' style notes are respected through mem_gib as published.
    return Device(
        name=entry.name,
        kind=entry.key,
        memory_bytes=int(entry.mem_gib * GiB),
        backend="catalog",
        index=index,
        compute_capability=entry.compute_capability,
        host_link=entry.host_link,
        host_link_bps=HOST_LINK_BPS.get(entry.host_link, 12e9),
        nvlink=entry.nvlink_gbs_bidir > 0,
        catalog_key=entry.key,
        peak_fp32_flops=entry.fp32_tflops * 1e12,
        peak_bf16_flops=entry.bf16_tflops * 1e12,
        peak_fp16_flops=(entry.fp16_tensor_tflops or entry.fp32_tflops) * 1e12,
        mem_bw_bps=entry.mem_bw_gbs * 1e9,
    )


def _pair_link(a: Device, b: Device) -> Link:
    if a.nvlink and b.nvlink and a.kind == b.kind:
        return Link(bandwidth_bps=50e9, latency_s=5e-6)
    bw = min(a.host_link_bps or NO_P2P_BPS, b.host_link_bps or NO_P2P_BPS, NO_P2P_BPS)
    return Link(bandwidth_bps=bw, latency_s=20e-6)


def link_matrix(devices: tuple[Device, ...]) -> tuple[tuple[Link, ...], ...]:
    return tuple(tuple(_pair_link(a, b) for b in devices) for a in devices)


def catalog(spec: str) -> Cluster:
    """`catalog:KEY[*N],...`, e.g. `catalog:rtx_3090,gtx_1080_ti*2,t4`."""
    table = load_catalog()
    body = spec.split(":", 1)[1] if ":" in spec else ""
    items = [s.strip() for s in body.split(",")]
    if not body.strip() or any(not s for s in items):
        raise ClusterSpecError(
            f"--cluster {spec!r}: a catalog cluster lists keys separated by commas, e.g. catalog:rtx_3090,t4*2"
        )
    devices: list[Device] = []
    for item in items:
        key, _, count_s = item.partition("*")
        key = key.strip().lower()
        count = 1
        if count_s:
            if not count_s.strip().isdigit() or int(count_s) < 1:
                raise ClusterSpecError(f"--cluster {spec!r}: count {count_s!r} in {item!r} must be a whole number >= 1")
            count = int(count_s)
        if key not in table:
            close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.4)
            hint = f"did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError("catalog GPU", key, list(table), hint)
        devices.extend(catalog_device(table[key], len(devices) + j) for j in range(count))
    devs = tuple(devices)
    return Cluster(
        spec=spec,
        source="catalog",
        devices=devs,
        links=link_matrix(devs),
        host_memory_bytes=host_memory_bytes(),
        notes=("catalog devices are scaled from public specifications: simulation only, uncalibrated",),
    )
