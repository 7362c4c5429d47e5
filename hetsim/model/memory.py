"""Peak memory of one data-parallel device (families `ddp` and `zero`), as hetsim measures it.

What is measured (hetsim.execution.memtrack): tensor bytes at the peak of the *second* training
step (step index 1), when the optimizer state already exists.  The model is

    peak = model state + max over the step's phases of (activations + temporaries + comm buffers)

- **Model state** (`model_state_bytes`, closed form): parameters, gradients, optimizer state
  (1 tensor per parameter for SGD momentum, 2 for Adam/AdamW), plus buffers.  Sharding divides
  what it shards; offload moves it to `host_bytes`.
- **Activations**: the per-block profile (bytes saved for backward × micro-batch), minus the
  boundary tensors that two adjacent blocks both save (one tensor, counted once: calibrated on
  the whole model), swept over the backward pass: while block j runs backward, blocks < j still
  hold what they saved, block j holds all of its activations (recomputed if checkpointed),
  blocks > j are freed.  A checkpointed block keeps only its input.
- **Temporaries** (calibrated, `MemoryCalibration.temp_bytes`): peak of a plain one-process step
  minus its state and saved activations: a parameter's gradient before it is accumulated into
  `.grad`, activation gradients, the loss.
- **Communication buffers**: DDP allocates new gradient buckets once, at the start of the second
  step, while the old ones still exist (one extra copy of the gradients, before any activation
  exists).  FSDP2, per block: the flat all-gather output (in forward kept until the next
  block's copy-out), the unsharded parameters and, in backward, their unsharded gradients and
  the reduce-scatter input (kept until the next block's reduce); ZeRO-2 keeps every gathered
  block from its forward to its backward; ZeRO-3 gathers each block again in backward and
  prefetches the next one.  (`_fsdp_phases` lists the phases.)

- **Batch-coupled losses** (`CoupledLoss`): the gathered outputs of the global batch, their
  gradient and the InfoNCE logits (quadratic in the global batch) at the start of backward; with
  the gradient cache, activations of one chunk only, plus the embedding cache (this rank's outputs
  and their gradients) and the other chunks' inputs through every chunk, and the loss in a phase of
  its own.

Mixed precision: hetsim's executors keep fp32 parameters as the master copy at every precision
(torch.autocast; FSDP2's MixedPrecisionPolicy shards fp32 parameters), so resident state is
4 (params) + 4 (grads) + 4·s (optimizer) bytes per parameter (`FP32_MASTER`).  The 2-byte working
copies are transient and counted where they live: autocast's cast weights are saved for backward
and sit in the bf16 activation profile; FSDP2's gathered bf16 parameters and gradients are its
communication buffers (BatchNorm models gather fp32 and use autocast, see `fsdp_gather_bytes`).
The ZeRO paper's layout (2-byte params and grads, fp32 master copy inside the optimizer state:
2 + 2 + 12 bytes for Adam) is `LOW_PRECISION_MASTER`; no executor here holds it.  Both total
16 bytes per parameter, but they shard differently: ZeRO-1 leaves 8 + 8/N bytes here against
4 + 12/N in the paper's layout.

Nothing here imports torch: it is the simulation side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetsim.types import MemoryBreakdown
from hetsim.workloads.builtin import OPTIMIZER_STATE_PER_PARAM

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel

WORKING_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the parameters FSDP2 gathers (MixedPrecisionPolicy param_dtype)."""


def fsdp_gather_bytes(cost: CostModel, precision: str) -> int:
    """Bytes per parameter FSDP2 gathers.  BatchNorm models run low precision under torch.autocast
    with fp32 gathers: MixedPrecisionPolicy would cast BatchNorm's weight but not its fp32 running
    statistics, which batch_norm refuses."""
    return 4 if cost.facts.has_batchnorm else WORKING_BYTES.get(precision, 4)


@dataclass(frozen=True, kw_only=True, slots=True)
class StateLayout:
    """Bytes per parameter of each kind of model state."""

    param_bytes: int = 4
    grad_bytes: int = 4
    master_bytes: int = 0
    """A separate fp32 master copy, held with the optimizer state (0: the parameters are the master)."""
    state_bytes: int = 4
    """Bytes per optimizer state element."""


