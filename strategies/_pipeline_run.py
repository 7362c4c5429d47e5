"""Real execution of a pipeline (or data-parallel replicas of one) with torch.distributed.pipelining.

Each rank builds the full model with its deterministic initial weights, keeps the
blocks of its stage(s) as `nn.Sequential`s named like the unwrapped model (so its
gradients compare by name with a single-process run), and hands them to torch's
`PipelineStage` and schedule class.

Loss scaling: the schedule is built with `scale_grads=False` and each micro-batch's
loss is `loss_sum / global_batch`, so a replica's accumulated gradient is its share of
the full-batch mean-loss gradient.  With replicas, each rank then sums its stages'
gradients over the process group of the ranks holding the same stages (one coalesced
all-reduce).  DistributedDataParallel on the stage modules was tried and is not used:
without `static_graph` its bucket rebuild after the first step counts every parameter
once per micro-batch and fails on the second step when m > 1 ("rebuilt parameter indices
size is not same as original model parameters size"); with `static_graph=True` the last
stage's gradients came out wrong (relative error 1.3) on 2 replicas x 2 stages (torch 2.14).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetsim.execution.memtrack import measure_step, peak_breakdown

from ._contrastive import pipeline_loss
from ._pipeline_sched import ZERO_BUBBLE, rank_stages
from .helpers import (
    apply_checkpointing,
    autocast,
    grads_of_one_pass,
    own_micro_batches,
    scaled_loss,
    train_step,
)

SMALL_GRAD_BYTES = 1 << 20
"""Gradients below 1 MiB are summed across replicas as one flat tensor (`_sum_grads_over_replicas`):
gpt@tiny's 50-odd gradients, all of them small, cost one collective instead of 50-odd."""


class _CategoryTotalsOnly:
    """Stands in for MemTracker's module tracker: no per-module hooks, backward told by autograd.

    MemTracker attributes memory to modules through global module hooks that refuse a module
    called once per micro-batch with backwards in between (interleaved schedules) and that break
    under the `autograd.grad` of zero-bubble schedules.  Its category totals (parameters,
    gradients, optimizer state, activations, temporaries) need none of that.
    """

    parents: frozenset = frozenset()

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, mod):
        return None

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        pass


class _Detach(nn.Module):
    """Ends a stage whose output would be a view: torch's zero-bubble schedules refuse views."""

    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        return x.clone(memory_format=torch.contiguous_format) if x._is_view() else x.contiguous()


class _Contiguous(nn.Module):
    """Ends a stage whose output is not contiguous (torchvision's ViT encoder layers hand on a
    permuted layout from MultiheadAttention): the stage send refuses it."""

    def forward(self, x):
        return x.contiguous() if isinstance(x, torch.Tensor) else x


