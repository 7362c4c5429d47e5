"""The per-rank loop of every real run: one instrumented step for memory, warm-up, timed steps.

torchrun starts `python -m hetsim.strategies.rank JOB.json` on every rank (the strategy layer
builds the plan's executor); `main` here runs the job with it: it measures one instrumented step
for memory (checked against the emulated cap), then warm-up and timed steps, and writes
`rank{R}.json` into the job's folder before tearing down (a gloo group can abort at exit after
all work is done).  The core never imports a strategy: the executor comes in as `build_executor`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hetsim.errors import EmulatedOutOfMemoryError
from hetsim.execution.emulation import Emulator
from hetsim.execution.launcher import die_with_parent
from hetsim.execution.memtrack import measure_step
from hetsim.hardware.hostalloc import steady_malloc
from hetsim.profiling.commbench import run_commbench
from hetsim.profiling.hostspeed import RunProbe, at_ref, shared_probes
from hetsim.serial import dump_json, from_dict, to_dict
from hetsim.types import MemoryBreakdown
from hetsim.workloads import Workload, workload_from_spec


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """Injected fault, for tests: 'oom', 'kill', 'hang', 'nan' or 'raise' on one rank."""

    kind: str
    rank: int = 0
    at_step: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    task: str
    """'train' (measure a plan), 'grads' (compare with the single-process gradient), 'commbench'."""
    plan: dict = field(default_factory=dict)
    workload: str = ""
    optimizer: str = "adamw"
    global_batch: int = 0
    devices: tuple[dict, ...] = ()
    """Device dicts of the plan, in rank order."""
    steps: int = 5
    warmup: int = 2
    """Untimed steps before the timed ones (at least 2: step 1 is instrumented for memory)."""
    seed: int = 0
    out_dir: str = ""
    fault: Fault | None = None
    probe: bool = False
    """Time hetsim.profiling.hostspeed's probe before every timed step (CPU ranks on a shared host)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankResult:
    rank: int
    status: str
    step_s: tuple[float, ...] = ()
    """Every timed step of this rank, in order."""
    probe_s: tuple[float, ...] = ()
    """The host-speed probe timed just before each timed step (empty when not asked for)."""
    memory: MemoryBreakdown | None = None
    losses: tuple[float, ...] = ()
    error: str | None = None
    grad_rel_err: float | None = None
    grad_names: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)
    failed_at_s: float | None = None
    """Wall-clock time (time.time()) of the failure: the earliest one explains the others."""
    step_starts_s: tuple[float, ...] = ()
    """time.perf_counter() at the start of each timed step (one monotonic clock per machine, so the
    ranks of one node line up; the measured timeline)."""


CUDA_WARMUP_S = 2.0
"""Least wall time of untimed steps on a GPU before timing (clock ramp-up)."""


def _device_for(dev: dict, local_rank: int):
    import torch

    if dev.get("backend") == "cuda":
        torch.cuda.set_device(dev.get("index", local_rank))
        return torch.device("cuda", dev.get("index", local_rank))
    return torch.device("cpu")


def _inject(fault: Fault | None, rank: int, step: int) -> None:
    if fault is None or fault.rank != rank or fault.at_step != step:
        return
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        time.sleep(3600)
    if fault.kind == "raise":
        raise RuntimeError("injected crash")


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """What a rank knows when its executor is built: who it is, on what, for which workload."""

    rank: int
    world_size: int
    device: object
    """torch.device of this rank."""
    workload: Workload
    emulator: Emulator | None
    backend: str


BuildExecutor = Callable[[Job, RankEnv], object]
"""(job, rank environment) -> the plan's executor for this rank (hetsim.strategies.rank builds it)."""