FP32_MASTER = StateLayout()
"""What hetsim's executors hold at every precision: fp32 parameters, gradients and optimizer state."""
LOW_PRECISION_MASTER = StateLayout(param_bytes=2, grad_bytes=2, master_bytes=4)
"""The ZeRO paper's mixed-precision layout (DeepSpeed fp16): 2 + 2 + (4 + 4·s) bytes per parameter."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sharding:
    """Which model state is divided among `shards` ranks, and whether the shards live on the host."""

    shards: int = 1
    params: bool = False
    grads: bool = False
    optim: bool = False
    offload: bool = False
    """Sharded parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy)."""

    @staticmethod
    def zero_stage(stage: int, shards: int, offload: bool = False) -> Sharding:
        """The ZeRO paper's stages: 1 shards the optimizer state, 2 also gradients, 3 also parameters."""
        return Sharding(shards=shards, optim=stage >= 1, grads=stage >= 2, params=stage >= 3, offload=offload)

    @staticmethod
    def fsdp(shards: int, offload: bool = False) -> Sharding:
        """FSDP2 (hetsim's ZeRO-2 and ZeRO-3): everything is sharded at rest; ZeRO-2 differs only in
        keeping the gathered parameters from forward to backward (a working set, not resident state)."""
        return Sharding(shards=shards, optim=True, grads=True, params=True, offload=offload)


