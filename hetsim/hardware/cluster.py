"""Devices and clusters: emulated CPU workers, real CUDA GPUs, catalog GPUs, TOML files.

Every form of `--cluster` produces the same `Cluster` value.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import tomllib

from hetsim.errors import ClusterSpecError, UnknownNameError, shown

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


def _parse_speed(text: str) -> float:
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


def _check_count(n: int, limit: int, what: str, spec: str) -> None:
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


def emulated(spec: str) -> Cluster:
    """`emu:SPEED@MEM,...`, e.g. `emu:1.0@4G,0.5@2G`."""
    body = spec.split(":", 1)[1] if ":" in spec else ""
    items = [s.strip() for s in body.split(",")]
    if not body.strip() or any(not s for s in items):
        raise ClusterSpecError(
            f"--cluster {shown(spec)}: an emulated cluster lists devices as SPEED@MEM separated by commas, "
            "e.g. emu:1.0@4G,0.5@2G"
        )
    _check_count(len(items), MAX_EMULATED_DEVICES, "emulated devices", spec)
    devices = []
    for i, item in enumerate(items):
        if "@" not in item:
            raise ClusterSpecError(
                f"--cluster {shown(spec)}: device {shown(item)} has no memory; write SPEED@MEM, e.g. 0.5@2G"
            )
        speed_s, mem_s = item.split("@", 1)
        speed = _parse_speed(speed_s)
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
    )


def _pair_link(a: Device, b: Device) -> Link:
    if a.nvlink and b.nvlink and a.kind == b.kind:
        return Link(bandwidth_bps=50e9, latency_s=5e-6)
    bw = min(a.host_link_bps or NO_P2P_BPS, b.host_link_bps or NO_P2P_BPS, NO_P2P_BPS)
    return Link(bandwidth_bps=bw, latency_s=20e-6)


def _link_matrix(devices: tuple[Device, ...]) -> tuple[tuple[Link, ...], ...]:
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
    _check_count(len(items), MAX_DEVICES, "devices", spec)
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
        _check_count(total, MAX_DEVICES, "devices", spec)
        wanted.append((table[key], count))
    devs = tuple(catalog_device(entry, i) for i, entry in enumerate(e for e, n in wanted for _ in range(n)))
    return Cluster(
        spec=spec,
        source="catalog",
        devices=devs,
        links=_link_matrix(devs),
        host_memory_bytes=host_memory_bytes(),
        notes=("catalog devices are scaled from public specifications: simulation only, uncalibrated",
               "catalog capacity for tensors = memory - CUDA context (300-550 MiB) - 256 MiB cuBLAS/cuDNN "
               f"workspace, / {1 + ALLOCATOR_HEADROOM:g} for the caching allocator"),
    )


# ----------------------------------------------------------------------------- CUDA


def detect_cuda() -> Cluster | None:
    """Real GPUs through nvidia-ml-py and torch.cuda; None when there are none."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: not a CUDA machine
        return None
    try:
        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            return None
        devices = []
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
            try:
                cc = tuple(int(v) for v in pynvml.nvmlDeviceGetCudaComputeCapability(h))
            except Exception:
                cc = None
            try:
                gen = int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h))
                width = int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
                link = f"PCIe{gen} x{width}"
                # ~0.985 GB/s per lane for gen3, doubling each generation, ~80% efficiency.
                bps = 0.985e9 * (2 ** (gen - 3)) * width * 0.8
            except Exception:
                link, bps = "", 12e9
            nvlink = False
            for lk in range(18):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, lk):
                        nvlink = True
                        break
                except Exception:
                    break
            devices.append(
                Device(
                    name=name,
                    kind=name,
                    memory_bytes=mem,
                    backend="cuda",
                    index=i,
                    compute_capability=cc,  # type: ignore[arg-type]
                    host_link=link,
                    host_link_bps=bps,
                    nvlink=nvlink,
                )
            )
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    devs = tuple(devices)
    return Cluster(spec="cuda", source="cuda", devices=devs, links=_link_matrix(devs), host_memory_bytes=host_memory_bytes())


# ----------------------------------------------------------------------------- TOML


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
    speed = _parse_speed(_toml_text(e["speed"], "speed", i, path, "0.5"))
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
    _check_count(len(entries), MAX_DEVICES, "devices", path)
    table = load_catalog() if any(isinstance(e, dict) and "catalog" in e for e in entries) else None
    devs = tuple(_toml_device(e, i, path, table) for i, e in enumerate(entries))
    n_emulated = sum(d.backend == "emulated" for d in devs)
    _check_count(n_emulated, MAX_EMULATED_DEVICES, "emulated devices", path)
    links = None if n_emulated == len(devs) else _link_matrix(devs)
    return Cluster(spec=str(path), source="file", devices=devs, links=links, host_memory_bytes=host_memory_bytes())


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
