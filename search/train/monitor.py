"""Watching every device while training: where each rank's step goes, live and afterwards.

A step's wall time on a rank is split into
- compute: forward and backward of the model's top-level blocks, timed by hooks (emulated
  throttling included: it is the device being slow);
- optimizer: the optimizer step;
- idle: waiting for a slower rank, estimated as the slowest rank's compute minus this rank's;
- communication: the rest (gradient all-reduce not hidden behind backward, collectives).
On GPUs each device's utilisation comes from NVML.  Rank 0 shows a live table every few steps,
writes the same figures as TensorBoard scalars, and writes every rank's measured steps as a
Chrome/Perfetto trace at the end.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class StepRecord:
    step: int
    start_s: float
    """time.perf_counter() at the start (CLOCK_MONOTONIC: one clock for every process of a machine)."""
    wall_s: float
    compute_s: float
    optimizer_s: float
    samples: int
    loss: float | None = None
    peak_mem_bytes: int = 0
    util_pct: float | None = None
    probe_s: float = 0.0
    """The host-speed probe timed before the step (emulated ranks; 0: none)."""


class PhaseClock:
    """Times forward and backward of each top-level block with module hooks."""

    def __init__(self, blocks: list[nn.Module]):
        # The first block's inputs need no gradient: torch says its full backward hook then fires
        # on the outputs' gradients, which is the time we want.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.compute_s = 0.0
        self._t: dict[int, float] = {}
        for b in blocks:
            b.register_forward_pre_hook(self._start)
            b.register_forward_hook(self._stop)
            b.register_full_backward_pre_hook(self._start_bwd)
            b.register_full_backward_hook(self._stop_bwd)

    def _start(self, mod, args) -> None:
        self._t[id(mod)] = time.perf_counter()

    def _stop(self, mod, args, out) -> None:
        t0 = self._t.pop(id(mod), None)
        if t0 is not None:
            self.compute_s += time.perf_counter() - t0

    def _start_bwd(self, mod, grad_out) -> None:
        self._t[-id(mod)] = time.perf_counter()

    def _stop_bwd(self, mod, grad_in, grad_out) -> None:
        t0 = self._t.pop(-id(mod), None)
        if t0 is not None:
            self.compute_s += time.perf_counter() - t0

    def take(self) -> float:
        out, self.compute_s = self.compute_s, 0.0
        return out


def split_phases(records: list[list[StepRecord]], step_index: int) -> list[dict[str, float]]:
    """Per rank, one step's wall time as compute / optimizer / idle / communication."""
    recs = [r[step_index] for r in records]
    slowest = max(r.compute_s for r in recs)
    out = []
    for r in recs:
        rest = max(0.0, r.wall_s - r.compute_s - r.optimizer_s)
        idle = min(rest, slowest - r.compute_s)
        out.append({"wall_s": r.wall_s, "compute_s": r.compute_s, "optimizer_s": r.optimizer_s,
                    "idle_s": idle, "comm_s": rest - idle})
    return out


def gpu_utilisation(device: torch.device) -> float | None:
    """NVML's GPU utilisation (%) of a CUDA device, None elsewhere or without NVML."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # NVML missing or refusing: the column stays empty, training goes on
        return None


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return 0


def console_table(records: list[list[StepRecord]], step_index: int, shares: tuple[int, ...]):
    """A rich Table of one step, one row per rank."""
    from rich.table import Table

    t = Table(title=f"step {records[0][step_index].step}")
    for h in ("rank", "samples", "step ms", "compute ms", "comm ms", "idle ms", "optimizer ms", "peak MiB", "util %"):
        t.add_column(h, justify="right")
    for rank, ph in enumerate(split_phases(records, step_index)):
        rec = records[rank][step_index]
        t.add_row(str(rank), str(shares[rank]) if rank < len(shares) else "-", f"{1e3 * ph['wall_s']:.0f}",
                  f"{1e3 * ph['compute_s']:.0f}", f"{1e3 * ph['comm_s']:.0f}", f"{1e3 * ph['idle_s']:.0f}",
                  f"{1e3 * ph['optimizer_s']:.0f}", f"{rec.peak_mem_bytes / 2**20:.0f}" if rec.peak_mem_bytes else "-",
                  f"{rec.util_pct:.0f}" if rec.util_pct is not None else "-")
    return t


class Scalars:
    """TensorBoard scalars (torch.utils.tensorboard), written by rank 0."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, records: list[list[StepRecord]], step_index: int, samples_per_s: float | None) -> None:
        step = records[0][step_index].step
        w = self.writer
        loss = records[0][step_index].loss
        if loss is not None:
            w.add_scalar("train/loss", loss, step)
        if samples_per_s is not None:
            w.add_scalar("train/samples_per_s", samples_per_s, step)
        for rank, ph in enumerate(split_phases(records, step_index)):
            for k, v in ph.items():
                w.add_scalar(f"rank{rank}/{k}", v, step)
            rec = records[rank][step_index]
            w.add_scalar(f"rank{rank}/samples", rec.samples, step)
            if rec.peak_mem_bytes:
                w.add_scalar(f"rank{rank}/peak_mem_mib", rec.peak_mem_bytes / 2**20, step)
            if rec.util_pct is not None:
                w.add_scalar(f"rank{rank}/util_pct", rec.util_pct, step)

    def close(self) -> None:
        self.writer.close()


def write_trace(records: list[list[StepRecord]], path: Path) -> None:
    """Every rank's measured steps as a Chrome trace (chrome://tracing, ui.perfetto.dev): per step
    a compute, an optimizer and a communication/idle slice, laid out as they happened."""
    t0 = min(r[0].start_s for r in records if r)
    events = []
    for rank, recs in enumerate(records):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for i in range(len(recs)):
            ph = split_phases(records, i)[rank]
            at = (recs[i].start_s - t0) * 1e6
            for name in ("compute_s", "comm_s", "idle_s", "optimizer_s"):
                dur = ph[name] * 1e6
                if dur <= 0:
                    continue
                events.append({"name": name[:-2], "cat": "measured", "ph": "X", "pid": 0, "tid": rank, "ts": at,
                               "dur": dur, "args": {"step": recs[i].step}})
                at += dur
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def records_json(records: list[list[StepRecord]]) -> list[list[dict]]:
    return [[asdict(r) for r in recs] for recs in records]