class _ContiguousInputGrad(torch.autograd.Function):
    """Identity; the gradient it hands back is contiguous.  An nn.LSTM with batch_first gives its
    input a transposed gradient, which the stage's backward send refuses ('input tensor has to be
    contiguous', gloo)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _StageInput(nn.Module):
    """Begins every stage after the first: `_ContiguousInputGrad` on its input."""

    def forward(self, x):
        return _ContiguousInputGrad.apply(x) if isinstance(x, torch.Tensor) and x.requires_grad else x


def _process_groups(n_rep: int, P: int, replica: int, prank: int):
    """(this replica's pipeline group, the group of ranks holding this rank's stages); both None
    without replicas.  Every rank creates every group, in the same order (dist.new_group is collective)."""
    pp_group = None
    dp_group = None
    if n_rep > 1:
        for i in range(n_rep):
            grp = dist.new_group(list(range(i * P, (i + 1) * P)))
            if i == replica:
                pp_group = grp
        for r in range(P):
            grp = dist.new_group([i * P + r for i in range(n_rep)])
            if r == prank:
                dp_group = grp
    return pp_group, dp_group


class PipelineExecutor:
    """One rank of a pipeline, or of data-parallel replicas of one (rank = replica x P + pipeline rank).

    Subclasses place more than one rank on a stage (`_tp_pipeline_run`: a tensor group per stage)
    through `ranks_per_stage`, `_layout`, `_full_model` and `_emulate`."""

    ranks_per_stage = 1

    def __init__(self, ctx, *, schedule: str, boundaries: Sequence[int], microbatches: int, precision: str,
                 checkpoint_blocks: int, replica_batches: Sequence[int], pipeline_ranks: int):
        self.ctx = ctx
        self.precision = precision
        wl = ctx.workload
        n_rep = len(replica_batches)
        P = pipeline_ranks
        if n_rep * P * self.ranks_per_stage != ctx.world_size:
            raise ValueError(f"replicas({n_rep}) * pipeline ranks({P}) * ranks per stage({self.ranks_per_stage}) "
                             f"!= WORLD_SIZE({ctx.world_size})")
        n_stages = len(boundaries) - 1
        v = n_stages // P
        replica, prank, pp_group, dp_group = self._layout(n_rep, P)

        self.stage_ids = rank_stages(schedule, P, v, prank)
        stages = self._build_stages(schedule, boundaries, checkpoint_blocks, pp_group)
        self.model = nn.ModuleList(self.seqs)
        self.opt = wl.make_optimizer([p for seq in self.seqs for p in seq.parameters()])
        if ctx.emulator is not None:
            ctx.emulator.wrap_optimizer(self.opt)

        gb = sum(replica_batches)
        self.scale = 1.0 / gb
        self._build_schedule(schedule, stages[0] if v == 1 else stages, microbatches, replica_batches, dp_group)

        x, y = wl.make_batch(gb, ctx.seed)
        lo = sum(replica_batches[:replica])
        hi = lo + replica_batches[replica]
        self.is_first = 0 in self.stage_ids
        self.is_last = (n_stages - 1) in self.stage_ids
        [(self.x, self.y)] = own_micro_batches(x, y, lo, hi, [hi - lo], ctx.device)  # the schedule splits it
        self.dp_group = dp_group

    def _layout(self, n_rep: int, P: int):
        """(replica, pipeline rank, pipeline process group, replica process group) of this rank."""
        replica, prank = divmod(self.ctx.rank, P)
        return (replica, prank, *_process_groups(n_rep, P, replica, prank))

    def _full_model(self) -> nn.Module:
        """The whole model with its deterministic initial weights, whose blocks the stages take."""
        return self.ctx.workload.model()

    def _emulate(self, seq: nn.Sequential, stage: int, n_stages: int) -> None:
        """Emulated speed: every block of the stage throttled after its forward and its backward."""
        if self.ctx.emulator is not None:
            self.ctx.emulator.attach(list(seq.children()))

    def _build_stages(self, schedule: str, boundaries: Sequence[int], checkpoint_blocks: int, pp_group) -> list:
        """This rank's stages (self.stage_ids) as `nn.Sequential`s of the full model's blocks, kept in
        self.seqs, and wrapped as torch `PipelineStage`s (returned)."""
        from torch.distributed.pipelining import PipelineStage

        ctx = self.ctx
        n_stages = len(boundaries) - 1
        full = self._full_model()
        names = [n for n, _ in full.named_children()]
        mods = dict(full.named_children())
        self.seqs: list[nn.Sequential] = []
        stages = []
        for s in self.stage_ids:
            lo, hi = boundaries[s], boundaries[s + 1]
            seq = nn.Sequential(OrderedDict((n, mods[n]) for n in names[lo:hi]))
            self._emulate(seq, s, n_stages)
            apply_checkpointing(seq, max(0, min(hi, checkpoint_blocks) - lo))
            seq.to(ctx.device)
            self.seqs.append(seq)
            end = _Detach() if schedule in ZERO_BUBBLE else _Contiguous()
            parts = [("stage", seq), ("detach", end)]
            sub: nn.Module = nn.Sequential(OrderedDict(([("input", _StageInput())] if s > 0 else []) + parts))
            stages.append(PipelineStage(sub, s, n_stages, ctx.device, group=pp_group))
        return stages

    def _build_schedule(self, schedule: str, stages, microbatches: int, replica_batches: Sequence[int],
                        dp_group) -> None:
        """torch's schedule class over `stages`, its loss each micro-batch's sum times self.scale."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        wl = self.ctx.workload

        def loss_fn(out, y):
            return scaled_loss(self.ctx, out, y, self.scale)

        if wl.batch_coupled:  # one micro-batch per replica (pipeline.check_common): the global batch's loss
            loss_fn = pipeline_loss(wl, replica_batches, dp_group, 1.0)

        cls = get_schedule_class(schedule)
        kw = {"loss_fn": loss_fn}
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            kw["scale_grads"] = False  # the loss already carries 1/global_batch (older torch never scaled)
        self.schedule = cls(stages, microbatches, **kw)
        self._step_kw = {}
        if "return_outputs" in inspect.signature(self.schedule.step).parameters:
            self._step_kw["return_outputs"] = False

    def load_batch(self, x, y, global_size: int) -> None:
        """Train on this replica's samples (x, y) of a global batch of `global_size` next (hetsim.search.train);
        every rank of a replica gets the same samples (the first stage reads x, the last y)."""
        self.x, self.y = x.to(self.ctx.device), y.to(self.ctx.device)
        self.scale = 1.0 / global_size

    def _forward_backward(self) -> float | None:
        args = (self.x,) if self.is_first else ()
        kw = dict(self._step_kw)
        losses: list[torch.Tensor] = []
        if self.is_last:
            kw.update(target=self.y, losses=losses)
        with autocast(self.ctx.device, self.precision):
            self.schedule.step(*args, **kw)
        if self.dp_group is not None:
            self._sum_grads_over_replicas()
        if not self.is_last:
            return None
        # Each micro-batch loss carries 1/global_batch: this is the replica's share of the mean loss.
        return float(sum(float(v.detach()) for v in losses))

    def _sum_grads_over_replicas(self) -> None:
        """All-reduce this rank's gradients over the ranks holding the same stages, in place: the
        gradients under SMALL_GRAD_BYTES as one flat tensor per dtype, each larger one on its own, all
        in flight at once.  One all-reduce per gradient paid gloo's per-collective latency once per
        tensor; flattening everything cost more copying than it saved (resnet18's 62 gradients,
        46.8 MB, gloo, two processes: 30 ms for the all-reduce of one flat tensor, 66-70 ms with the
        concatenation and the copies back, 42-47 ms for the per-gradient all-reduces)."""
        params = [p for seq in self.seqs for p in seq.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # every replica must contribute the same tensors
                p.grad = torch.zeros_like(p)
        small: dict[torch.dtype, list[torch.Tensor]] = {}
        large = []
        for p in params:
            if p.grad.numel() * p.grad.element_size() < SMALL_GRAD_BYTES:
                small.setdefault(p.grad.dtype, []).append(p.grad)
            else:
                large.append(p.grad)
        flats = [(torch.cat([g.reshape(-1) for g in gs]), gs) for gs in small.values()]
        works = [dist.all_reduce(flat, group=self.dp_group, async_op=True) for flat, _ in flats]
        works += [dist.all_reduce(g, group=self.dp_group, async_op=True) for g in large]
        for work in works:
            work.wait()
        for flat, gs in flats:
            offset = 0
            for g in gs:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def measure_memory(self, fn):
        """Peak tensor bytes of one step by category (the worker calls this instead of measure_step)."""

        if self.ctx.device.type == "cuda":
            return measure_step(fn, self.model, self.opt, self.ctx.device)
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        if not hasattr(mt, "_mod_tracker"):  # a torch whose MemTracker is built differently
            return measure_step(fn, self.model, self.opt, self.ctx.device)
        mt._mod_tracker = _CategoryTotalsOnly()
        mt.track_external(self.model, self.opt)
        with mt:
            fn()
        return peak_breakdown(mt)

    def step(self) -> float | None:
        return train_step(self.opt, self._forward_backward)

    def compute_grads(self) -> dict[str, torch.Tensor]:
        return grads_of_one_pass(self.opt, self._forward_backward, self.seqs)
