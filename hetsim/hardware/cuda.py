"""Real CUDA GPUs (`--cluster cuda`): detected through nvidia-ml-py and torch.cuda."""

from __future__ import annotations

from hetsim.hardware.catalog import link_matrix
from hetsim.hardware.devices import (
    Cluster,
    Device,
    host_memory_bytes,
)


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
    return Cluster(spec="cuda", source="cuda", devices=devs, links=link_matrix(devs), host_memory_bytes=host_memory_bytes())


# ----------------------------------------------------------------------------- TOML
