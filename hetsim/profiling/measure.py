"""Measurements: device microbenchmarks and per-block model profiles (one process, one thread).

The collective profile needs the real process group and is measured by the
worker (`hetsim.execution.worker`, task 'commbench').
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hetsim.model.costmodel import LOW_PRECISION_SKIP
from hetsim.profiling.hostspeed import ELASTICITY, HostProbe, at_ref, ref_of
from hetsim.profiling.memcal import profile_memory
from hetsim.profiling.precision import screen_precisions
from hetsim.profiling.saved import saved_ends, saved_storages, storage_ids
from hetsim.profiling.store import (
    BlockProfile,
    BlockTiming,
    DeviceProfile,
    ModelProfile,
    trainable_flags,
)
from hetsim.types import Fit
from hetsim.workloads.builtin import PROFILED_OPTIMIZERS, Workload, make_optimizer
from hetsim.workloads.precision import autocast

FORMAT = "9"
"""Part of every profile's fingerprint: bump it when a measured field changes meaning (what is timed,
how, in which unit), so that recorded profiles are measured again.  A new field with a default needs
no bump unless a profile without it would be used wrongly.  2: the memory calibration on GPUs no
longer counts tensors alive before the step, and profiles gained the gradient cosine per precision
(without it a precision's numerics go unchecked) and the host optimizer step.  3: CPU timings are
kept at the host speed of the profile's probe (hetsim.profiling.hostspeed), calibration runs included.
4: model profiles record their timing spread (`ModelProfile.timing_spread`); format-3 files still load,
with the spread unknown, but the main job measures them again so that its predictions get an interval
from this machine's spread.  5: block timings keep their measured points (`Fit.measured`) and are
interpolated between them instead of read off one line; format-4 files still load (as lines).  6: blocks
record the activation gradients a zero-bubble schedule keeps between a stage's input and weight backward
(`BlockProfile.split_grad_bytes_per_sample`); without them such a pipeline's memory is under-predicted.
Every point is timed in interleaved rounds and `ModelProfile.timing_spread` is the whole model's spread
across them (before: across three timings in a row, which missed the host's slow phases).  7: a warm-up
round is timed first and dropped (`_Measured.forget_warm_up`): single blocks read up to 4.5x their
training-step time in it.  8: blocks are also timed at sizes where the whole model's time is not linear
between the requested ones (`_refine_sizes`), and a real drop in time is kept (`Fit.measured`).
9: times are normalised as t x (ref / p)^ELASTICITY, not t x ref / p (hetsim.profiling.hostspeed;
`ModelProfile.probe_elasticity`); format-8 files still load, at an exponent of 1."""


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_fingerprint(kind: str, device: torch.device) -> dict[str, str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    fp = {"kind": kind, "device": name, "torch": torch.__version__.split("+")[0], "format": FORMAT}
    if device.type == "cuda":
        fp["driver"] = str(torch.version.cuda)
    else:
        fp["threads"] = "1"
    return fp


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t)
    return ts


def _median_time(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 1) -> float:
    return statistics.median(_times(fn, device, reps, warmup))


def rel_mad(ts: list[float]) -> float:
    """Relative median absolute deviation of repeated timings: median |t - median| / median."""
    mid = statistics.median(ts)
    return statistics.median(abs(t - mid) for t in ts) / mid if mid > 0 else 0.0


# ----------------------------------------------------------------------------- device


def profile_device(kind: str, device: torch.device) -> DeviceProfile:
    n = 1024 if device.type == "cpu" else 8192
    flops = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = _median_time(lambda a=a, b=b: a @ b, device, reps=3)
        flops[name] = 2 * n**3 / t
    src = torch.empty(64 * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), device, reps=5)
    copy_bps = 2 * src.numel() * 4 / t
    host_bps = 0.0
    if device.type == "cuda":
        h = torch.empty(src.numel(), pin_memory=True)
        t = _median_time(lambda: src.copy_(h, non_blocking=True), device, reps=5)
        host_bps = h.numel() * 4 / t
    tiny = torch.zeros(1, device=device)
    launch = _median_time(lambda: tiny.add_(1), device, reps=50)
    return DeviceProfile(
        kind=kind,
        fingerprint=device_fingerprint(kind, device),
        matmul_flops=flops,
        copy_bps=copy_bps,
        host_link_bps=host_bps,
        launch_overhead_s=launch,
    )


# ----------------------------------------------------------------------------- model


def _saved_bytes(fn: Callable[[], torch.Tensor], exclude: set[int]) -> tuple[torch.Tensor, int]:
    """Run fn and count the distinct storages autograd saved for backward (`exclude`: the parameters'
    `storage_ids`)."""
    with saved_storages(exclude) as seen:
        out = fn()
    return out, sum(seen.values())


def _split_grad_bytes(outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None, inp: torch.Tensor,
                      params: list[nn.Parameter]) -> int:
    """Bytes of the activation gradients a zero-bubble schedule keeps from a stage's input backward (I)
    to its weight backward (W): torch's own `stage_backward_input` run on the block, its parameter
    groups' captured gradients counted once per storage.  0 where this torch lacks it."""
    try:
        from torch.distributed.pipelining._backward import stage_backward_input
    except ImportError:  # pragma: no cover - torch without distributed
        return 0
    if not params or not inp.requires_grad:
        return 0
    try:
        _, groups = stage_backward_input(outputs, output_grads, [inp], iter(params))
    except (RuntimeError, TypeError, ValueError):  # a block torch's split backward cannot take: none kept
        return 0
    seen: dict[int, int] = {}
    for group in groups:
        for grads in group.get("grads") or ():
            for g in grads or ():
                if isinstance(g, torch.Tensor):
                    seen.setdefault(g.untyped_storage().data_ptr(), g.untyped_storage().nbytes())
    return sum(seen.values())


@dataclass
class _Measured:
    """What `profile_model` times and counts, gathered over its precisions and micro-batches."""

    workload: Workload
    device: torch.device
    blocks: list[tuple[str, nn.Module]]
    param_storages: set[int]
    probe: HostProbe | None
    """On a CPU every timing is taken beside a host-speed probe and kept at the profile's reference
    speed (hetsim.profiling.hostspeed): the host's slow and fast phases would otherwise bend the fits."""
    times: dict[str, list[dict[int, list[tuple[float, float, float, float]]]]]
    """Per precision, per block, per micro-batch size: (forward, backward, probe, forward without
    autograd), one per round."""
    acts: dict[str, list[list[float]]]
    split_grads: dict[str, list[float]]
    """Per precision, per block: `_split_grad_bytes` per sample, at the first micro-batch."""
    out_bytes: list[int]
    flops: list[float]
    fulls: list[tuple[float, float, int]] = field(default_factory=list)
    """Whole-model time, its probe, its micro-batch size (one per round)."""
    probes: list[float] = field(default_factory=list)
    round: int = 0
    """The round being measured: every point is timed once per round, the rounds interleaved; round 0
    is the warm-up round, whose timings are dropped (`forget_warm_up`)."""
    input_bytes: int = 0
    ref: float = 0.0
    """The reference probe time (set once everything is measured)."""

    @property
    def warmup(self) -> int:
        """A warm-up call before a timing in the first round only (later rounds find it warm)."""
        return 1 if self.round == 0 else 0

    def probed(self, fn: Callable[[], object]) -> tuple[list[float], float]:
        """One timing of fn and the host probe taken just before it."""
        p = self.probe() if self.probe is not None else 0.0
        self.probes.append(p)
        return _times(fn, self.device, 1, self.warmup), p

    def forget_warm_up(self, precisions: tuple[str, ...]) -> None:
        """Drop the warm-up round's timings of `precisions` (timed again in the rounds that follow) and
        of the whole model: round 0 pays what a process pays once (the heap growing to its peak, oneDNN
        creating each shape's kernels), which no training step sees.  bert@tiny@64, 2026-12-05, three
        rounds: the head's fp32 backward at 31 samples read 110.5, 25.5, 24.6 ms in one profile and a
        median of 69.3 ms in a main job's (a training step: 24.4 ms); resnet18@64's blocks at 2 samples
        summed to 55-57 ms in round 0 against 29-36 ms in the next two rounds."""
        for prec in precisions:
            for per_mb in self.times[prec]:
                for ts in per_mb.values():
                    del ts[:1]
        self.fulls.clear()

    def point(self, prec: str, k: int, mb: int) -> tuple[float, float, float]:
        """Block k's (forward, backward, forward without autograd) at micro-batch mb: the median over
        the rounds of each timing at the reference host speed."""
        ts = self.times[prec][k][mb]
        return tuple(statistics.median(self.at(t[i], t[2]) for t in ts) for i in (0, 1, 3))

    def at(self, t: float, p: float) -> float:
        """Time t, taken beside probe p, at the reference host speed."""
        return at_ref([t], [p], self.ref)[0]


def script_params(block: torch.nn.Module) -> int:
    """Parameters of `block` that TorchScript modules hold (`BlockProfile.script_params`)."""
    return len({id(p) for m in block.modules() if isinstance(m, torch.jit.ScriptModule) for p in m.parameters()})


def profile_model(
    workload: Workload,
    kind: str,
    device: torch.device,
    micro_batches: tuple[int, ...],
    precisions: tuple[str, ...] = ("fp32",),
    reps: int = 3,
    progress: Callable[[str], None] | None = None,
) -> ModelProfile:
    """Forward/backward time of every block at several micro-batch sizes, kept piecewise (`Fit.measured`);
    parameter, activation and output bytes; optimizer step time vs parameter count.

    Every point is timed `reps` times in interleaved rounds (each round over every precision and
    micro-batch size, every other round in reverse order), after a warm-up round whose timings are
    dropped (`_Measured.forget_warm_up`), and the median kept: this host slows down
    for 10-60 s at a time, and three timings in a row fell into one slow phase together (two
    recordings back to back disagreed by up to 65 % on single blocks).  The whole model's timings
    across the rounds give the profile's spread.  A low precision far slower than fp32 in the warm-up
    round is timed in that round only, and its timings there are kept (`_worth_more_rounds`)."""
    cosines, floors, failed, timed = screen_precisions(workload, kind, device, precisions, min(16, max(micro_batches)),
                                               progress)
    model = workload.model().to(device)
    blocks = list(model.named_children())
    m = _Measured(
        workload=workload, device=device, blocks=blocks,
        param_storages=storage_ids(model.parameters()),
        probe=HostProbe() if device.type == "cpu" else None,
        times={p: [{} for _ in blocks] for p in timed}, acts={p: [[] for _ in blocks] for p in timed},
        split_grads={p: [0.0] * len(blocks) for p in timed},
        out_bytes=[0] * len(blocks), flops=[0.0] * len(blocks),
    )
    rounds = max(1, reps)
    per_round = timed
    for r in range(rounds + 1):  # round 0 warms up: its timings are dropped (`_Measured.forget_warm_up`)
        m.round = r
        if r == 1:
            per_round = _worth_more_rounds(m, micro_batches, timed, progress)
            m.forget_warm_up(per_round)
        for prec in per_round:
            for mb in (micro_batches if r % 2 == 0 else tuple(reversed(micro_batches))):
                if progress:
                    progress(f"profiling {workload.name} {prec} micro-batch {mb}"
                             + (" (warm-up round)" if r == 0 else f" (round {r}/{rounds})"))
                _measure_micro_batch(m, model, prec, mb, first=r == 0 and mb == micro_batches[0])
    m.ref = ref_of(m.probes)  # provisional: `_refine_sizes` compares points at it
    _refine_sizes(m, model, per_round, tuple(micro_batches), rounds, progress)
    m.ref = ref_of(m.probes)
    overhead = [max(0.0, m.at(full, p) - sum(sum(m.point("fp32", k, mb)[:2]) for k in range(len(blocks))))
                for full, p, mb in m.fulls]
    by_mb = [[m.at(full, p) for full, p, j in m.fulls if j == mb] for mb in micro_batches]
    spreads = [rel_mad(ts) for ts in by_mb if len(ts) > 1]
    bps = _block_profiles(m, micro_batches, timed, _out_itemsizes(m, model, timed), _saved_ends(m, timed))
    opt_fits = _optimizer_fits(model, device, reps, m.probe, m.ref)
    host_fits: dict[str, Fit] = {}
    if device.type != "cpu":  # CPU offload steps the optimizer on the host: measured there too
        host_fits = _optimizer_fits(workload.model(), torch.device("cpu"), reps)
    fp = device_fingerprint(kind, device)
    fp.update({"model": workload.spec, "micro_batches": ",".join(map(str, micro_batches)), "precisions": ",".join(precisions)})
    return ModelProfile(
        model=workload.spec,
        device_kind=kind,
        fingerprint=fp,
        micro_batches=tuple(micro_batches),
        blocks=tuple(bps),
        opt_step_s=opt_fits,
        grad_cosine=cosines,
        grad_cosine_floor=floors,
        precision_failed=failed,
        host_opt_step_s=host_fits,
        step_overhead_s=statistics.median(overhead) if overhead else 0.0,
        probe_s=m.ref,
        probe_elasticity=ELASTICITY if m.ref else 1.0,
        timing_spread=statistics.median(spreads) if spreads else None,
        input_bytes_per_sample=m.input_bytes,
        memory=profile_memory(workload, device, micro_batches, timed),
    )


REFINE_TOL = 0.1
"""A size between two profiled ones is timed as well where the whole model's time there (blocks'
forward and backward) is off the line between its neighbours by more than this fraction."""
REFINE_CHECKS = 8
"""At most this many sizes checked per precision (each check: a warm-up pass and a timed one)."""


def _refine_sizes(m: _Measured, model: nn.Module, precisions: tuple[str, ...], sizes: tuple[int, ...], reps: int,
                  progress: Callable[[str], None] | None) -> None:
    """Time every block at more micro-batch sizes where time is not linear in the batch: the midpoint
    of two neighbouring sizes is timed once (after a warm-up pass at that new shape); where the whole
    model's time there is off the line between them by more than `REFINE_TOL`, it is timed `reps`
    times like every other point and both halves are checked in turn; else that timing is dropped.

    Why: oneDNN picks its convolution kernels by the batch.  resnet50@64 fp32 (AMD EPYC, torch 2.14,
    one thread), a training step: 0.32 s at 8 samples, 0.45 at 12, 0.55 at 15 and 0.28 at 16.
    Profiled at 2, 8, 16 and 31 only, a device given 10 or 12 samples was predicted 30-40 % fast."""
    for prec in precisions:
        todo, checks = list(zip(sizes, sizes[1:])), 0
        while todo and checks < REFINE_CHECKS:
            a, b = todo.pop(0)
            mid = (a + b) // 2
            if mid in (a, b) or mid in m.times[prec][0]:
                continue
            checks += 1
            if progress:
                progress(f"profiling {m.workload.name} {prec} micro-batch {mid} (is time linear between {a} and {b}?)")
            _measure_micro_batch(m, model, prec, mid, first=False)  # creates the new shape's kernels
            _forget_last(m, prec, mid)
            _measure_micro_batch(m, model, prec, mid, first=False)
            total = {x: sum(sum(m.point(prec, k, x)[:2]) for k in range(len(m.blocks))) for x in (a, mid, b)}
            line = total[a] + (total[b] - total[a]) * (mid - a) / (b - a)
            if abs(total[mid] / line - 1) <= REFINE_TOL:
                _forget_last(m, prec, mid)
                continue
            for _ in range(reps - 1):
                _measure_micro_batch(m, model, prec, mid, first=False)
            todo += [(a, mid), (mid, b)]


def _forget_last(m: _Measured, prec: str, mb: int) -> None:
    """Drop the last timing of every block at (prec, mb), and the whole model's if it was timed."""
    for per_mb in m.times[prec]:
        per_mb[mb].pop()
        if not per_mb[mb]:
            del per_mb[mb]
    if prec == "fp32" and m.fulls and m.fulls[-1][2] == mb:
        m.fulls.pop()


def _worth_more_rounds(m: _Measured, micro_batches: tuple[int, ...], timed: tuple[str, ...],
                       progress: Callable[[str], None] | None) -> tuple[str, ...]:
    """`timed` less the low precisions whose blocks took more than `LOW_PRECISION_SKIP` times fp32's in
    the warm-up round (forward and backward, largest micro-batch): their plans lose to fp32's by far, so
    one round of timings serves (gpt@tiny@64's bf16 on a CPU without bf16 arithmetic: 10.9x, and 52 of
    66 profiling seconds at three rounds)."""
    mb = max(micro_batches)

    def total(p: str) -> float:
        return sum(ts[mb][0][0] + ts[mb][0][1] for ts in m.times[p])

    base = total("fp32") if "fp32" in timed else 0.0
    keep = []
    for p in timed:
        slower = total(p) / base if p != "fp32" and base > 0 else 1.0
        if slower > LOW_PRECISION_SKIP:
            if progress:
                progress(f"timing {m.workload.name} in {p} once: its blocks took {slower:.1f}x their fp32 time "
                         f"in the first round, so its plans lose to fp32's by far")
        else:
            keep.append(p)
    return tuple(keep)


def _measure_micro_batch(m: _Measured, model: nn.Module, prec: str, mb: int, first: bool) -> None:
    """Time every block, then (fp32) the whole model, on one batch of `mb` samples under `prec`;
    `first`: the first micro-batch size, whose fp32 pass also records output bytes and FLOPs."""
    x, y = m.workload.make_batch(mb, 123)
    x, y = x.to(m.device), y.to(m.device)
    m.input_bytes = x[:1].nelement() * x.element_size()
    h = x
    for k in range(len(m.blocks)):
        h = _measure_block(m, k, h, y, prec, mb, record=prec == "fp32" and first, split=first)
    if prec == "fp32":
        ts, p = m.probed(lambda: m.workload.loss_sum(model(x), y).backward())
        m.fulls.append((statistics.median(ts), p, mb))
    model.zero_grad(set_to_none=True)


def _measure_block(m: _Measured, k: int, h: torch.Tensor, y: torch.Tensor, prec: str, mb: int,
                   record: bool, split: bool = False) -> torch.Tensor:
    """Forward and backward time and saved bytes of block k on input h (`record`: its output bytes and
    FLOPs too; `split`: its zero-bubble activation gradients); returns the block's output, the next
    block's input."""
    blk = m.blocks[k][1]
    device = m.device
    inp = h.detach().requires_grad_(k > 0 and h.is_floating_point())
    with autocast(device, prec):
        out, saved = _saved_bytes(lambda: blk(inp), m.param_storages)
    if k == len(m.blocks) - 1:
        def make_loss():
            with autocast(device, prec):
                o = blk(inp)
            return m.workload.loss_sum(o.float(), y)
    else:
        make_loss = None
    grad = torch.randn_like(out)

    def fwd():
        with torch.no_grad(), autocast(device, prec):
            return blk(inp)

    def fwd_bwd():
        if make_loss is not None:
            make_loss().backward()
        else:
            with autocast(device, prec):
                o = blk(inp)
            o.backward(grad)

    # Forward with autograd recording (as in training) for the fwd time.
    def fwd_train():
        with autocast(device, prec):
            return blk(inp)

    tfs, p = m.probed(fwd_train)
    tf = statistics.median(tfs)
    tfb = _median_time(fwd_bwd, device, 1, m.warmup)
    tn = _median_time(fwd, device, 1, m.warmup)
    m.times[prec][k].setdefault(mb, []).append((tf, max(tfb - tf, 0.0), p, tn))
    if m.round == 0:
        m.acts[prec][k].append(float(saved))
    if record:
        m.out_bytes[k] = out[:1].nelement() * 4 if out.dim() > 0 else 4
        m.flops[k] = _flops(fwd, mb)
    nxt = fwd().float() if out.is_floating_point() else fwd()
    if split and k == 0 and h.is_floating_point():
        # The first block's input needs no gradient in training; here it does, so that its internal
        # activation gradients are counted as every other block's (`rank_memory`'s backward sweep).
        inp = h.detach().requires_grad_(True)
        with autocast(device, prec):
            out = blk(inp)
    if split and out.requires_grad:  # last: uses (and detaches) the graph of the counted forward
        outputs = [m.workload.loss_sum(out.float(), y)] if make_loss is not None else [out]
        grads = None if make_loss is not None else [grad]
        m.split_grads[prec][k] = _split_grad_bytes(outputs, grads, inp, list(blk.parameters())) / mb
    return nxt


def _out_itemsizes(m: _Measured, model: nn.Module, precisions: tuple[str, ...]) -> dict[str, list[int]]:
    """Per precision, the element size of each block's output with the blocks chained as in training
    under that precision's autocast.  The timings feed every block an fp32 input, whose residual add
    would promote a bf16 block's output to fp32; inside the model a conv net's blocks pass bf16 on."""
    x, _ = m.workload.make_batch(2, 123)
    sizes = {}
    with torch.no_grad():
        for prec in precisions:
            h, row = x.to(m.device), []
            with autocast(m.device, prec):
                for _, blk in m.blocks:
                    h = blk(h)
                    row.append(h.element_size() if h.is_floating_point() else 4)
            sizes[prec] = row
    return sizes


def _saved_ends(m: _Measured, precisions: tuple[str, ...]) -> dict[str, list[tuple[bool, bool]]]:
    """Per precision, `saved_ends` of the blocks chained under that precision's autocast."""
    x, _ = m.workload.make_batch(2, 123)
    ends = {}
    for prec in precisions:
        with autocast(m.device, prec):
            ends[prec] = saved_ends([blk for _, blk in m.blocks], x.to(m.device), m.param_storages)
    return ends


def _block_profiles(m: _Measured, micro_batches: tuple[int, ...], precisions: tuple[str, ...],
                    out_itemsize: dict[str, list[int]], ends: dict[str, list[tuple[bool, bool]]]) -> list[BlockProfile]:
    """Each block's sizes, its timings through the measured points (`Fit.measured`) and its activation
    bytes fitted linearly in the micro-batch."""
    bps = []
    for k, (name, blk) in enumerate(m.blocks):
        pc = sum(p.numel() for p in blk.parameters())
        bps.append(
            BlockProfile(
                name=name,
                param_count=pc,
                param_bytes=sum(p.numel() * p.element_size() for p in blk.parameters()),
                buffer_bytes=sum(b.numel() * b.element_size() for b in blk.buffers()),
                timing={p: _timing(m, p, k) for p in precisions},
                act_bytes={p: Fit.least_squares(list(micro_batches), m.acts[p][k]) for p in precisions},
                out_bytes_per_sample=m.out_bytes[k],
                flops_per_sample=m.flops[k],
                param_numels=tuple(p.numel() for p in blk.parameters()),
                param_trainable=trainable_flags(blk),
                scalar_params=sum(p.dim() == 0 for p in blk.parameters()),
                script_params=script_params(blk),
                split_grad_bytes_per_sample={p: m.split_grads[p][k] for p in precisions},
                out_itemsize={p: out_itemsize[p][k] for p in precisions},
                saves_input={p: ends[p][k][0] for p in precisions},
                saves_output={p: ends[p][k][1] for p in precisions},
            )
        )
    return bps


def _timing(m: _Measured, prec: str, k: int) -> BlockTiming:
    """Block k's timings through every size it was timed at (the profile's and `_refine_sizes`')."""
    xs = sorted(m.times[prec][k])
    pts = [m.point(prec, k, x) for x in xs]
    fwd, bwd, nograd = (Fit.measured(list(xs), [p[i] for p in pts]) for i in range(3))
    return BlockTiming(fwd_s=fwd, bwd_s=bwd, nograd_fwd_s=nograd)


def _optimizer_fits(model: nn.Module, device: torch.device, reps: int, probe: HostProbe | None = None,
                    ref: float = 0.0) -> dict[str, Fit]:
    """`_profile_optimizer` for every profiled optimizer; adam shares adamw's fit."""
    fits = {name: _profile_optimizer(model, name, device, reps, probe, ref) for name in PROFILED_OPTIMIZERS}
    fits["adam"] = fits["adamw"]
    return fits


def _cpu_attention_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q, k, v)


def _flops(fwd: Callable[[], object], mb: int) -> float:
    """Forward FLOPs per sample.  torch's counter has no formula for the CPU kernel of
    scaled_dot_product_attention (it counts 0): attention's q·k and p·v FLOPs are added for it."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        extra = {}
        cpu_sdpa = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if cpu_sdpa is not None:
            extra[cpu_sdpa] = _cpu_attention_flops
        with FlopCounterMode(display=False, custom_mapping=extra) as fc:
            fwd()
        return fc.get_total_flops() / mb
    except Exception:  # FLOPs are informative only
        return 0.0


def _profile_optimizer(model: nn.Module, kind: str, device: torch.device, reps: int, probe: HostProbe | None = None,
                       ref: float = 0.0) -> Fit:
    """Optimizer step time per block's parameters, fitted against parameter count (with `probe`,
    each time at the host speed whose probe time is `ref`).  Only parameters that require a gradient,
    as in training: the cost model asks for the step of the trainable ones (frozen ones get no step)."""
    xs, ys = [], []
    groups = [[p for p in b.parameters() if p.requires_grad] for b in model.children()]
    groups.append([p for p in model.parameters() if p.requires_grad])
    for params in groups:
        if not params:
            continue
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make_optimizer(kind, params, 1e-3)
        opt.step()  # lazily creates the state
        xs.append(float(sum(p.numel() for p in params)))
        p = probe() if probe is not None else 0.0
        ys.append(at_ref([_median_time(opt.step, device, reps, warmup=0)], [p], ref)[0])
    for p in model.parameters():
        p.grad = None
    return Fit.least_squares(xs, ys)