def _div(nbytes: int, shards: int) -> int:
    return -(-nbytes // max(1, shards))


def model_state_bytes(param_count: int, *, optim_states: int, layout: StateLayout = FP32_MASTER,
                      sharding: Sharding = Sharding(), optim_count: int | None = None,
                      trainable_count: int | None = None) -> MemoryBreakdown:
    """Resident parameters, gradients and optimizer state of one rank (buffers excluded).

    `trainable_count`: parameters that receive a gradient (default: all); frozen ones are held but
    have no gradient and no optimizer state.
    `optim_count`: parameters whose optimizer state this rank holds, where the partition is not an
    even split (ZeroRedundancyOptimizer assigns whole parameters); default trainable_count / shards.
    """
    n = sharding.shards
    trained = param_count if trainable_count is None else trainable_count
    params = layout.param_bytes * param_count
    grads = layout.grad_bytes * trained
    per_opt = layout.master_bytes + optim_states * layout.state_bytes
    if sharding.params:
        params = _div(params, n)
    if sharding.grads:
        grads = _div(grads, n)
    if optim_count is not None:
        optim = per_opt * optim_count
    else:
        optim = _div(per_opt * trained, n) if sharding.optim else per_opt * trained
    if sharding.offload:
        return MemoryBreakdown(host_bytes=params + grads + optim)
    return MemoryBreakdown(params_bytes=params, grads_bytes=grads, optim_bytes=optim)


# ----------------------------------------------------------------------------- ZeRO-1 partition


def zero1_owned_counts(cost: CostModel, shards: int) -> list[int]:
    """Parameters whose optimizer state each rank owns under ZeroRedundancyOptimizer: whole
    parameters, largest first, each to the rank with the fewest so far (its partition rule).
    Without per-parameter sizes in the profile, an even split."""
    return list(cost.memo(("zero1_owned_counts", shards), lambda: tuple(_zero1_owned_counts(cost, shards))))


def _zero1_owned_counts(cost: CostModel, shards: int) -> list[int]:
    """ZeroRedundancyOptimizer partitions every parameter it is given (hetsim gives it all of them),
    frozen ones included; a rank holds state and steps only for its trainable ones."""
    numels = [(n, t) for b in cost.base_profile.blocks for n, t in zip(b.param_numels, b.trains, strict=True)]
    if not numels:
        total = cost.trainable_count()
        return [total // shards + (1 if r < total % shards else 0) for r in range(shards)]
    sizes, owned = [0] * shards, [0] * shards
    for n, trains in sorted(numels, key=lambda e: -e[0]):  # stable sort: ties keep model order, as torch's
        r = sizes.index(min(sizes))
        sizes[r] += n
        owned[r] += n if trains else 0
    return owned


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True, slots=True)
class _BlockActs:
    kept: list[float]
    """Bytes block k keeps from its forward until its backward."""
    full: list[float]
    """Bytes block k holds while it runs backward (recomputed when checkpointed)."""
    input_in_full: list[float]
    """Bytes of block k's input that `full` (and `kept`, unless the block is checkpointed) still
    counts as block k's own: its saved input (from `saves_input`; in older profiles the boundary's share
    of the overlap) less what was taken off as the previous block's saved output (one storage)."""
    per_step: list[float]
    """Of `kept`, the bytes that do not grow with the micro-batch and that autocast makes once a step:
    the low-precision copies of the block's weights, which autocast caches for the whole autocast
    region and the block's matmuls save (the intercept of its saved bytes in bf16/fp16, at most two
    bytes a trainable parameter; 0 in fp32 and in a checkpointed block).  A pipeline stage with several
    micro-batches in flight holds them once, not once per micro-batch (`_pipeline_memory`)."""


def _block_activations(cost: CostModel, mb: float, precision: str, ckpt: int) -> _BlockActs:
    prof = cost.base_profile
    blocks = prof.blocks
    n = len(blocks)
    key = precision if precision in blocks[0].act_bytes else "fp32"
    act = [b.act_bytes[key](mb) for b in blocks]
    inp = [prof.input_bytes_per_sample * mb] + [blocks[k - 1].boundary_bytes_per_sample(key) * mb for k in range(1, n)]
    # A boundary tensor both neighbours save is one storage; the calibrated whole-model total says how
    # much the per-block sum over-counts.  It comes off the boundaries both sides save (`saves_input`,
    # `saves_output`; profiles without them: every boundary, by size).  The rest (a block timed alone
    # saves its leaf input: simclr's blocks over-count 17 MiB at 40 samples beyond their boundaries)
    # comes off every block in proportion to its bytes, so that the blocks add up to the whole model.
    known = all(key in b.saves_input and key in b.saves_output for b in blocks)
    if known:
        saved_in = [inp[k] if blocks[k].saves_input[key] else 0.0 for k in range(n)]
        shared = [0.0] + [saved_in[k] if blocks[k - 1].saves_output[key] else 0.0 for k in range(1, n)]
    else:
        shared = [0.0] + inp[1:]
    overlap = [0.0] * n
    scale = 1.0
    cal = prof.memory
    whole = (cal.saved_bytes.get(key) or cal.saved_bytes.get("fp32")) if cal is not None and n > 1 else None
    if whole is not None:
        extra = max(0.0, sum(act) - whole(mb))
        boundary = sum(shared)
        if boundary > 0:
            share = min(1.0, extra / boundary)
            overlap = [share * b for b in shared]
        own = sum(max(0.0, a - o) for a, o in zip(act, overlap))
        if own > whole(mb) > 0 and (known or boundary > 0):
            scale = whole(mb) / own
    saved_in = saved_in if known else overlap  # older profiles: the overlap estimates the saved input
    kept, full, input_in_full, per_step = [], [], [], []
    for k in range(n):
        # Only a block that is not checkpointed saves its output for the next block to share.
        ovl = overlap[k] if k >= 1 and k - 1 >= ckpt else 0.0
        mine = max(0.0, act[k] - ovl) * scale
        kept.append(max(0.0, inp[k] - ovl) if k < ckpt else mine)
        full.append(mine)
        input_in_full.append(min(mine, max(0.0, saved_in[k] - ovl) * scale) if k >= 1 else 0.0)
        casts = 0.0
        if key != "fp32" and k >= ckpt:
            casts = min(max(0.0, blocks[k].act_bytes[key].intercept) * scale, 2.0 * blocks[k].trainable_count, mine)
        per_step.append(casts)
    return _BlockActs(kept, full, input_in_full, per_step)


block_activations = _block_activations
"""Per block: bytes kept from forward to backward, held during its backward, and of its input still counted as its own."""


def optimizer_step_temp_bytes(optimizer: str, param_numels) -> int:
    """Temporaries of hetsim's optimizer step (`foreach=False`, one parameter at a time).

    Adam/AdamW compute `(exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: two fresh tensors of
    the parameter's size at once, so the step's peak adds twice the largest parameter (seen with
    MemTracker: the last resnet50 stage's optimizer category was 18 MiB over its state, twice its
    9 MiB 3x3 convolution weight).  SGD with momentum updates in place.  It matters where the
    activations are small: a pipeline's last stages peak in the optimizer step, not in backward.
    """
    numels = list(param_numels)
    if not numels or optimizer not in ("adam", "adamw"):
        return 0
    return 2 * 4 * max(numels)


def temporaries_bytes(cost: CostModel, mb: float, precision: str) -> float:
    """Calibrated temporaries at the backward peak of a plain step (0 without a calibration)."""
    cal = cost.base_profile.memory
    if cal is None:
        return 0.0
    fit = cal.temp_bytes.get(precision) or cal.temp_bytes.get("fp32")
    return fit(mb) if fit is not None else 0.0


LOSS_TEMP_COPIES = 4
"""Tensors of the model output's size that a cross-entropy-like loss has alive at the start of
backward: the output, the log-softmax it saves, and their two gradients."""
LOSS_KEPT_COPIES = 2
"""Of those, what a pipeline's last stage keeps per micro-batch from its forward to its backward:
the output and the loss's saved log-softmax (torch.distributed.pipelining computes the loss right
after the last stage's forward).  Measured on bert/gpt pipelines at 64 tokens (MemTracker): the
last stage's activations exceed its blocks' own by two logits per micro-batch in flight (GPipe,
2 x 16 samples: 66.2 MiB against 34.1 from the blocks), its backward temporaries by two.
`loss_kept_bytes` sizes the two by precision."""


def loss_kept_bytes(cost: CostModel, mb: float, precision: str) -> float:
    """What a pipeline's last stage keeps per micro-batch of `mb` samples from its forward to its
    backward for the loss (`LOSS_KEPT_COPIES`): the stage's output in the dtype the last block
    returns under `precision`, and the log-softmax the loss saves, in fp32 (autocast runs
    log_softmax and cross_entropy in fp32, and the built-in losses cast the logits up first).
    gpt@tiny@64 LoopedBFS m=4 bf16 on the default cluster, 2026-12-06: the head's rank measured
    36.5 MiB of activations at its peak where two fp32 logits per micro-batch predicted 49.1
    (four micro-batches in flight, 2 MiB of bf16 logits each counted as 4)."""
    blocks = cost.base_profile.blocks
    if not blocks:
        return 0.0
    last = blocks[-1]
    return float((last.boundary_bytes_per_sample(precision) + last.out_bytes_per_sample) * mb)


def loss_temporaries_bytes(cost: CostModel, mb: float, copies: int = LOSS_TEMP_COPIES) -> float:
    """`copies` tensors of the last block's output for `mb` samples: the part of a whole step's
    calibrated temporaries that its loss holds (a transformer's logits dominate them), which a
    pipeline stage without the last block never has."""
    blocks = cost.base_profile.blocks
    return float(copies * blocks[-1].out_bytes_per_sample * mb) if blocks else 0.0


def split_grad_bytes(cost: CostModel, lo: int, hi: int, mb: float, precision: str) -> float:
    """Activation gradients blocks [lo, hi) keep from a zero-bubble input backward to its weight
    backward, for one micro-batch of `mb` samples (0 from profiles that did not record them)."""
    out = 0.0
    for b in cost.base_profile.blocks[lo:hi]:
        per = b.split_grad_bytes_per_sample
        out += (per.get(precision, per.get("fp32", 0.0))) * mb
    return out


def largest_param_bytes(cost: CostModel, lo: int = 0, hi: int | None = None) -> int:
    """The largest single trainable parameter (fp32 bytes) of blocks [lo, hi): the gradient temporary a
    plain step creates before accumulating it, which FSDP's fresh unsharded gradients replace.  A
    frozen parameter gets no gradient."""
    numels = trainable_numels(cost.base_profile.blocks[lo:hi])
    return 4 * max(numels) if numels else 0


def trainable_numels(blocks) -> list[int]:
    """Elements of each parameter of `blocks` (BlockProfile) that requires a gradient, in model order."""
    return [n for b in blocks for n, t in zip(b.param_numels, b.trains, strict=True) if t]


# ----------------------------------------------------------------------------- one device


@dataclass(frozen=True, kw_only=True, slots=True)
class _Phase:
    activations: float
    other: float


@dataclass(frozen=True, kw_only=True, slots=True)
class CoupledLoss:
    """What a batch-coupled (contrastive) loss adds on one data-parallel rank."""

    global_batch: int
    """Samples whose outputs are gathered for the loss (the whole global batch)."""
    local_batch: int
    """This rank's samples (the gradient cache keeps their outputs and output gradients)."""
    grad_cache: bool = False


LOGIT_COPIES = 4
"""Logit-sized tensors alive while an InfoNCE loss runs backward: the logits, the log-softmax saved
for backward, the gradient of the log-softmax and of the logits."""


def coupled_loss_bytes(cost: CostModel, c: CoupledLoss) -> tuple[float, float]:
    """(bytes while the loss and its backward run, bytes held through the whole backward pass).

    The loss holds the gathered outputs of the global batch and their gradient (padded rows
    ignored) and its logits (`ModelFacts.logits_per_sample_sq` x B**2 fp32, LOGIT_COPIES of them).
    The gradient cache also keeps this rank's outputs and their gradient from the loss until its
    last chunk's backward: the embedding cache."""
    emb = cost.base_profile.blocks[-1].out_bytes_per_sample
    loss = 2 * emb * c.global_batch + LOGIT_COPIES * 4 * cost.facts.logits_per_sample_sq * c.global_batch**2
    cache = 2 * emb * c.local_batch if c.grad_cache else 0
    return float(loss + cache), float(cache)


def data_parallel_memory(cost: CostModel, dev: int, micro: int, precision: str, ckpt: int, *,
                         shards: int = 1, zero_stage: int = 0, offload: bool = False,
                         rank: int = 0, coupled: CoupledLoss | None = None) -> MemoryBreakdown:
    """Peak bytes of one rank of a data-parallel group of `shards` ranks.

    zero_stage 0: DDP; 1: DDP + ZeroRedundancyOptimizer; 2 and 3: FSDP2 (reshard after forward
    off / on).  `micro` is this rank's largest micro-batch; `rank` its position in the group (for
    ZeRO-1's uneven partition).  `dev` does not change the bytes: tensor sizes are the model's,
    whatever the device kind.  `coupled`: the batch-coupled loss's gathered outputs and logits
    (at the start of backward, when every activation is alive) or, with the gradient cache, its
    own phase plus the embedding cache through every chunk.
    """
    del dev
    # Only ZeRO-1's partition depends on the rank.
    key = (micro, precision, ckpt, shards, zero_stage, offload, rank if zero_stage == 1 else 0, coupled)
    table = cost.memo_table("data_parallel_memory")
    found = table.get(key)
    if found is None:
        found = table[key] = _data_parallel_memory(cost, micro, precision, ckpt, shards, zero_stage, offload, rank,
                                                   coupled)
    return found


def _with_coupled_loss(cost: CostModel, phases: list[_Phase], c: CoupledLoss, micro: int) -> list[_Phase]:
    during, held = coupled_loss_bytes(cost, c)
    if c.grad_cache:  # the loss runs between the no-graph pass and the chunks: no activation alive
        # Every chunk's input is on the device through the step; a chunk's own is in its activations.
        inputs = cost.base_profile.input_bytes_per_sample * max(0, c.local_batch - micro)
        during, held = during + inputs, held + inputs
        return [_Phase(activations=0.0, other=during)] + [
            _Phase(activations=p.activations, other=p.other + held) for p in phases]
    top = max(range(len(phases)), key=lambda i: phases[i].activations)  # backward starts here
    return [(_Phase(activations=p.activations, other=p.other + during) if i == top else p)
            for i, p in enumerate(phases)]


def _data_parallel_memory(cost: CostModel, micro: int, precision: str, ckpt: int, shards: int, zero_stage: int,
                          offload: bool, rank: int, coupled: CoupledLoss | None = None) -> MemoryBreakdown:
    count, trained = cost.param_count(), cost.trainable_count()
    states = OPTIMIZER_STATE_PER_PARAM.get(cost.optimizer, 2)
    if zero_stage == 0:
        state = model_state_bytes(count, optim_states=states, trainable_count=trained)
    elif zero_stage == 1:
        owned = zero1_owned_counts(cost, shards)[rank]
        state = model_state_bytes(count, optim_states=states, sharding=Sharding.zero_stage(1, shards),
                                  optim_count=owned, trainable_count=trained)
    else:
        state = model_state_bytes(count, optim_states=states, sharding=Sharding.fsdp(shards, offload),
                                  trainable_count=trained)
    acts = _block_activations(cost, micro, precision, ckpt)
    if zero_stage <= 1:
        phases = _ddp_phases(cost, acts, micro, precision)
        # The optimizer step, after backward: Adam's two parameter-sized temporaries (where the
        # activations are small, as in a linear probe, the step peaks here; measured with MemTracker).
        temps = optimizer_step_temp_bytes(cost.optimizer, trainable_numels(cost.base_profile.blocks))
        phases.append(_Phase(activations=0.0, other=float(temps)))
    else:
        phases = _fsdp_phases(cost, acts, micro, precision, zero_stage, shards)
    if coupled is not None and cost.facts.batch_coupled:
        phases = _with_coupled_loss(cost, phases, coupled, micro)
    peak = max(phases, key=lambda p: p.activations + p.other)
    return MemoryBreakdown(
        params_bytes=state.params_bytes + cost.buffer_bytes(),  # FSDP2 does not shard or offload buffers
        grads_bytes=state.grads_bytes,
        optim_bytes=state.optim_bytes,
        activations_bytes=int(peak.activations),
        other_bytes=int(peak.other),
        host_bytes=state.host_bytes,
    )


def temps_without_loss(cost: CostModel, micro: float, whole: float) -> float:
    """A step's calibrated temporaries `whole` less the loss's (`loss_temporaries_bytes`): what a
    backward that does not run the loss holds (a block before the last; a pipeline stage without it)."""
    return max(0.0, whole - loss_temporaries_bytes(cost, micro))


def _backward_temps(cost: CostModel, micro: int, whole: float, k: int, n: int) -> float:
    """The temporaries of block k's backward out of a whole step's calibrated `whole`: all of them
    in the last block's, where the loss's backward runs; in an earlier block's, none of the loss's
    (`loss_temporaries_bytes`: its logits and their gradient are freed by then).  It matters where
    checkpointing moves the activation peak off the last block: bert@tiny@64, zero3 offload 32 bf16
    with every block checkpointed, measured 61.4 MB where the loss's temporaries in every block's
    backward predicted 73.0 (activations 27.8 vs 13.1, temporaries 33.6 vs 59.9)."""
    return whole if k == n - 1 else temps_without_loss(cost, micro, whole)


def _ddp_phases(cost: CostModel, acts: _BlockActs, micro: int, precision: str) -> list[_Phase]:
    temps = temporaries_bytes(cost, micro, precision)
    # Gradient buckets are views of fresh storage; DDP rebuilds them at the second step's forward.
    phases = [_Phase(activations=0.0, other=float(cost.grad_bytes()))]
    before = 0.0
    n = len(acts.kept)
    for k in range(n):
        phases.append(_Phase(activations=before + acts.full[k], other=_backward_temps(cost, micro, temps, k, n)))
        before += acts.kept[k]
    return phases


def _fsdp_phases(cost: CostModel, acts: _BlockActs, micro: int, precision: str, stage: int,
                 shards: int) -> list[_Phase]:
    """FSDP2's buffers per block k (U: unsharded parameters, F: flat all-gather output, both in the
    gather dtype; G: unsharded gradients; R: reduce-scatter input in the fp32 reduce dtype):

    forward k     F(k-1) is freed only after block k's copy-out: F(k-1) + F(k) + U(k);
    backward k    U(k) + prefetched F(k-1) + G(k) + R(k+1) (the previous reduce-scatter's input is
                  kept until this block's reduce);
    reduce k      U(k) freed, R(k+1) freed: F(k-1) + G(k) + R(k) + R(k)/N.
    ZeRO-2 keeps U of every block from its forward to its backward and gathers nothing in backward.
    """
    n = len(acts.kept)
    w = fsdp_gather_bytes(cost, precision)
    counts = [cost.param_count(k, k + 1) for k in range(n)]
    gathered = [c * w for c in counts]
    trained = [cost.trainable_count(k, k + 1) for k in range(n)]
    grads = [c * w for c in trained]  # G: unsharded gradients, only of the parameters that train
    reduce_in = [c * 4.0 for c in trained] + [0.0]
    prefix = [0.0]
    for k in range(n):
        prefix.append(prefix[-1] + gathered[k])
    # Activation gradients and the like; the parameter-gradient temporary of a plain step does not
    # exist here (FSDP's unsharded gradients are fresh tensors, counted as G).
    temps = max(0.0, temporaries_bytes(cost, micro, precision) - largest_param_bytes(cost))
    phases = []
    before = 0.0
    for k in range(n):
        prev_flat = gathered[k - 1] if k else 0.0
        resident = prefix[k] if stage == 2 else 0.0
        phases.append(_Phase(activations=before, other=resident + prev_flat + 2 * gathered[k]))
        before += acts.kept[k]
    for k in reversed(range(n)):
        before -= acts.kept[k]
        if stage == 2:
            held, held_after = prefix[k + 1], prefix[k]
        else:
            prefetch = gathered[k - 1] if k else 0.0
            held, held_after = gathered[k] + prefetch, prefetch
        phases.append(_Phase(activations=before + acts.full[k],
                             other=held + grads[k] + reduce_in[k + 1] + _backward_temps(cost, micro, temps, k, n)))
        phases.append(_Phase(activations=before,
                             other=held_after + grads[k] + reduce_in[k] * (1 + 1 / max(1, shards))))
    return phases
