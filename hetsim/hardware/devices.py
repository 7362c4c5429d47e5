"""Devices, links and clusters: the one value every `--cluster` form produces; sizes, speeds, bounds, host memory, interchangeable devices."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from hetsim.errors import ClusterSpecError, shown

GiB = 1024**3
DEFAULT_EMULATED = "emu:1.0@4G,0.5@2G"

# Upper bounds, checked before a device is built: a typo of a few digits must fail in a line, not
# build a hundred million devices or reach the profiler.
MAX_DEVICES = 1024
"""Devices in one cluster.  The link matrix and the symmetry grouping grow with the square of the
count (the search is benchmarked on up to 512 catalog devices)."""
MAX_EMULATED_DEVICES = 64
"""Emulated devices: each is a CPU worker process that imports torch (~0.3 GiB of RAM each)."""
MAX_DEVICE_MEMORY_BYTES = 16 * 1024**4
"""16 TiB per device: above any accelerator's memory (the largest have 0.2-0.3 TiB)."""
MIN_DEVICE_MEMORY_BYTES = 1024
"""1 KiB: a memory written in bytes by mistake ('0.5' is 0 bytes) is refused; tests model tight
devices of 10 KiB and up."""
MAX_CLUSTER_FILE_BYTES = 64 * 1024
"""A cluster file lists at most MAX_DEVICES small tables (1,024 x ~30 bytes: ~30 KiB).  Python's
TOML parser takes about a second per 100 KiB on a loaded 2-core VM: a larger file is refused
before it is parsed."""

