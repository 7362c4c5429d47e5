"""The real run of a PP x TP plan on one rank: torch.distributed.pipelining stages whose layers are
this rank's tensor-parallel slices (`_tp_run.shard_locally`: Megatron's column/row split, heads
and MLP units as the plan gives them, even or not).

Process groups come from one device mesh (replicas x stages x positions): the tensor group of a
stage, the pipeline group of a position (stage s, position p sends its activations to stage s+1,
position p; every rank of a tensor group holds the same full activation between layers), and the
replica group of a stage's position (gradients summed over replicas after the schedule, as
`hybrid` does).

Emulated speed: a slow rank must reach each of its tensor group's all-reduces late, so the
`SyncClock` of `_tp_run` throttles the compute since the last collective just before the next one,
and a stage's own boundaries are marks too: its forward and backward begin a window (what came
before was waiting for the previous or next stage) and its forward's end and every gradient it
accumulates close one.  The loss stays throttled by the emulator (`Emulator.loss`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hetsim.errors import InfeasiblePlanError

from ._pipeline_run import PipelineExecutor
from ._tp_run import SyncClock, assemble_full, shard_locally
from ._tp_shards import dims_from_spec


def _tick(clock: SyncClock) -> None:
    """Throttle the compute since the last mark, and mark."""
    clock.before_collective()
    clock.after_collective()


class TPPipelineExecutor(PipelineExecutor):
    def __init__(self, plan, ctx):
        self.plan = plan
        self.ranks_per_stage = plan.tp_size
        self.clock = SyncClock(ctx.emulator)
        super().__init__(ctx, schedule=plan.schedule, boundaries=plan.boundaries, microbatches=plan.microbatches,
                         precision=plan.precision, checkpoint_blocks=plan.checkpoint_blocks,
                         replica_batches=plan.local_batch, pipeline_ranks=plan.stages)

    def _layout(self, n_rep: int, P: int):
        t = self.plan.tp_size
        mesh = init_device_mesh(self.ctx.device.type, (n_rep, P, t), mesh_dim_names=("dp", "pp", "tp"))
        self.tp_group = mesh["tp"].get_group()
        self.position = self.ctx.rank % t
        replica, prank = divmod(self.ctx.rank // t, P)
        return replica, prank, mesh["pp"].get_group(), mesh["dp"].get_group() if n_rep > 1 else None

    def _full_model(self) -> nn.Module:
        model = self.ctx.workload.model()
        names = [n for n, _ in model.named_children()]
        dims = dims_from_spec(self.ctx.workload.spec, names)
        if dims is None:
            raise InfeasiblePlanError(f"tensor parallelism needs a gpt workload, not {self.ctx.workload.spec!r}")
        self.index = shard_locally(model, dims, self.plan.heads, self.plan.hidden, self.position, self.tp_group,
                                   self.clock)
        return model

    def _emulate(self, seq: nn.Sequential, stage: int, n_stages: int) -> None:
        if self.ctx.emulator is None:
            return
        clock = self.clock

        def begin_forward(mod, args):
            clock.after_collective()
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:  # the backward's end: the input gradient
                x.register_hook(lambda g: _tick(clock))

        def end_forward(mod, args, out):
            _tick(clock)
            if isinstance(out, torch.Tensor) and out.requires_grad:  # the backward's start
                out.register_hook(lambda g: clock.after_collective())

        seq.register_forward_pre_hook(begin_forward)
        seq.register_forward_hook(end_forward)
        for p in seq.parameters():
            p.register_post_accumulate_grad_hook(lambda p: _tick(clock))

    def compute_grads(self) -> dict[str, torch.Tensor]:
        grads = super().compute_grads()
        return assemble_full(grads, {k: v for k, v in self.index.items() if k in grads}, self.tp_group)
