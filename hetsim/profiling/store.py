"""Recorded profiles: what was measured, with the fingerprint it is valid for."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from hetsim.errors import ProfileCorruptError, ProfileMismatchError
from hetsim.serial import dump_json, from_dict
from hetsim.types import Fit

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockTiming:
    """Seconds on the reference device as a function of micro-batch size."""

    fwd_s: Fit
    bwd_s: Fit
    nograd_fwd_s: Fit | None = None
    """Forward without autograd recording (the gradient cache's first pass: nothing saved for
    backward, ~30% cheaper per sample than `fwd_s` on a CPU); None (profiles before format 5, roofline
    profiles): charged as `fwd_s`."""


def trainable_flags(module) -> tuple[bool, ...]:
    """`BlockProfile.param_trainable` of a module: per parameter, whether it requires a gradient;
    empty when every one does (what profiles without the field mean)."""
    flags = tuple(bool(p.requires_grad) for p in module.parameters())
    return () if all(flags) else flags


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockProfile:
    name: str
    param_count: int
    param_bytes: int
    """fp32 parameter bytes."""
    buffer_bytes: int
    timing: dict[str, BlockTiming]
    """Per precision: 'fp32', 'bf16'."""
    act_bytes: dict[str, Fit]
    """Activation bytes saved for backward, per precision, as a function of micro-batch."""
    out_bytes_per_sample: int
    """Bytes of the block's output per sample, counted in fp32 (4 bytes an element): a pipeline send, a
    checkpoint's kept input.  Under a low precision, `boundary_bytes_per_sample`."""
    flops_per_sample: float
    param_numels: tuple[int, ...] = ()
    """Elements of each parameter, in model order (ZeroRedundancyOptimizer partitions whole parameters)."""
    param_trainable: tuple[bool, ...] = ()
    """Per entry of `param_numels`: whether the parameter requires a gradient.  A frozen one (a
    fine-tuned model's fixed backbone) is held, sharded and gathered like the others, but has no
    gradient, no optimizer state and nothing to all-reduce.  Empty (profiles before this field, models
    with nothing frozen): every parameter trains."""
    scalar_params: int = 0
    """Parameters with no dimension (a learnable temperature, `nn.Parameter(torch.ones(()))`): torch's
    `fully_shard` (FSDP2) refuses them, so ZeRO-2/3 plans are refused (`strategies.zero`)."""
    script_params: int = 0
    """Parameters held by TorchScript modules (a child compiled with `torch.jit.script`), which
    `fully_shard` cannot wrap either: ZeRO-2/3 plans are refused (`strategies.zero`)."""
    split_grad_bytes_per_sample: dict[str, float] = field(default_factory=dict)
    """Per precision: bytes of activation gradients that a zero-bubble schedule's input backward keeps
    for the weight backward of this block (torch's `stage_backward_input` captures, for each parameter
    group, the gradient reaching the graph node where the group meets the input path), per sample:
    the activation gradients inside the block, which any backward of the block creates (counted for the
    first block too, as if its input needed a gradient).  Empty in profiles before this field: 0."""
    out_itemsize: dict[str, int] = field(default_factory=dict)
    """Per precision: bytes of one element of the block's output when the whole model runs under that
    precision's autocast.  A conv net's stages hand bf16 tensors on (convolution, norm, ReLU and residual
    add all stay bf16 on a CPU), a transformer's residual stream stays fp32.  Empty in profiles before
    this field: 4."""
    saves_input: dict[str, bool] = field(default_factory=dict)
    """Per precision: whether the block's own graph saves its input for backward, with the blocks
    chained as in training under that precision's autocast (`saved.saved_ends`: a convolution or a
    norm first saves it; a concatenation, or a cast under autocast, does not).  Empty in profiles before
    this field: unknown."""
    saves_output: dict[str, bool] = field(default_factory=dict)
    """Per precision: whether the block's own graph saves its output (a block ending in a ReLU does;
    one ending in a residual add or a concatenation does not).  Adjacent blocks count one storage twice
    only where the first saves its output and the next its input (`memory.block_activations`).  Empty
    in profiles before this field: unknown."""

    def boundary_bytes_per_sample(self, precision: str) -> float:
        """Bytes of the block's output per sample under `precision`: what a pipeline stage sends on,
        keeps until its step ends, or a checkpointed next block keeps."""
        return self.out_bytes_per_sample * self.out_itemsize.get(precision, 4) / 4

    @property
    def trains(self) -> tuple[bool, ...]:
        """Per entry of `param_numels`, whether it receives a gradient (`param_trainable`, or every one
        where that is empty)."""
        return self.param_trainable or (True,) * len(self.param_numels)

    @property
    def trainable_count(self) -> int:
        """Parameters that receive a gradient (all of them unless some are frozen)."""
        return self.param_count - sum(n for n, t in zip(self.param_numels, self.trains, strict=True) if not t)

    @property
    def trainable_bytes(self) -> int:
        """fp32 bytes of the parameters that receive a gradient: the gradients' size."""
        t = self.trainable_count
        return self.param_bytes if t == self.param_count else int(round(self.param_bytes * t / max(1, self.param_count)))


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryCalibration:
    """Whole-model memory of a plain one-process training step (hetsim.profiling.memcal), per precision,
    as functions of micro-batch size: what the per-block profile cannot say."""

    saved_bytes: dict[str, Fit]
    """Bytes the whole model saves for backward (distinct storages: a tensor two adjacent blocks
    both save counts once, unlike the sum of per-block act_bytes)."""
    temp_bytes: dict[str, Fit]
    """Peak of the second step minus model state minus saved_bytes: temporaries at the peak
    (a parameter's gradient before accumulation, activation gradients, the loss)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    model: str
    """Workload spec, e.g. 'resnet50@64'."""
    device_kind: str
    fingerprint: dict[str, str]
    micro_batches: tuple[int, ...]
    blocks: tuple[BlockProfile, ...]
    opt_step_s: dict[str, Fit]
    """Optimizer step seconds as a function of parameter count, per optimizer."""
    step_overhead_s: float = 0.0
    """Fixed per-micro-step time outside the blocks (loss, data slicing, zero_grad)."""
    input_bytes_per_sample: int = 0
    memory: MemoryCalibration | None = None
    """Whole-model memory calibration (None in profiles recorded without one)."""
    calib_residual_s: Fit | None = None
    """Measured real step minus the block-sum prediction, per micro-step, vs micro-batch: what
    isolated block timings miss in the real executor (DDP hooks, loss, zero_grad, Python)."""
    calib_residual_low_s: dict[str, Fit] = field(default_factory=dict)
    """The same for the low precisions searched ('bf16', 'fp16'), from real single-device steps under
    autocast: isolated blocks miss more there (a whole resnet18@128 step in bf16 on an AMX CPU took
    0.52-0.54 s where its blocks and optimizer summed to 0.47 s; in fp32 the two agreed within 1 %).
    A precision without one uses `calib_residual_s`."""
    grad_cache_residual_s: Fit | None = None
    """Batch-coupled workloads: a real single-device gradient-cache step minus its block-sum prediction,
    per chunk at full speed, vs chunk size (both passes of a chunk; the line through two measured
    sizes, `CostModel.overhead_s` scales it with the device's slowdown).  A plain
    step's residual does not carry over: simclr@96's was 0.12 s at batch 16 while a gradient-cache
    step of 8 chunks of 21.5 missed 0.07 s per chunk (two passes)."""
    grad_cosine: dict[str, float] = field(default_factory=dict)
    """Per low precision: cosine between its gradient and the fp32 gradient of one batch on this
    device kind (measured at profiling).  Empty in profiles recorded without it."""
    grad_cosine_floor: dict[str, float] = field(default_factory=dict)
    """Per low precision: cosine between the fp32 gradient of that batch and the fp32 gradient at the
    weights rounded to the precision: how far rounding alone moves this model's gradient
    (`hetsim.model.costmodel.cosine_refuses`).  Empty in profiles recorded without it."""
    precision_failed: dict[str, str] = field(default_factory=dict)
    """Per low precision: the error the model raised under its autocast on this device kind, where it
    did (an nn.LSTM under CPU bf16 autocast on a CPU without bf16 arithmetic: oneDNN has no primitive
    for it); its plans are refused (`hetsim.model.costmodel.precision_problem`)."""
    host_opt_step_s: dict[str, Fit] = field(default_factory=dict)
    """GPU profiles: the optimizer step on the host CPU (one thread, as a worker runs it) vs
    parameter count, per optimizer: where CPU offload steps the optimizer.  Empty for CPU
    profiles, whose `opt_step_s` is the host's already."""
    sync_residual_s: dict[str, float] = field(default_factory=dict)
    """By group (`group_key`: each device's kind and speed): a real uniform data-parallel step on the whole cluster minus its simulated
    step (gradient synchronisation and contention between ranks that the bucket model misses)."""
    sync_balanced_s: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """By group (`group_key`): (the uniform step's compute overlap, the balanced step's, the balanced
    step's residual): a second real data-parallel step, at the split that balances the devices, on
    which `sync_residual_s` is measured again (`CostModel.sync_residual_s` moves between the two with
    a plan's overlap, `strategies._dp_closed.compute_overlap`)."""
    shard_residual_s: dict[str, float] = field(default_factory=dict)
    """By group (`group_key`): a real uniform FSDP (ZeRO-3) step on the whole cluster minus its simulated
    step, sync residual included (what the per-block all-gather/reduce-scatter model misses), per micro-step
    of that step: a plan pays it in each of its micro-steps (`search.calib_dataparallel.PER_MICRO_STEP`)."""
    zero1_residual_s: dict[str, float] = field(default_factory=dict)
    """By group (`group_key`): the same for a real uniform ZeRO-1 step (DDP + ZeroRedundancyOptimizer, each
    owner broadcasting its parameters as one bucket; before 2026-12-07 one tensor at a time, many small
    collectives on a transformer: bert@tiny@64 on the default cluster then measured 15-19 % slower than
    simulated, DDP within 5 %)."""
    zero2_residual_s: dict[str, float] = field(default_factory=dict)
    """By group (`group_key`): the same for a real uniform ZeRO-2 step (FSDP2 without resharding after
    forward: per-block all-gathers in forward, reduce-scatters in backward); on CPU ranks it measured
    close to ZeRO-3 (vit@tiny@32: 0.28 s against 0.22 simulated and 0.23 for DDP).  Per micro-step, as
    `shard_residual_s`."""
    offload_single_s: dict[str, float] = field(default_factory=dict)
    """By one device (`group_key` of that device alone): a real FSDP2 step with CPU offload on that device
    alone (ZeRO-3, the search's global batch) minus its simulated step; ZeRO-2 and ZeRO-3 offload plans on
    one device carry it.  Simulated, such a plan is the device's data-parallel step plus the host optimizer
    step and copies; FSDP2's per-block hooks and offload bookkeeping on one rank were missing: bert@tiny@64
    on the default cluster (2026-12-03, interleaved runs on dev 0) measured ZeRO-2 and ZeRO-3 offload,
    accumulation 1 and 2, 16-18 % slower than simulated, about 40 ms a step whatever the stage or the
    accumulation; resnet50@64 main jobs read 11-12 %.  Empty in profiles recorded before it."""
    speed_scale: dict[str, float] = field(default_factory=dict)
    """By one emulated device below full speed (`group_key` of that device alone): its real one-device
    step's compute over what 1/speed of the profiled compute predicts, which every plan on such a device
    carries (`CostModel`'s time multiplier).  The emulator spins (1/speed - 1) x each block's measured
    time, and a rank that spins computes its next block slower: resnet18@64, 2026-12-05, three
    interleaved rounds, ddp 32 accum 2 and ddp 16 on the 0.5 device alone measured 2.03-2.05x the
    full-speed device's steps at the profiles' host speed where 1.90-1.91x was simulated (-7 to -8 %),
    while the full-speed device's own steps read within 2.5 %.  Group terms calibrated on the whole
    cluster (the balanced data-parallel split) had been absorbing it for their own plans only:
    checkpointed and pipelined plans that load the slow device more read 4-10 % fast in every bench.
    Empty in profiles recorded before it and on clusters without a slowed device."""
    calib_failed: dict[str, str] = field(default_factory=dict)
    """By `FIELD:group_key`: the status of a calibration run that failed (e.g. 'oom' on devices too
    small for the uniform plan), so later searches do not repeat it; `--reprofile` measures again."""
    pipe_action_s: dict[str, Fit] = field(default_factory=dict)
    """By group (`group_key`): seconds added to every compute action of a pipeline schedule, as a function
    of its micro-batch size, so that the simulated steps of two real pipeline runs on the whole cluster
    (one micro-batch; 2 per rank) equal their measured steps (per-action work of
    torch.distributed.pipelining, p2p waits, contention and small-micro-batch costs the block timings miss)."""
    pipe_action_multi_s: dict[str, Fit] = field(default_factory=dict)
    """By schedule and group (`multi_stage_key`): the same for the multi-stage schedules, each from real
    runs of its schedule (`_pipeline_sched.MULTI_TERM_RUN`) at two shapes, as a function of micro-batches x
    stages per rank (one run, a constant, in recordings before 2026-12-03 19:00): torch runs them
    through `_PipelineScheduleRuntime`, whose waits differ from GPipe's and 1F1B's, and differ between
    them (`hetsim.strategies._pipeline_sched.action_term`).  Empty in profiles recorded before it: those
    schedules then carry no per-action term."""
    tp_collective_s: dict[str, float] = field(default_factory=dict)
    """By tensor group (`group_key`): seconds per MiB of activation added to every all-reduce of a
    tensor-parallel plan run through per-rank slices, so that a real run on that group steps as
    simulated (autograd functions around each all-reduce, the slow rank's spin, contention between
    ranks).  Recordings before 2026-12-05 stored seconds per all-reduce of their run (the same
    number for gpt@tiny@64 at micro-batch 32, whose activation is 1 MiB)."""
    tp_dtensor_collective_s: dict[str, float] = field(default_factory=dict)
    """The same for even shards run through DTensor (`parallelize_module`): DTensor's dispatch of
    every sharded operator as well (on gpt@tiny@64, 2 CPU ranks: its even plan stepped 0.60 s where
    the per-collective model said 0.43)."""
    tp_sp_collective_s: dict[str, float] = field(default_factory=dict)
    """The same for DTensor's even shards under sequence parallelism (a reduce-scatter and an
    all-gather in place of each all-reduce, the norms' parameters' partial gradients); empty in
    profiles recorded before 2026-12-05: those plans then carry no calibrated term."""
    tp_pipeline_scale: dict[str, float] = field(default_factory=dict)
    """By tensor group (`group_key`): the relative change of the compute of a pipeline stage that is
    this tensor group (PP x TP plans; its segments and other blocks take (1 + term) x their time),
    from a real PP x TP run.  May be negative: with more ranks than cores,
    the host-speed probe assumes every rank contends for a core, while the stages of a pipeline take
    turns (gpt@tiny@64 on `emu:1.0@2G,1.0@2G,0.5@1G,0.5@1G`, no such term: PP x TP plans simulated
    0.128 and 0.156 s a step, measured 0.104 and 0.118 at the profiles' host speed)."""

    probe_s: float = 0.0
    """CPU profiles: the host-speed probe's median time while this profile was recorded
    (hetsim.profiling.hostspeed).  Every time above is kept at that host speed, calibration runs included;
    0 for GPU profiles and profiles recorded without a probe."""
    probe_elasticity: float = 1.0
    """The exponent the times above were normalised with: t x (probe_s / p)^probe_elasticity
    (hetsim.profiling.hostspeed.ELASTICITY when recorded; 1.0 in profiles recorded before it existed)."""
    timing_spread: float | None = None
    """Relative spread of the repeated timings while this profile was recorded: over the micro-batch
    sizes, the median of the relative median absolute deviation (MAD / median) of the repeated
    whole-model forward+backward timings (hetsim.profiling.measure).  It sees the host's jitter within
    seconds, not its slower phases; hetsim.reporting.decision turns it into a prediction interval with
    a floor.  None: unknown (profiles of format 3 and before, roofline profiles of catalog GPUs)."""

    @property
    def param_count(self) -> int:
        return sum(b.param_count for b in self.blocks)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommProfile:
    backend: str
    world_size: int
    fingerprint: dict[str, str]
    allreduce_s: Fit
    """All-reduce seconds as a function of bytes, over the real process group."""
    allgather_s: Fit | None = None
    sendrecv_s: Fit | None = None
    ddp_exposed_s: Fit | None = None
    """Measured DDP gradient synchronisation left exposed after backward, vs gradient bytes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    kind: str
    fingerprint: dict[str, str]
    matmul_flops: dict[str, float]
    """Sustained matmul FLOP/s per dtype."""
    copy_bps: float
    """Device memory copy bandwidth, bytes/s."""
    host_link_bps: float = 0.0
    launch_overhead_s: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSet:
    """Everything the cost model needs, as loaded from results/profiles/."""

    models: dict[str, ModelProfile] = field(default_factory=dict)
    """By device kind."""
    devices: dict[str, DeviceProfile] = field(default_factory=dict)
    comm: dict[int, CommProfile] = field(default_factory=dict)
    """By world size."""


def group_key(devices) -> str:
    """Key of a device group for calibrated group terms: each device's kind and relative speed."""
    return ",".join(f"{d.kind}x{d.speed:g}" for d in devices)


def multi_stage_key(schedule: str, group: str) -> str:
    """Key of a multi-stage schedule's per-action term (`ModelProfile.pipe_action_multi_s`) on a group."""
    return f"{schedule}:{group}"


def precision_action_key(key: str, precision: str) -> str:
    """Key of a pipeline per-action term (either field) measured by runs in a low `precision`; fp32's is
    the key itself."""
    return key if precision == "fp32" else f"{key}@{precision}"


# ----------------------------------------------------------------------------- where profiles live


def safe_name(text: str) -> str:
    """A device kind or workload spec as a file-name part."""
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", text)


def profile_dir(root: str | Path, kind: str) -> Path:
    """The folder of one device kind's profiles under a results root: ROOT/profiles/KIND."""
    return Path(root) / "profiles" / safe_name(kind)


def device_profile_path(root: str | Path, kind: str) -> Path:
    return profile_dir(root, kind) / "device.json"


def model_profile_path(root: str | Path, kind: str, model_spec: str) -> Path:
    return profile_dir(root, kind) / f"model-{safe_name(model_spec)}.json"


def comm_profile_path(root: str | Path, kind: str, world_size: int) -> Path:
    return profile_dir(root, kind) / f"comm-{world_size}.json"


def model_fingerprint(device_fp: dict[str, str], model_spec: str, micro_batches, precisions) -> dict[str, str]:
    """A model profile is valid for its device's fingerprint, the workload, and what was measured."""
    return {**device_fp, "model": model_spec, "micro_batches": ",".join(map(str, micro_batches)),
            "precisions": ",".join(precisions)}


def comm_fingerprint(device_fp: dict[str, str], world_size: int) -> dict[str, str]:
    """A collective profile is valid for its device's fingerprint and its world size."""
    return dict(device_fp, world_size=str(world_size))


def save(obj, path: str | Path) -> None:
    dump_json(obj, path)


def load(cls: type[T], path: str | Path, expect: dict[str, str] | None = None) -> T:
    """Load a profile; corrupted files and stale fingerprints raise a clear error."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        obj = from_dict(cls, data)
    except FileNotFoundError:
        raise
    except OSError as e:  # a folder, no permission
        raise ProfileCorruptError(
            f"profile {p} cannot be read ({e.strerror}); delete it or run with --reprofile to measure again"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileCorruptError(
            f"profile {p} is not valid JSON ({e}); delete it or run with --reprofile to measure again"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProfileCorruptError(
            f"profile {p} misses or has malformed fields ({e}); delete it or run with --reprofile"
        ) from None
    if expect is not None:
        have = getattr(obj, "fingerprint", {})
        diff = {k: (have.get(k), v) for k, v in expect.items() if have.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: recorded {a!r} != now {b!r}" for k, (a, b) in diff.items())
            raise ProfileMismatchError(f"profile {p} was measured for another setup ({what}); re-measuring")
    return obj