def run_job(job: Job, build_executor: BuildExecutor) -> RankResult:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    steady_malloc()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = job.devices[rank]
    device = _device_for(dev, local_rank)
    backend = "nccl" if device.type == "cuda" and all(d.get("backend") == "cuda" for d in job.devices) else "gloo"
    dist.init_process_group(backend=backend)
    if job.task == "commbench":
        return RankResult(rank=rank, status="ok", extra=run_commbench(device))

    emulator = None
    if dev.get("backend") == "emulated":
        emulator = Emulator(float(dev["speed"]), int(dev["memory_bytes"]), dev.get("name", f"rank {rank}"))
    wl = workload_from_spec(job.workload, job.optimizer)
    ex = build_executor(job, RankEnv(rank=rank, world_size=world, device=device, workload=wl, emulator=emulator,
                                     backend=backend))
    if job.task == "grads":
        return _grads_result(ex, wl, job, rank)

    step = _CheckedStep(ex, job.fault, rank)
    mem = _memory_of_a_step(ex, step, emulator, device)
    if job.fault is not None and job.fault.kind == "oom" and job.fault.rank == rank:
        mem = MemoryBreakdown(other_bytes=int(dev["memory_bytes"]) + 2**20)  # 1 MiB over the cap
    if emulator is not None:
        try:
            emulator.check_memory(mem.total_bytes)
        except EmulatedOutOfMemoryError as e:
            return RankResult(rank=rank, status="oom", memory=mem, error=str(e), failed_at_s=time.time())
    _warm_up(step, job.warmup, device)
    times, probes, starts = _timed_steps(step, job, device)
    return RankResult(rank=rank, status="ok", step_s=tuple(times), probe_s=tuple(probes), memory=mem,
                      losses=tuple(step.losses), step_starts_s=tuple(starts))


def _grads_result(ex, wl: Workload, job: Job, rank: int) -> RankResult:
    """This rank's gradients against the single-process reference: the largest relative error."""
    grads = ex.compute_grads()
    ref = _reference_grads(wl, job.global_batch, job.seed)
    err = 0.0
    for name, g in grads.items():
        r = ref[name]
        err = max(err, float((g.float() - r).norm() / (r.norm() + 1e-12)))
    return RankResult(rank=rank, status="ok", grad_rel_err=err, grad_names=tuple(sorted(grads)))


class _CheckedStep:
    """The executor's step i with the job's injected fault, its loss kept and checked finite."""

    def __init__(self, ex, fault: Fault | None, rank: int):
        self.ex, self.fault, self.rank = ex, fault, rank
        self.losses: list[float] = []

    def __call__(self, i: int) -> None:
        fault, rank = self.fault, self.rank
        _inject(fault, rank, i)
        loss = self.ex.step()
        if fault is not None and fault.kind == "nan" and fault.rank == rank and i >= fault.at_step:
            loss = float("nan")
        if loss is not None:
            self.losses.append(float(loss))
            if not math.isfinite(float(loss)):
                raise FloatingPointError(f"non-finite loss {loss} at step {i} on rank {rank}")


def _memory_of_a_step(ex, step: _CheckedStep, emulator: Emulator | None, device) -> MemoryBreakdown:
    """Steps 0 and 1, step 1 instrumented for memory (unthrottled); its peak by category."""
    # Step 0 warms up (the optimizer creates its state lazily); step 1 is instrumented for
    # memory, so its peak holds the steady state: parameters, gradients, optimizer state and
    # the activations of a step all at once.  Timing comes from the uninstrumented steps.
    model = getattr(ex, "model", None)
    opt = getattr(ex, "opt", None)
    step(0)
    if emulator is not None:
        emulator.enabled = False
    # An executor whose step MemTracker's per-module attribution cannot follow (pipeline schedules
    # call each stage once per micro-batch, zero-bubble ones run autograd.grad) measures itself.
    own = getattr(ex, "measure_memory", None)
    mem = own(lambda: step(1)) if own is not None else measure_step(lambda: step(1), model, opt, device)
    if emulator is not None:
        emulator.enabled = True
    return mem


