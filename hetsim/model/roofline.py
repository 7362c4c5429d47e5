"""Block times of a GPU nobody measured here: a per-operator roofline over the traced shapes.

Each aten operator of a block's forward or backward (hetsim.profiling.shapes) takes

    max(FLOPs / (peak of the math it uses x e_math), bytes / (memory bandwidth x e_mem), t_launch)

- **The math it uses** is what PyTorch picks by default: in fp32, convolutions run on TF32 tensor
  cores from Ampere on (`torch.backends.cudnn.allow_tf32` defaults to True) while matmuls and
  attention stay on FP32 CUDA cores (`torch.backends.cuda.matmul.allow_tf32` defaults to False);
  under fp16/bf16 autocast both run on FP16/BF16 tensor cores (cc >= 7.0; bf16 from 8.0) with
  FP32 accumulation (the datasheet rate a GeForce card halves on a chip fed for the full rate,
  `tensor_share`); everything else (normalisation,
  activations, adds, casts, gradient accumulation) is bandwidth-bound.  Low precision moves a
  fitted fraction of fp32's per-sample bytes; weights are read at fp32 and cast.  Math runs at a
  sustained clock between the datasheet's base and boost clocks.  Memory-bound kernels stream at a
  fitted share of the DRAM bandwidth, at most a fitted number of bytes per SM per boost cycle
  (`mem_rate`): on the largest HBM parts the SMs, not the DRAM, bound them.  A 3x3 stride-1 convolution on
  the FP32 CUDA cores runs as cuDNN's Winograd, faster than its FLOPs say by a fitted gain.
- **Efficiencies** are nine constants, `EFFICIENCY`, fitted on the published rows of six GPUs and
  validated on the other GPUs' rows (README, "What-if on GPUs you don't own"); `t_launch` is a floor
  per operator: eager PyTorch cannot issue kernels faster than its dispatcher.
- **The optimizer step** streams its state at the sustained bandwidth (`optimizer_fit`); an Adam written
  as a Python loop over tensors (the published BERT-large fp32 rows' BertAdam) pays a dispatch floor
  for each of its unfused operators (`loop_adam_s`).

Nothing here imports torch: it is the simulation side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetsim.hardware.cluster import Device


@dataclass(frozen=True, slots=True)
class OpCost:
    """One operator of one pass: `kind` is 'conv', 'conv3x3' (a 3x3 stride-1 ungrouped convolution,
    which cuDNN can run as Winograd), 'matmul', 'attn' (math units) or 'mem' (bandwidth).
    FLOPs scale with the micro-batch; bytes are a fixed part (weights) plus a per-sample part."""

    kind: str
    flops_per_sample: float
    bytes_fixed: float
    bytes_per_sample: float


@dataclass(frozen=True, slots=True)
class BlockShapes:
    """A block's operators per pass, its parameters and what it keeps for backward (fp32)."""

    name: str
    fwd: tuple[OpCost, ...]
    bwd: tuple[OpCost, ...]
    param_count: int
    param_bytes: int
    buffer_bytes: int
    param_numels: tuple[int, ...]
    saved_bytes_per_sample: float
    saved_bytes_fixed: float
    out_bytes_per_sample: int
    param_trainable: tuple[bool, ...] = ()
    """Per entry of `param_numels`, whether it requires a gradient; empty: every parameter trains."""

    def flops(self, mb: float) -> float:
        return sum(o.flops_per_sample for o in self.fwd + self.bwd) * mb