# Effective per-direction figures (shared/data/link_bandwidths.md), bytes per second.
HOST_LINK_BPS = {
    "PCIe3 x16": 12e9,
    "PCIe4 x8": 12e9,  # as many lanes-x-rate as PCIe3 x16 (RTX 4060 Ti, A2)
    "PCIe4 x16": 25e9,
    "PCIe5 x16": 35e9,
    "NVLink2": 12e9,  # SXM boards still reach the host over PCIe3
    "NVLink3": 25e9,
    "NVLink4": 35e9,
}
# Device-to-device through host memory when there is no P2P (NCCL over PCIe): ~6 GB/s.
NO_P2P_BPS = 6e9


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One device of a cluster."""

    name: str
    """Human name, e.g. 'emu0 (x1.0, 4.0 GiB)' or 'NVIDIA GeForce RTX 3090'."""
    kind: str
    """Profile key: devices of one kind share one measured profile ('emu-cpu', a GPU name)."""
    memory_bytes: int
    """Capacity for tensors (the emulated cap, or the GPU's total memory)."""
    speed: float = 1.0
    """Relative compute speed against the kind's measured profile (emulated throttle)."""
    backend: str = "emulated"
    """'emulated', 'cuda' or 'catalog'."""
    index: int = 0
    """CUDA ordinal for 'cuda' devices; position otherwise."""
    compute_capability: tuple[int, int] | None = None
    host_link: str = ""
    """E.g. 'PCIe4 x16'."""
    host_link_bps: float = 0.0
    """Host<->device bandwidth per direction, bytes/s (0: unknown / same memory)."""
    nvlink: bool = False
    catalog_key: str = ""
    peak_fp32_flops: float = 0.0
    peak_tf32_flops: float = 0.0
    """Dense TF32 tensor-core rate (0: none before Ampere)."""
    peak_bf16_flops: float = 0.0
    peak_fp16_flops: float = 0.0
    mem_bw_bps: float = 0.0
    base_clock_ratio: float = 1.0
    """Base over boost clock: the datasheet peaks are at boost; a power-limited GPU sustains less."""
    tensor_feed: float = 1.0
    """What the tensor cores' data paths are built to feed, over their datasheet (FP32-accumulate) rate: 2 on
    GeForce cards, whose tensor issue rate is halved on a chip fed for the full one."""

    @property
    def supports_bf16(self) -> bool:
        if self.backend == "emulated":
            return True
        return self.compute_capability is not None and self.compute_capability >= (8, 0)

    @property
    def fast_fp16(self) -> bool:
        """fp16 is faster than fp32 only with tensor cores (cc >= 7.0)."""
        if self.backend == "emulated":
            return False
        return self.compute_capability is not None and self.compute_capability >= (7, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    bandwidth_bps: float
    """Effective bytes per second, one direction."""
    latency_s: float = 10e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    spec: str
    """The text the user gave (or the file path)."""
    source: str
    """'emulated', 'cuda', 'catalog' or 'file'."""
    devices: tuple[Device, ...]
    links: tuple[tuple[Link, ...], ...] | None = None
    """Link matrix (None: use the measured collectives of the process group)."""
    host_memory_bytes: int = 0
    """Host RAM available for offload (psutil), shared by all devices of the node."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def emulated(self) -> bool:
        return all(d.backend == "emulated" for d in self.devices)

    @property
    def calibrated(self) -> bool:
        """Catalog devices are scaled from specifications, not measured."""
        return not any(d.backend == "catalog" for d in self.devices)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.kind for d in self.devices))

    def describe(self) -> str:
        label = {
            "emulated": "EMULATED cluster (CPU worker processes; speed and memory are emulated)",
            "cuda": "CUDA cluster",
            "catalog": "CATALOG cluster (simulation only, uncalibrated: scaled from public specs)",
            "file": "cluster from file",
        }[self.source]
        devs = "; ".join(
            f"[{i}] {d.name} {d.memory_bytes / GiB:.1f} GiB" + (f" x{d.speed:g}" if d.backend == "emulated" else "")
            for i, d in enumerate(self.devices)
        )
        return f"{label}: {self.spec} -> {devs}"


# ----------------------------------------------------------------------------- interchangeable devices


def _same_device(a: Device, b: Device) -> bool:
    """Equal in everything but the label and the position (name, index)."""
    return a == dataclasses.replace(b, name=a.name, index=a.index)


def _swappable(cluster: Cluster, i: int, j: int) -> bool:
    """True when exchanging devices i and j leaves the cluster the same: equal devices, and equal
    links to and from every third device (and between the two, in both directions)."""
    devs = cluster.devices
    if not _same_device(devs[i], devs[j]):
        return False
    links = cluster.links
    if links is None:  # collectives come from the measured process group: the same for any member
        return True
    if links[i][j] != links[j][i] or links[i][i] != links[j][j]:
        return False
    return all(links[i][k] == links[j][k] and links[k][i] == links[k][j]
               for k in range(len(devs)) if k != i and k != j)


def interchangeable_groups(cluster: Cluster) -> tuple[tuple[int, ...], ...]:
    """Device indices grouped so that any two devices of a group can be swapped without changing
    the cluster (same kind, speed, memory, backend and links), each group in index order and the
    groups in order of their first device.  Swaps compose, so this is an equivalence and every
    permutation within a group is a symmetry: a plan that uses k devices of a group may as well
    use the first k.  On a cluster where every device differs, every group has one device."""
    groups: list[list[int]] = []
    for i in range(len(cluster.devices)):
        for g in groups:
            if _swappable(cluster, g[0], i):
                g.append(i)
                break
        else:
            groups.append([i])
    return tuple(tuple(g) for g in groups)


# ----------------------------------------------------------------------------- parsing

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str, *, what: str = "memory size") -> int:
    """'4G', '512M', '1.5GiB', '1073741824' -> bytes."""
    m = _SIZE.match(text) if len(text) <= 40 else None  # a longer "size" is a typo, not a number to parse
    if not m and text.strip().startswith("-") and _SIZE.match(text.strip().lstrip("-")):
        raise ClusterSpecError(f"{what} {shown(text)} is negative; it must be greater than zero (e.g. 4G)")
    if not m:
        raise ClusterSpecError(
            f"{what} {shown(text)} is not a size; write a number with an optional unit K, M, G or T (e.g. 4G, 512M)"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ClusterSpecError(f"{what} {shown(text)} must be greater than zero (e.g. 4G)")
    if not value <= MAX_DEVICE_MEMORY_BYTES:  # also catches inf from a 400-digit number
        raise ClusterSpecError(
            f"{what} {shown(text)} is above the limit of 16T per device (the largest accelerators have "
            "under 0.3 TiB); check the unit: K, M, G, T are powers of 1024 (e.g. 80G)"
        )
    if value < MIN_DEVICE_MEMORY_BYTES:
        raise ClusterSpecError(
            f"{what} {shown(text)} is below 1K ({int(value)} bytes), too small to hold any tensor; check the "
            "unit (e.g. 512M, 4G)"
        )
    return int(value)


MIN_SPEED = 1e-3
"""An emulated device 1,000 times slower than this CPU would make one step take minutes."""


def parse_speed(text: str) -> float:
    try:
        speed = float(text) if len(text) <= 40 else float("nan")
    except ValueError:
        speed = None
    if speed is None or text.strip().lower() in ("true", "false"):
        raise ClusterSpecError(
            f"emulated device speed {shown(text)} is not a number; write e.g. 1.0 or 0.5 (relative to this CPU)"
        )
    if not speed > 0 or speed != speed or speed == float("inf"):
        raise ClusterSpecError(
            f"emulated device speed {shown(text)} must be a finite number > 0 (1.0 = this CPU, 0.5 = half as fast)"
        )
    if speed > 1.0:
        raise ClusterSpecError(
            f"emulated device speed {shown(text)} is above 1.0: a CPU worker cannot run faster than this CPU; "
            "scale the speeds so the fastest device is 1.0"
        )
    if speed < MIN_SPEED:
        raise ClusterSpecError(
            f"emulated device speed {shown(text)} is below {MIN_SPEED:g}: a worker throttled more than "
            "1,000x would take minutes per step; use a speed from 0.001 to 1.0"
        )
    return speed


def check_count(n: int, limit: int, what: str, spec: str) -> None:
    if n > limit:
        raise ClusterSpecError(
            f"--cluster {shown(spec)} has {n:,} {what}; the limit is {limit}"
            + (" (each emulated device is a CPU worker process that imports torch)" if limit == MAX_EMULATED_DEVICES
               else " (the planner's link matrix grows with the square of the device count)")
            + "; use fewer devices"
        )


def host_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # psutil missing is not fatal: offload then has no host cap
        return 0