def _warm_up(step: _CheckedStep, warmup: int, device) -> None:
    """The untimed steps after step 1; on a GPU, more of them for CUDA_WARMUP_S."""
    import torch

    for i in range(2, warmup):
        step(i)
    if device.type == "cuda":
        # A GPU idles at a low clock and ramps up under load: measured on an H200, the first timed
        # steps of a 3-step warm-up ran 10-20% slower than later ones.  Warm up for a time instead.
        t_end = time.perf_counter() + CUDA_WARMUP_S
        for _ in range(200):
            step(-1)
            torch.cuda.synchronize(device)
            if time.perf_counter() >= t_end:
                break


def _timed_steps(step: _CheckedStep, job: Job, device) -> tuple[list[float], list[float], list[float]]:
    """The job's timed steps after a barrier: (durations, host probes, start times)."""
    import torch
    import torch.distributed as dist

    probe = None
    if job.probe and device.type == "cpu":
        probe = RunProbe()
    dist.barrier()
    times, probes, starts = [], [], []
    for i in range(job.steps):
        if probe is not None:  # untimed, by rank 0 alone; the ranks leave it together
            probes.append(probe())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        step(job.warmup + i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        starts.append(t)
    return times, probes, starts


def _reference_grads(wl, global_batch: int, seed: int):
    """Single-process full-batch gradient: of the mean per-sample loss over the global batch, or of
    a batch-coupled workload's loss (InfoNCE) over the whole global batch at once."""
    import torch

    torch.manual_seed(0)
    model = wl.model()
    x, y = wl.make_batch(global_batch, seed)
    wl.full_batch_loss(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def classify(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (EmulatedOutOfMemoryError, MemoryError)) or "out of memory" in text.lower():
        return "oom"
    if isinstance(exc, FloatingPointError):
        return "nonfinite"
    return "error"


def run_rank(job_file: str, build_executor: BuildExecutor) -> int:
    """Run the job file on this rank with `build_executor`, write rank{R}.json and leave the process
    group; returns the rank's exit code (0 ok, 3 failed: the rank file says why)."""
    die_with_parent(signal.SIGKILL)  # a worker whose launcher is gone has no one to report to
    job = from_dict(Job, json.loads(Path(job_file).read_text()))
    rank = int(os.environ.get("RANK", "0"))
    out = Path(job.out_dir) / f"rank{rank}.json"
    try:
        res = run_job(job, build_executor)
    except BaseException as e:  # every failure is reported as data, then the rank exits non-zero
        tail = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-2000:]
        res = RankResult(rank=rank, status=classify(e), error=f"{type(e).__name__}: {e}\n{tail}",
                         failed_at_s=time.time())
    dump_json(res, out)
    sys.stdout.flush()
    sys.stderr.flush()
    if res.status != "ok":
        return 3
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # results are written; teardown problems do not change them
        pass
    return 0


def main(argv: list[str], build_executor: BuildExecutor) -> int:
    """Run the job file argv[0] on this rank (`run_rank`) and exit with its code."""
    os._exit(run_rank(argv[0], build_executor))  # skip interpreter teardown: gloo can abort there after all work is done


def summarize_steps(results: list[RankResult], ref_probe_s: float = 0.0) -> tuple[float, tuple[float, ...]]:
    """The step time of a run (the slowest rank's median step) and each rank's median; with
    `ref_probe_s`, every step is first expressed at that host speed, by the ranks' mean probe of
    that step (hetsim.profiling.hostspeed.shared_probes; raw when a rank was not probed)."""
    ranks = [r for r in results if r.step_s]
    probes = shared_probes([r.probe_s for r in ranks])
    meds = tuple(statistics.median(at_ref(r.step_s, probes, ref_probe_s)) for r in ranks)
    return (max(meds) if meds else float("nan")), meds


__all__ = ["BuildExecutor", "Fault", "Job", "RankEnv", "RankResult", "main", "run_job", "run_rank", "summarize_steps", "to_dict"]