@dataclass(frozen=True, slots=True)
class ModelShapes:
    model: str
    blocks: tuple[BlockShapes, ...]
    input_bytes_per_sample: int
    whole_saved_per_sample: float = 0.0
    """Distinct bytes the whole model saves for backward per sample (adjacent blocks share a tensor)."""
    fingerprint: dict[str, str] = field(default_factory=dict)
    """What the trace is valid for (model spec, torch version, tracer format) when kept on disk."""

    @property
    def param_tensors(self) -> int:
        return sum(len(b.param_numels) for b in self.blocks)


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of datasheet peaks that eager PyTorch training sustains, and per-kernel floors."""

    tensor: float
    """Of the TF32/FP16/BF16 tensor-core rate (convolutions and matmuls)."""
    simt: float
    """Of the FP32 CUDA-core rate."""
    mem: float
    """Of the DRAM bandwidth (STREAM-like kernels reach 80-90 %; multi-pass kernels such as BatchNorm's
    read their input more than once, which this fraction absorbs)."""
    low_bytes: float = 0.6
    """Per-sample bytes under fp16/bf16 autocast as a fraction of fp32's: activations halve, but
    normalisation statistics, softmax, the loss and master gradients stay fp32 and autocast adds casts."""
    clock: float = 0.0
    """Where between base (0) and boost (1) clock the math runs under sustained load.  The base clock
    is what a GPU guarantees at its power limit under heavy load (the A10's 885 of 1695 MHz at 150 W);
    the fit puts sustained training there."""
    launch_s: float = 30e-6
    """Least time per aten operator: eager PyTorch's dispatch (with autograd) on the host.  The H200
    profile in results/gpu/h200 shows 31 us per forward and 42 us per backward operator as the
    batch-independent part of resnet50's block times; hidden at large batches on any GPU."""
    winograd: float = 1.0
    """How much faster than its FLOPs at the FP32 CUDA-core rate a 3x3 stride-1 convolution runs
    where no tensor core takes it (fp32 before Ampere): cuDNN's Winograd kernels do 2.25-4x fewer
    multiplications for this shape (F(2x2,3x3) and F(4x4,3x3)) and pay input/output transforms."""
    turing: float = 1.0
    """What Turing's tensor cores (compute capability 7.5: RTX 20xx, TITAN RTX, Quadro RTX) sustain of
    the tensor share the other generations do.  In Lambda's tables every Turing GPU read fast in fp16
    with 1 (BERT-large +18 to +33 %, ResNet-50 +8 to +12 %, five GPUs) while Volta and Ampere did not;
    fitted with the rest (`hetsim.reporting.whatif.fit`), on the one Turing GPU of the fit."""
    opt_tensor_s: float = 30e-6
    """Per parameter tensor of the single-tensor (foreach=False) Adam/AdamW step: about ten kernels
    each (the H200 profile in results/gpu/h200 measured 0.25 ms + 0.41 ns/parameter for
    resnet50's 161 tensors, about 65 us a tensor with its Python; half of it on faster hosts)."""
    loop_op_s: float = 10e-6
    """Least time per elementwise operator of an Adam written as a Python loop over tensors
    (`LOOP_ADAM_OPS` of them a tensor; NVIDIA's BertAdam, which the published BERT-large fp32 rows ran):
    the host's dispatch of each, exposed because the step starts after a `.item()` sync.  Fitted with
    the rest (`hetsim.reporting.whatif.fit`)."""
    sm_bytes: float = 0.0
    """Bytes a streaming multiprocessor moves per boost-clock cycle in memory-bound kernels, at most: the
    DRAM rate those kernels sustain is the lesser of `mem` x bandwidth and sm_bytes x SMs x boost clock
    (`mem_rate`; 0: no such cap).  Little's law: a kernel keeps only so many loads in flight per SM, so
    the bandwidth it reaches grows with the SMs and their clock, not with the DRAM behind them.  This is
    why an H200 (the H100's 132 SMs, 1.43x its bandwidth) trained ResNet-50 in fp16 1.10x as fast as the
    H100 SXM in Lambda's v2 tables, not 1.4x.  At the boost clock: memory-bound kernels do not draw the
    power that pulls math down towards the base clock.  Fitted with the rest."""


EFFICIENCY = Efficiency(tensor=0.55, simt=0.85, mem=0.6, low_bytes=0.5, clock=0.0, winograd=3.5, turing=0.8,
                        loop_op_s=5e-6, sm_bytes=7.0)
"""Fitted (grid search, `python -m hetsim.reporting.whatif --fit`) on the published rows of six GPUs
(`hetsim.reporting.whatif.FIT_GPUS`), validated on the other GPUs' rows; see README."""


CONV_KINDS = ("conv", "conv3x3")


def simt_rate(dev: Device, kind: str, eff: Efficiency = EFFICIENCY) -> float:
    """Sustainable FLOP/s of an operator on the FP32 CUDA cores (at boost clock), Winograd included."""
    return dev.peak_fp32_flops * eff.simt * (eff.winograd if kind == "conv3x3" else 1.0)


TF32X3 = 3
"""Tensor-core instructions per fp32 multiply in CUTLASS's 3xTF32 (`OpMultiplyAddFastF32`): each operand
split into a TF32 high and low part, three products kept.  PyTorch's memory-efficient attention runs its
fp32 kernels so from compute capability 8.0 on, whatever `allow_tf32` says."""


def math_rate(dev: Device, kind: str, precision: str, matmul_tf32: bool = False) -> tuple[float, str]:
    """(peak FLOP/s, unit) of the math PyTorch uses for this operator kind: 'tensor' (cuDNN/cuBLAS may
    still pick an FP32 kernel where that is faster), 'tf32x3' (tensor cores at a third of the TF32 rate,
    no other kernel) or 'simt'.  fp32 attention with TF32 matmuls allowed is the unfused bmm-softmax-bmm
    of the published benchmarks, so it runs as a TF32 matmul."""
    if precision == "fp32":
        tf32 = dev.peak_tf32_flops > 0
        if kind == "attn" and tf32 and not matmul_tf32:
            return dev.peak_tf32_flops / TF32X3, "tf32x3"
        tf32_ok = tf32 and (kind in CONV_KINDS or (matmul_tf32 and kind in ("matmul", "attn")))
        return (dev.peak_tf32_flops, "tensor") if tf32_ok else (dev.peak_fp32_flops, "simt")
    peak = dev.peak_bf16_flops if precision == "bf16" else dev.peak_fp16_flops
    if peak > dev.peak_fp32_flops:
        return peak, "tensor"
    return dev.peak_fp32_flops, "simt"


def tensor_share(e, feed: float):
    """Fraction of the datasheet tensor rate that kernels sustain, for a tensor efficiency `e` (a float, or
    an array of them: `hetsim.reporting.whatif.fit`) and a device's `Device.tensor_feed`.  A kernel's time is
    its math at the issue rate plus the stalls of feeding it, which a full-rate chip (feed 1) makes e of its
    peak: stalls cost 1/e - 1 of the math.  A GeForce card issues at half the rate of the same silicon
    (feed 2), fed as fast, so its stalls cost half as much against its own peak: 1 / (1 + (1/e - 1) / feed);
    0.75 of it at e = 0.6."""
    return 1.0 / (1.0 + (1.0 / e - 1.0) / feed)


def generation_factor(dev: Device, eff: Efficiency = EFFICIENCY) -> float:
    """The device generation's share of `tensor_share` (`Efficiency.turing`; 1 for the others)."""
    return eff.turing if dev.compute_capability == (7, 5) else 1.0


FP32_LANES_PER_SM = {(6, 0): 64, (7, 0): 64, (7, 5): 64, (8, 0): 64}
"""FP32 lanes per SM where a generation has 64 (GP100, Volta, Turing, GA100); the others have 128
(GP10x, GA10x, AD10x, Hopper; NVIDIA's architecture whitepapers)."""


def sm_cycles_per_s(dev: Device) -> float:
    """SMs x boost clock, from the FP32 peak: 2 FLOPs per lane per cycle."""
    return dev.peak_fp32_flops / (2 * FP32_LANES_PER_SM.get(dev.compute_capability, 128))


def mem_rate(dev: Device, eff: Efficiency = EFFICIENCY) -> float:
    """Bytes/s that memory-bound kernels sustain: `Efficiency.mem` of the DRAM bandwidth, capped at
    `Efficiency.sm_bytes` per SM per boost cycle (no cap where the device has no FP32 peak to count SMs by)."""
    rate = dev.mem_bw_bps * eff.mem
    cap = eff.sm_bytes * sm_cycles_per_s(dev)
    return min(rate, cap) if cap > 0 else rate


def clock_factor(dev: Device, eff: Efficiency = EFFICIENCY) -> float:
    """Sustained over boost clock: base + `eff.clock` x (boost - base), as a fraction of boost."""
    return dev.base_clock_ratio + eff.clock * (1.0 - dev.base_clock_ratio)


def op_time_s(op: OpCost, mb: float, dev: Device, precision: str, eff: Efficiency = EFFICIENCY,
              matmul_tf32: bool = False) -> float:
    low = precision != "fp32"
    nbytes = op.bytes_fixed + op.bytes_per_sample * mb * (eff.low_bytes if low else 1.0)
    t_mem = nbytes / mem_rate(dev, eff)
    t_math = 0.0
    if op.kind != "mem" and op.flops_per_sample > 0:
        peak, unit = math_rate(dev, op.kind, precision, matmul_tf32)
        flops = op.flops_per_sample * mb
        t_math = (flops / simt_rate(dev, op.kind, eff) if unit == "simt"
                  else flops / (peak * tensor_share(eff.tensor, dev.tensor_feed) * generation_factor(dev, eff)))
        if unit == "tensor" and precision == "fp32":  # cuDNN/cuBLAS pick the faster of TF32 and FP32 kernels
            t_math = min(t_math, flops / simt_rate(dev, op.kind, eff))
        t_math /= clock_factor(dev, eff)
    return max(t_math, t_mem, eff.launch_s)


def pass_time_s(ops: tuple[OpCost, ...], mb: float, dev: Device, precision: str, eff: Efficiency = EFFICIENCY,
                matmul_tf32: bool = False) -> float:
    return sum(op_time_s(o, mb, dev, precision, eff, matmul_tf32) for o in ops)


LOOP_ADAM_OPS = 12
"""Elementwise operators one parameter tensor costs in NVIDIA's BertAdam (a Python loop over tensors,
no fused kernel): two for each moment, a square root, an epsilon add and a divide for the update, two for
weight decay, one for the learning rate, and a negation and an add for the parameter.  (Its clipping,
two more, runs only when the global gradient norm exceeds 1; not counted.)"""
LOOP_ADAM_BYTES = 116.0 / LOOP_ADAM_OPS
"""fp32 bytes per parameter that one of those operators moves, on average: 116 over the twelve (each
reads one or two tensors and writes one)."""


def loop_adam_s(numels, dev: Device, eff: Efficiency = EFFICIENCY) -> float:
    """Seconds of a BertAdam step over tensors of these sizes: every operator the longer of its dispatch
    floor (`Efficiency.loop_op_s`) and its bytes at the sustained bandwidth."""
    bw = mem_rate(dev, eff)
    return LOOP_ADAM_OPS * sum(max(eff.loop_op_s, LOOP_ADAM_BYTES * n / bw) for n in numels)


def optimizer_fit(shapes: ModelShapes, dev: Device, optimizer: str, eff: Efficiency = EFFICIENCY) -> tuple[float, float]:
    """(intercept s, slope s/parameter) of the optimizer step: bandwidth for the state it streams
    (AdamW reads parameter, gradient and two moments and writes three: 28 B plus its temporaries,
    about 44 B a parameter; SGD with momentum about 20 B) and a per-tensor cost spread over the
    model's average tensor size.  'bert_adam' (`loop_adam_s`) is all slope: its time over the model's
    parameters."""
    n_params = sum(b.param_count for b in shapes.blocks)
    if optimizer == "bert_adam":
        return 0.0, loop_adam_s([n for b in shapes.blocks for n in b.param_numels], dev, eff) / max(1, n_params)
    share = {"adam": 1.0, "adamw": 1.0, "sgd": 0.4}.get(optimizer, 0.0)  # 'fused': one multi-tensor kernel
    per_tensor = eff.opt_tensor_s * share
    bytes_per_param = 20.0 if optimizer == "sgd" else 44.0 if share else 28.0
    slope = bytes_per_param / mem_rate(dev, eff) + per_tensor * shapes.param_tensors / max(1, n_params)
    return per_tensor, slope


def optimizer_s(shapes: ModelShapes, dev: Device, optimizer: str, eff: Efficiency = EFFICIENCY) -> float:
    """Seconds of one optimizer step over the whole model (`optimizer_fit` at its parameter count)."""
    a, b = optimizer_fit(shapes, dev, optimizer, eff)
    return a + b * sum(bl.param_count for bl in shapes.blocks)


def step_time_s(shapes: ModelShapes, dev: Device, mb: int, precision: str, optimizer: str = "adamw",
                eff: Efficiency = EFFICIENCY, matmul_tf32: bool = False) -> float:
    """One single-device training step at batch mb: every block's forward and backward, then the
    optimizer step (what a published images/s or sequences/s figure divides)."""
    t = sum(pass_time_s(b.fwd, mb, dev, precision, eff, matmul_tf32) + pass_time_s(b.bwd, mb, dev, precision, eff,
                                                                               matmul_tf32) for b in shapes.blocks)
    return t + optimizer_s(shapes, dev, optimizer, eff)


def throughput(shapes: ModelShapes, dev: Device, mb: int, precision: str, optimizer: str = "adamw",
               eff: Efficiency = EFFICIENCY, matmul_tf32: bool = False) -> float:
    """Samples per second of single-device training at batch mb."""
    return mb / step_time_s(shapes, dev, mb, precision, optimizer, eff, matmul_tf32)


# ----------------------------------------------------------------------------- catalog profiles

LOW_PRECISION_ACT = 0.5
"""Saved activations under fp16/bf16 autocast per sample, as a fraction of fp32 (the H200 profile
measured 43.8 MB against 85.9 MB a sample for resnet50@224), plus a 2-byte copy of every weight."""


def catalog_profile(shapes: ModelShapes, dev: Device, precisions: tuple[str, ...], micro_batches: tuple[int, ...],
                    fingerprint: dict[str, str], eff: Efficiency = EFFICIENCY):
    """A `ModelProfile` for a catalog GPU, every number from the roofline and the traced shapes:
    block times fitted over `micro_batches` per precision, saved activations, optimizer step."""
    from hetsim.profiling.store import BlockProfile, BlockTiming, MemoryCalibration, ModelProfile
    from hetsim.types import Fit

    precs = tuple(dict.fromkeys(("fp32",) + tuple(precisions)))
    xs = [float(m) for m in micro_batches]

    def fit(ops, prec):
        return Fit.least_squares(xs, [pass_time_s(ops, m, dev, prec, eff) for m in xs])

    def act(per: float, fixed: float, params: int, prec: str) -> Fit:
        if prec == "fp32":
            return Fit(intercept=fixed, slope=per)
        return Fit(intercept=fixed * LOW_PRECISION_ACT + 2 * params, slope=per * LOW_PRECISION_ACT)

    blocks = tuple(BlockProfile(
        name=b.name, param_count=b.param_count, param_bytes=b.param_bytes, buffer_bytes=b.buffer_bytes,
        timing={p: BlockTiming(fwd_s=fit(b.fwd, p), bwd_s=fit(b.bwd, p)) for p in precs},
        act_bytes={p: act(b.saved_bytes_per_sample, b.saved_bytes_fixed, b.param_count, p) for p in precs},
        out_bytes_per_sample=b.out_bytes_per_sample, flops_per_sample=sum(o.flops_per_sample for o in b.fwd),
        param_numels=b.param_numels, param_trainable=b.param_trainable) for b in shapes.blocks)
    n_params = sum(b.param_count for b in shapes.blocks)
    biggest = max((n for b in shapes.blocks for n in b.param_numels), default=0)
    widest = max((b.out_bytes_per_sample for b in shapes.blocks), default=0)
    # Temporaries at the backward peak, shaped after the H200 memory calibration of resnet50@224
    # (24.5 MB + 0.9 MB a sample): a few copies of the largest gradient and one activation gradient.
    temp = Fit(intercept=2.5 * 4 * biggest, slope=float(widest))
    memory = MemoryCalibration(
        saved_bytes={p: act(shapes.whole_saved_per_sample, 0.0, n_params, p) for p in precs},
        temp_bytes={p: temp for p in precs})
    opt = {}
    for name in ("adamw", "adam", "sgd"):
        a, b = optimizer_fit(shapes, dev, name, eff)
        opt[name] = Fit(intercept=a, slope=b)
    return ModelProfile(model=shapes.model, device_kind=dev.kind, fingerprint=fingerprint,
                        micro_batches=tuple(micro_batches), blocks=blocks, opt_step_s=opt,
                        input_bytes_per_sample=shapes.input_bytes_per_sample, memory=memory)
