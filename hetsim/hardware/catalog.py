"""Catalog clusters (`--cluster catalog:KEY[*N],...`): GPUs from a table of public specifications, for what-if planning."""

from __future__ import annotations

import csv
import difflib
import re
from dataclasses import dataclass
from importlib import resources

from hetsim.errors import ClusterSpecError, UnknownNameError, shown
from hetsim.hardware.devices import (
    HOST_LINK_BPS,
    MAX_DEVICES,
    NO_P2P_BPS,
    Cluster,
    Device,
    GiB,
    Link,
    check_count,
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
    tf32_tflops: float
    fp16_tensor_tflops: float
    bf16_tflops: float
    host_link: str
    nvlink_gbs_bidir: float
    base_clock_mhz: float
    boost_clock_mhz: float
    tensor_acc16_ratio: float = 1.0
    """The chip's FP16-accumulate tensor rate over the datasheet's FP32-accumulate one: 2 on GeForce cards
    (RTX 2080 Ti, 3090, 4090), whose FP32-accumulate (and TF32) rates are half of what the same silicon
    does in its professional versions."""
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
            tf32_tflops=float(row.get("tf32_tflops") or 0.0),
            fp16_tensor_tflops=float(row["fp16_tensor_tflops"]),
            bf16_tflops=float(row["bf16_tflops"]),
            host_link=row["host_link"],
            nvlink_gbs_bidir=float(row["nvlink_gbs_bidir"]),
            base_clock_mhz=float(row.get("base_clock_mhz") or 0.0),
            boost_clock_mhz=float(row.get("boost_clock_mhz") or 0.0),
            tensor_acc16_ratio=float(row.get("tensor_acc16_ratio") or 1.0),
            notes=row["notes"],
        )
    return out


MiB = 1024**2
CUDA_CONTEXT_BYTES = {6: 300 * MiB, 7: 350 * MiB, 8: 450 * MiB, 9: 550 * MiB}
"""Device memory a CUDA context takes before any tensor, by compute-capability major (lazy module
loading, CUDA >= 11.7): 300-500 MiB on most GPUs, more on Hopper's larger kernel images."""
LIBRARY_WORKSPACE_BYTES = 256 * MiB
"""cuBLAS workspaces (a few MiB per handle, 32 MiB on Hopper) and cuDNN's convolution workspace,
which PyTorch allocates through its caching allocator at the first convolutions."""
ALLOCATOR_HEADROOM = 0.05
"""Fraction of the tensor peak the caching allocator holds beyond it (block rounding and
fragmentation): the H200 runs in results/gpu/h200 peaked within a few percent of the bytes the
memory model predicts, and PyTorch rounds every block to 512 B / 2 MiB segments."""


def catalog_capacity_bytes(entry: CatalogEntry) -> int:
    """Bytes a catalog GPU offers tensors: its memory less the CUDA context and library workspaces,
    then less the allocator's headroom (so a predicted tensor peak below it fits in practice)."""
    ctx = CUDA_CONTEXT_BYTES.get(entry.compute_capability[0], max(CUDA_CONTEXT_BYTES.values()))
    return int((entry.mem_gib * GiB - ctx - LIBRARY_WORKSPACE_BYTES) / (1 + ALLOCATOR_HEADROOM))


def catalog_device(entry: CatalogEntry, index: int) -> Device:
    # 'about 15 GiB usable with ECC' style notes are respected through mem_gib as published.
    return Device(
        name=entry.name,
        kind=entry.key,
        memory_bytes=catalog_capacity_bytes(entry),
        backend="catalog",
        index=index,
        compute_capability=entry.compute_capability,
        host_link=entry.host_link,
        host_link_bps=HOST_LINK_BPS.get(entry.host_link, 12e9),
        nvlink=entry.nvlink_gbs_bidir > 0,
        catalog_key=entry.key,
        peak_fp32_flops=entry.fp32_tflops * 1e12,
        peak_tf32_flops=entry.tf32_tflops * 1e12,
        peak_bf16_flops=entry.bf16_tflops * 1e12,
        peak_fp16_flops=(entry.fp16_tensor_tflops or entry.fp32_tflops) * 1e12,
        mem_bw_bps=entry.mem_bw_gbs * 1e9,
        base_clock_ratio=entry.base_clock_mhz / entry.boost_clock_mhz if entry.boost_clock_mhz > 0 else 1.0,
        tensor_feed=entry.tensor_acc16_ratio,
    )


def _pair_link(a: Device, b: Device) -> Link:
    if a.nvlink and b.nvlink and a.kind == b.kind:
        return Link(bandwidth_bps=50e9, latency_s=5e-6)
    bw = min(a.host_link_bps or NO_P2P_BPS, b.host_link_bps or NO_P2P_BPS, NO_P2P_BPS)
    return Link(bandwidth_bps=bw, latency_s=20e-6)


def link_matrix(devices: tuple[Device, ...]) -> tuple[tuple[Link, ...], ...]:
    memo: dict[tuple, Link] = {}  # one Link per pair of device types, not one per pair of devices

    def link(a: Device, b: Device) -> Link:
        key = (a.kind, a.nvlink, a.host_link_bps, b.kind, b.nvlink, b.host_link_bps)
        if key not in memo:
            memo[key] = _pair_link(a, b)
        return memo[key]

    return tuple(tuple(link(a, b) for b in devices) for a in devices)


def catalog(spec: str) -> Cluster:
    """`catalog:KEY[*N],...`, e.g. `catalog:rtx_3090,gtx_1080_ti*2,t4`."""
    table = load_catalog()
    body = spec.split(":", 1)[1] if ":" in spec else ""
    items = [s.strip() for s in body.split(",")]
    if not body.strip() or any(not s for s in items):
        raise ClusterSpecError(
            f"--cluster {shown(spec)}: a catalog cluster lists keys separated by commas, e.g. catalog:rtx_3090,t4*2"
        )
    check_count(len(items), MAX_DEVICES, "devices", spec)
    wanted: list[tuple[CatalogEntry, int]] = []
    total = 0
    for item in items:
        key, _, count_s = item.partition("*")
        key = key.strip().lower()
        count = 1
        if "*" in item:
            digits = count_s.strip().lstrip("0") or "0"
            if not re.fullmatch(r"[0-9]+", digits) or digits == "0":
                raise ClusterSpecError(f"--cluster {shown(spec)}: count {shown(count_s)} in {shown(item)} must be "
                                       "a whole number >= 1")
            count = int(digits) if len(digits) <= 12 else 10**12  # too many either way: the bound below says so
        if key not in table:
            close = difflib.get_close_matches(key[:100], list(table), n=1, cutoff=0.4)
            hint = f"did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError("catalog GPU", key if len(key) <= 100 else shown(key), list(table), hint)
        total += count
        check_count(total, MAX_DEVICES, "devices", spec)
        wanted.append((table[key], count))
    devs = tuple(catalog_device(entry, i) for i, entry in enumerate(e for e, n in wanted for _ in range(n)))
    return Cluster(
        spec=spec,
        source="catalog",
        devices=devs,
        links=link_matrix(devs),
        host_memory_bytes=host_memory_bytes(),
        notes=("catalog devices are scaled from public specifications: simulation only, uncalibrated",
               "catalog capacity for tensors = memory - CUDA context (300-550 MiB) - 256 MiB cuBLAS/cuDNN "
               f"workspace, / {1 + ALLOCATOR_HEADROOM:g} for the caching allocator"),
    )


# ----------------------------------------------------------------------------- CUDA
