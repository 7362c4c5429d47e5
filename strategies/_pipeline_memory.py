"""What one pipeline rank holds at its peak, from its schedule's action list (`_pipeline_sched`):
its stages' state, the activations of the micro-batches in flight, a backward's temporaries and a
zero-bubble schedule's captured gradients, the loss stage's logits, the optimizer step's temporaries.
Shared by the `pipeline` and `hybrid` families."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hetsim.model.memory import (
    block_activations,
    largest_param_bytes,
    loss_kept_bytes,
    loss_temporaries_bytes,
    optimizer_step_temp_bytes,
    split_grad_bytes,
    temporaries_bytes,
    temps_without_loss,
    trainable_numels,
)
from hetsim.types import MemoryBreakdown

from ._pipeline_sched import Action, rank_actions

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel


FULL_BACKWARD_GRAD_SHARE = 0.5
"""Share of a block's activation gradients (`split_grad_bytes`: all of them, as a split input
backward keeps them to its weight backward) alive at once in a full backward of a block that is not
checkpointed, where autograd frees each one as soon as the nodes that need it have run.  Fitted, not
derived: gpt@tiny@64 model parallel, 32 samples, first stage (embedding and two layers) measured
5.5 MB of temporaries where one layer's activation gradients are 11.5 MB; replaying the committed
2026-12-03 bench runs (102 plan rows) with 0.5 moved their memory MAPE from 1.31 to 1.13 % (the gpt
stage +10.3 -> -1.0 %), while a checkpointed block needs all of them (resnet18 model parallel with
every block checkpointed: +6.6 % with 1, -11.2 % with 0.5), so checkpointed blocks keep 1."""


def stage_state(cost: CostModel, lo: int, hi: int) -> tuple[int, int, int]:
    """(parameters + buffers, gradients, optimizer state) bytes of blocks lo..hi; frozen parameters
    have neither gradients nor optimizer state."""
    return (cost.param_bytes(lo, hi) + cost.buffer_bytes(lo, hi), cost.grad_bytes(lo, hi),
            cost.optim_state_bytes(cost.trainable_count(lo, hi)))


def rank_memory(cost: CostModel, actions: Sequence[Action], boundaries: Sequence[int], micro: int,
                precision: str, ckpt: int, schedule: str = "") -> MemoryBreakdown:
    """Bytes one pipeline rank holds at its peak.

    Its stages' state (parameters, buffers, gradients, optimizer state) plus the largest of
    - during an action, the activations of the micro-batches in flight (each stage keeps what its
      blocks save, boundary tensors shared by adjacent blocks counted once, as `hetsim.model.memory`
      models a whole step); during a backward, the stage's blocks sweep like a whole model's
      (block k holds all it saved or recomputes) plus the calibrated temporaries of a backward;
      a zero-bubble schedule's split backward keeps each stage's graph and its captured activation
      gradients from the input backward (I) to the weight backward (W); a multi-stage schedule keeps
      every micro-batch's stage outputs and input gradients until the step ends; a one-stage-per-rank
      schedule (`schedule`: 'GPipe' or '1F1B') keeps every micro-batch's receive slot, and its input
      gradients until their sends are waited;
    - the optimizer step, after every activation is freed: its temporaries
      (`optimizer_step_temp_bytes`), which is where a late stage with small activations peaks.
    Data-parallel replicas of the pipeline sum the gradients in place (`PipelineExecutor._sum_grads_over_replicas`).
    """

    stages = sorted({a.stage for a in actions})
    blocks = cost.base_profile.blocks
    ba = block_activations(cost, micro, precision, ckpt)
    params = grads = optim = 0
    kept: dict[int, float] = {}
    sweep: dict[int, float] = {}
    numels: list[int] = []
    wgrad: dict[int, float] = {}
    pending: dict[int, float] = {}
    grad_sweep: dict[int, float] = {}
    full_sweep: dict[int, float] = {}  # the same, with each block's own fresh parameter gradient
    out_b: dict[int, float] = {}  # the stage's output, sent on (none from the last stage)
    in_b: dict[int, float] = {}  # the stage's received input (none on the first stage)
    casts: dict[int, float] = {}  # autocast's weight copies, made once a step
    # torch's one-stage-per-rank schedules (GPipe, 1F1B) receive each micro-batch's input into a slot
    # of its own, allocated by the first step and kept (`PipelineStage`'s receive buffers): a later
    # stage's received inputs are all alive by its last forward, whatever the micro-batches in flight.
    # A user U-Net, fp32, 1F1B m=4 [0:2] [2:4], second stage: its four 4 MiB slots were alive at its
    # peak (saved-tensor trace of the measured step), where one per micro-batch in flight was predicted.
    slots = len(stages) == 1
    for s in stages:
        lo, hi = boundaries[s], boundaries[s + 1]
        p, gr, o = stage_state(cost, lo, hi)
        params, grads, optim = params + p, grads + gr, optim + o
        in_b[s] = blocks[lo - 1].boundary_bytes_per_sample(precision) * micro if s > 0 else 0.0
        # torch's pipeline stage keeps each micro-batch's received input until that micro-batch's backward
        # (its own storage, which the first block may or may not save): the whole of it, in place of what
        # the block was estimated to save of it.  A block that casts first saves the cast, not the input:
        # a ConvNeXt-like user model under bf16 autocast, Interleaved1F1B with three one-block stages on a
        # rank, measured 4.2 MiB more activations than predicted, its stages' fp32 inputs (0.79 MiB per
        # stage and micro-batch) counted nowhere.
        # With receive slots the received input is its slot, counted once a micro-batch for the whole
        # step (`slot_u`): the first block's own count of it comes off instead.
        own_in = (0.0 if slots else in_b[s]) - ba.input_in_full[lo] if s > 0 else 0.0
        # Autocast's cached weight copies are made by the stage's first forward of the step and held
        # to its end, once whatever the micro-batches in flight (`block_activations`' per_step): each
        # micro-batch's activations are the rest.  gpt@tiny@64 LoopedBFS m=4 bf16, 2026-12-06
        # (MemTracker after each action): a one-layer stage's first forward added 2.91 MiB, each later
        # one 2.52; the layer's bf16 weights are 0.375 MiB, its saved bytes' intercept in the profile.
        casts[s] = sum(ba.per_step[lo:hi])
        k_s = [max(0.0, ba.kept[k] - ba.per_step[k] + (own_in if k == lo and (k >= ckpt or slots) else 0.0))
               for k in range(lo, hi)]
        f_s = [max(0.0, ba.full[k] - ba.per_step[k] + (own_in if k == lo else 0.0)) for k in range(lo, hi)]
        kept[s] = sum(k_s)
        # A block's backward also holds its internal activation gradients (split_grad_bytes): where
        # a block with large activations runs its backward late (a checkpointed early stage
        # recomputing them), they, not the whole model's calibrated temporaries, set the peak.
        g_s = [split_grad_bytes(cost, k, k + 1, micro, precision) for k in range(lo, hi)]
        # A full backward also creates each block's parameter gradients before accumulating them:
        # the block's largest one is the transient, alive while that block's backward runs, not on
        # top of a later block's activation gradients (bert@tiny@64 1F1B bf16, 4 blocks on the first
        # stage: its embedding's 1 MiB gradient added to the layers' sweep predicted 33.2 MB where
        # 30.9 was measured).
        w_s = [float(largest_param_bytes(cost, k, k + 1)) for k in range(lo, hi)]
        share = [1.0 if k < ckpt else FULL_BACKWARD_GRAD_SHARE for k in range(lo, hi)]
        before = worst = worst_g = worst_gw = 0.0
        for k_b, f_b, g_b, w_b, sh in zip(k_s, f_s, g_s, w_s, share):
            worst = max(worst, before + f_b)
            worst_g = max(worst_g, before + f_b + g_b)
            worst_gw = max(worst_gw, before + f_b + sh * g_b + w_b)
            before += k_b
        sweep[s] = max(0.0, worst - kept[s])
        grad_sweep[s] = max(0.0, worst_g - worst)
        full_sweep[s] = max(0.0, worst_gw - worst)
        numels += trainable_numels(blocks[lo:hi])
        wgrad[s] = float(largest_param_bytes(cost, lo, hi))
        # What a split backward keeps from I to W: the received output gradient (none on the last
        # stage) and, past the first stage, the parameter groups' captured activation gradients and
        # the input's gradient that stage_backward_input leaves on the input (`inp.grad`).  The
        # retained graph itself is in `kept`.
        out_b[s] = blocks[hi - 1].boundary_bytes_per_sample(precision) * micro if hi < boundaries[-1] else 0.0
        pending[s] = out_b[s] + (sum(g_s) + in_b[s] if s > 0 else 0.0)
    # The calibrated temporaries of a whole model's backward include the gradient of its largest
    # parameter before accumulation: a stage's backward has its own largest instead, and an input
    # backward computes no parameter gradient at all.
    grad_temp = float(largest_param_bytes(cost))
    temps = max(0.0, temporaries_bytes(cost, micro, precision) - grad_temp)
    # Only the stage that holds the model's last block computes the loss: it keeps the output and the
    # loss's saved tensors from forward to backward, and its backward has the rest of the loss's
    # temporaries; the other stages have none of them (a transformer's logits dominate a whole
    # step's temporaries: on a bert pipeline the rank without the head measured 2.9 MiB of
    # temporaries where the whole-model figure was 16.8).  The loss's saved tensors are freed by the
    # stage's first backward (a split backward's input backward): bert InterleavedZeroBubble, 2 x 16
    # samples, measured 50.2 MiB of activations on the head's rank where keeping them to the weight
    # backward predicted 66.1.
    last = next((s for s in stages if boundaries[s + 1] == boundaries[-1]), None)
    stage_temps = {s: temps_without_loss(cost, micro, temps) for s in stages}
    loss_kept = {s: 0.0 for s in stages}
    if last is not None:
        loss_kept[last] = loss_kept_bytes(cost, micro, precision)
        stage_temps[last] = max(0.0, temps - loss_kept[last])
    # A one-stage-per-rank stage that is not the whole model has none of the whole model's calibrated
    # temporaries but its own: its blocks' activation gradients (`full_sweep`), the tensors crossing
    # its cuts, and on the last stage the loss's, which peak before the stage's blocks run their
    # backward (the loss's gradients, then one logits-sized gradient left for the last block).
    # Saved-tensor trace of gpt@tiny@64 1F1B m=2 [0:5] [5:6], the head's rank: 32 MiB of loss tensors
    # at its peak and one input gradient, not yet its second.
    local = slots and (boundaries[stages[0]] > 0 or boundaries[stages[-1] + 1] < boundaries[-1])
    loss_phase = {s: 0.0 for s in stages}
    logits_grad = {s: 0.0 for s in stages}
    if local and last is not None:
        loss_phase[last] = max(0.0, loss_temporaries_bytes(cost, micro) - loss_kept[last])
        logits_grad[last] = loss_temporaries_bytes(cost, micro, copies=1)
    split = any(a.kind == "W" for a in actions)
    # torch runs the multi-stage schedules (two or more stages per rank) through its
    # `_PipelineScheduleRuntime`, which waits on its sends only at the end of the step and hands a
    # same-rank neighbour its tensors in that stage's receive slots: every micro-batch's stage output
    # (sent, or in the next stage's slot) and the input gradient left on a received input (`inp.grad`,
    # cleared when the next step starts) live until the step ends.  gpt@tiny ZBVZeroBubble, 8
    # micro-batches of 4 on emu:1.0@4G,0.5@2G: the boundary tensors created in a step and alive at its
    # end were four per micro-batch on the rank holding stages 1 and 2, two on the other (stages 0 and
    # 3); peaks measured 33.6 / 21.6 MiB, predicted 30.2 / 17.5 without them, 31.2 / 20.8 with.
    # The receive slots of cross-rank transfers are allocated once, before the measured step.
    retain = len(stages) > 1
    out_u = {s: out_b[s] if retain else 0.0 for s in stages}
    in_u = {s: in_b[s] if retain else 0.0 for s in stages}
    # A one-stage-per-rank schedule (GPipe, 1F1B) holds the tensors crossing its cuts only while a backward
    # runs: the gradient received for the stage's output and the one it makes for its input, one boundary
    # tensor each (the multi-stage schedules above keep both to the end of the step).  Small beside most
    # stages' activations, not beside a cut after a U-Net's concatenated skip: a user U-Net, 1F1B m=2,
    # [0:3] [3:4], fp32, measured 95.4 / 18.0 MiB, predicted -6.6 / -24.0 % without them, -2.4 / -1.8 %
    # with; resnet18 GPipe m=2 with the stem alone on the first stage, kept bench runs: -13.5 -> -10.2 %.
    crossing = {s: 0.0 if retain else out_b[s] + in_b[s] for s in stages}
    # Their input gradients live until their sends are waited: ScheduleGPipe waits them all after its
    # last backward, Schedule1F1B each one after the next backward (the U-Net's second stage above held
    # two; GPipe m=4, four).
    slot_u = {s: in_b[s] if slots else 0.0 for s in stages}
    gpipe = schedule == "GPipe"
    sent_grads = 0.0
    held = waiting = 0.0
    best = (0.0, float(optimizer_step_temp_bytes(cost.optimizer, numels)))  # (activations, other)
    for a in actions:
        s = a.stage
        # torch skips the first stage's input backward (its input needs no gradient) and runs its
        # weight backward as one full backward.
        full_backward = a.kind == "B" or (a.kind == "W" and s == 0)
        input_backward = a.kind == "I" and s > 0
        if a.kind == "F":
            held += kept[s] + loss_kept[s] + out_u[s] + slot_u[s] + casts.pop(s, 0.0)
            phase = (held, waiting)
        elif full_backward:  # a backward sweeps the stage
            if local:
                own = max(loss_phase[s], logits_grad[s] + crossing[s] + max(wgrad[s], full_sweep[s]))
            else:
                own = crossing[s] + max(stage_temps[s] + wgrad[s], full_sweep[s])
            phase = (held + sweep[s], waiting + own)
        elif input_backward:
            phase = (held + sweep[s], waiting + max(stage_temps[s], grad_sweep[s]))
        elif a.kind == "I":
            phase = (held, waiting)
        else:
            # stage_backward_weight asks autograd for one parameter group's gradients at a time (the
            # parameters sharing a graph node: a convolution's weight, a norm's weight and bias) and
            # adds them into .grad: the fresh group, about the stage's largest parameter, is the
            # transient (MemTracker: 7.9 MiB on the last resnet50 stage, whose largest weight is 9 MiB).
            phase = (held, waiting + wgrad[s])
        if sum(phase) > sum(best):
            best = phase
        if full_backward or input_backward:  # the stage's first backward of this micro-batch
            held -= loss_kept[s]
        if a.kind == "I":
            waiting += pending[s]
        elif a.kind == "B":
            waiting += in_u[s]
            if slots:  # this backward's input gradient, until its send is waited
                waiting += in_b[s] - (0.0 if gpipe else sent_grads)
                sent_grads = in_b[s]
        if a.kind == ("W" if split else "B"):
            held -= kept[s]
            if split:
                waiting -= pending[s] - in_u[s]
    return MemoryBreakdown(params_bytes=params, grads_bytes=grads, optim_bytes=optim,
                           activations_bytes=int(best[0]), other_bytes=int(best[1]))


def replicas_memory(cost: CostModel, schedule: str, n_ranks: int, boundaries: Sequence[int], m: int,
                    micros: Sequence[int], precision: str, ckpt: int) -> tuple[MemoryBreakdown, ...]:
    """`rank_memory` of every rank of data-parallel replicas of one pipeline of `n_ranks` ranks,
    replica by replica (replica i's micro-batches hold `micros[i]` samples)."""
    acts = rank_actions(schedule, n_ranks, m, (len(boundaries) - 1) // max(1, n_ranks))
    return tuple(rank_memory(cost, acts[k % n_ranks], boundaries, micros[k // n_ranks], precision, ckpt, schedule)
                 for k in range(n_ranks * len(micros)))
