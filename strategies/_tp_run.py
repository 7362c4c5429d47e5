"""The real run of a tensor-parallel plan on one rank (family `tp`), Megatron's column/row split.

Every transformer layer's `attn.qkv` and `mlp.fc` are split by output features (heads, hidden
units) and `attn.proj` and `mlp.proj` by input features, so a layer needs one all-reduce after
each row-parallel product in forward and one on the input gradient of each column-parallel
product in backward.  Embedding, LM head and norms are replicated; every rank of a tensor group
sees the same batch.

Two realisations, both PyTorch's own machinery:

- **even shards, one replica**: `torch.distributed.tensor.parallel.parallelize_module` with
  `ColwiseParallel` / `RowwiseParallel` (DTensor `Shard` placements).  DTensor shards a dimension
  in equal contiguous chunks, so the qkv rows are first reordered to put each rank's q, k and v
  rows next to each other (the model's own layout is [q of all heads | k | v]).
- **even shards with sequence parallelism** (`TPPlan.sequence_parallel`): the same, plus torch's own
  `SequenceParallel` norms and `PrepareModuleInput`/`PrepareModuleOutput` conversions, so a layer's
  activations between the tensor-parallel regions are split along the sequence
  (`shard_with_dtensor`).
- **uneven shards, or data-parallel replicas**: DTensor has no placement for an uneven split
  (`Shard(dim)` is always even), so each rank holds its own slice as a plain parameter, cut from
  the full deterministic initialisation, and the two collectives are `torch.distributed.all_reduce`
  inside two small autograd functions (Megatron's f and g).  Replicas of a tensor group train
  under DistributedDataParallel over the process group of the ranks that hold the same shard;
  DDP refuses DTensor parameters (`c10d.broadcast_` has no sharding strategy; with
  `init_sync=False` its reducer mixes Tensor and DTensor), so replicated plans take this path even
  when their shards are even.

Emulated speed: the block-level throttle of other families would spin after a layer's all-reduces,
when the faster ranks have already passed them.  Here a `SyncClock` spins (1/speed - 1) x the
compute since the last collective just before the next one, so a slow rank reaches every
all-reduce late, as a slow GPU would.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from hetsim.errors import InfeasiblePlanError
from hetsim.execution.emulation import Emulator

from ._tp_shards import TransformerDims, dims_from_spec, even_split, offsets, qkv_rows, unit_range
from .helpers import grads_of_one_pass, own_micro_batches, train_step


class SyncClock:
    """Emulated speed of a tensor-parallel rank: throttle the compute since the last collective
    just before the next one."""

    def __init__(self, emulator: Emulator | None):
        self.emulator = emulator
        self.last = time.perf_counter()

    def before_collective(self) -> None:
        if self.emulator is not None:
            self.emulator.throttle(time.perf_counter() - self.last)

    def after_collective(self) -> None:
        self.last = time.perf_counter()


class _CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the input gradient in backward."""

    @staticmethod
    def forward(ctx, x, group, clock):
        ctx.group, ctx.clock = group, clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.clock.before_collective()
        dist.all_reduce(grad, group=ctx.group)
        ctx.clock.after_collective()
        return grad, None, None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: all-reduce of the partial outputs in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group, clock):
        out = x.contiguous().clone()
        clock.before_collective()
        dist.all_reduce(out, group=group)
        clock.after_collective()
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class ColumnShard(nn.Module):
    """Rows `rows` of a Linear (its output features): this rank's slice, input gradient all-reduced."""

    def __init__(self, full: nn.Linear, rows: list[int], group, clock: SyncClock):
        super().__init__()
        idx = torch.tensor(rows)
        self.weight = nn.Parameter(full.weight.detach()[idx].clone())
        self.bias = nn.Parameter(full.bias.detach()[idx].clone())
        self.group, self.clock = group, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToGroup.apply(x, self.group, self.clock), self.weight, self.bias)


class RowShard(nn.Module):
    """Columns `cols` of a Linear (its input features); partial outputs all-reduced, bias added once."""

    def __init__(self, full: nn.Linear, cols: list[int], group, clock: SyncClock):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[:, torch.tensor(cols)].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.group, self.clock = group, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromGroup.apply(F.linear(x, self.weight), self.group, self.clock) + self.bias


ShardIndex = dict[str, tuple[int, list[int], tuple[int, ...]]]
"""Parameter name -> (sharded dimension, indices this rank holds, full shape)."""


def shard_locally(model: nn.Module, dims: TransformerDims, heads, hidden, position: int, group,
                  clock: SyncClock) -> ShardIndex:
    """Replace each layer's four Linears by this rank's slices; say which slice of what it holds."""
    index: ShardIndex = {}
    names = [n for n, _ in model.named_children()]
    cols = list(unit_range(heads, position, dims.head_dim))
    units = list(unit_range(hidden, position))
    for k in dims.layer_blocks:
        block = getattr(model, names[k])
        for attr, parent, kind, idx in (("qkv", block.attn, "col", qkv_rows(dims, heads, position)),
                                        ("proj", block.attn, "row", cols), ("fc", block.mlp, "col", units),
                                        ("proj", block.mlp, "row", units)):
            full = getattr(parent, attr)
            shard = (ColumnShard if kind == "col" else RowShard)(full, idx, group, clock)
            setattr(parent, attr, shard)
            prefix = f"{names[k]}.{'attn' if parent is block.attn else 'mlp'}.{attr}"
            index[f"{prefix}.weight"] = (0 if kind == "col" else 1, idx, tuple(full.weight.shape))
            if kind == "col":
                index[f"{prefix}.bias"] = (0, idx, tuple(full.bias.shape))
    return index


def shard_with_dtensor(model: nn.Module, dims: TransformerDims, mesh, clock: SyncClock,
                       sequence_parallel: bool = False) -> list[int]:
    """Even shards through parallelize_module; returns the qkv row order it applied (to undo in grads).

    With `sequence_parallel`, Megatron's sequence parallelism as torch composes it: between the
    tensor-parallel regions every layer's activations are split along the sequence (`Shard(1)`), the
    norms run on their own tokens (`SequenceParallel`), each region's input is all-gathered
    (`PrepareModuleInput` Shard(1) -> Replicate) and its output reduce-scattered
    (`RowwiseParallel(output_layouts=Shard(1))`); the first layer's input is split and the last
    layer's output gathered again for the replicated head."""
    tp = mesh.size()
    heads = even_split(dims.n_head, tp)
    perm = [r for j in range(tp) for r in qkv_rows(dims, heads, j)]
    names = [n for n, _ in model.named_children()]
    for k in dims.layer_blocks:
        block = getattr(model, names[k])
        with torch.no_grad():
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[perm])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[perm])
        if sequence_parallel:
            _sequence_parallel_layer(block, mesh, clock)
            continue
        # Hooks registered before parallelize_module run before its own (the output all-reduce,
        # the input conversion); those registered after, after them.
        for row in (block.attn.proj, block.mlp.proj):
            row.register_forward_hook(lambda m, a, o: clock.before_collective())
        for col in (block.attn.qkv, block.mlp.fc):
            col.register_forward_pre_hook(_after_input_grad_reduce(clock))
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
        for row in (block.attn.proj, block.mlp.proj):
            row.register_forward_hook(lambda m, a, o: clock.after_collective())
        for col in (block.attn.qkv, block.mlp.fc):
            col.register_forward_pre_hook(_before_input_grad_reduce(clock))
    if sequence_parallel:
        first, last = (getattr(model, names[k]) for k in (dims.layer_blocks[0], dims.layer_blocks[-1]))
        parallelize_module(first, mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(Shard(1),), use_local_output=True))
        last.register_forward_hook(lambda m, a, o: clock.before_collective())
        parallelize_module(last, mesh, PrepareModuleOutput(output_layouts=(Shard(1),),
                                                           desired_output_layouts=(Replicate(),), use_local_output=True))
        last.register_forward_hook(lambda m, a, o: clock.after_collective())
    return perm


def _sequence_parallel_layer(block: nn.Module, mesh, clock: SyncClock) -> None:
    """One layer under sequence parallelism, with the clock's marks around its eight collectives:
    forward, the all-gather at each region's input and the reduce-scatter at its output; backward,
    the all-gather of the output's gradient and the reduce-scatter of the input's."""
    regions = (block.attn, block.mlp)
    rows = (block.attn.proj, block.mlp.proj)
    for region in regions:  # before the conversion: forward all-gather; backward, after the reduce-scatter
        region.register_forward_pre_hook(lambda m, a: clock.before_collective())
        region.register_forward_pre_hook(_after_input_grad_reduce(clock))
    for row in rows:  # before the reduce-scatter: forward mark; backward, after the gradient's all-gather
        row.register_forward_hook(lambda m, a, o: clock.before_collective())
        row.register_forward_hook(_on_output_grad(clock.after_collective))
    parallelize_module(block, mesh, {
        "ln1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    })
    for region in regions:
        region.register_forward_pre_hook(lambda m, a: clock.after_collective())
        region.register_forward_pre_hook(_before_input_grad_reduce(clock))
    for row in rows:
        row.register_forward_hook(lambda m, a, o: clock.after_collective())
        row.register_forward_hook(_on_output_grad(clock.before_collective))


def _on_output_grad(mark):
    def hook(mod, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: mark())
    return hook


def _after_input_grad_reduce(clock: SyncClock):
    def hook(mod, args):
        x = args[0]
        if x.requires_grad:
            x.register_hook(lambda g: clock.after_collective())
    return hook


def _before_input_grad_reduce(clock: SyncClock):
    def hook(mod, args):
        x = args[0]  # the DTensor parallelize_module made of the input
        if x.requires_grad:
            x.register_hook(lambda g: clock.before_collective())
    return hook


def assemble_full(grads: dict[str, torch.Tensor], index: ShardIndex, group) -> dict[str, torch.Tensor]:
    """Full gradients from every rank's slices: each rank writes its slice into zeros, then a sum."""
    out = dict(grads)
    for name in sorted(index):
        dim, idx, shape = index[name]
        full = torch.zeros(shape, dtype=grads[name].dtype)
        full.index_copy_(dim, torch.tensor(idx), grads[name])
        dist.all_reduce(full, group=group)
        out[name] = full
    return out


def unpermute_qkv(grads: dict[str, torch.Tensor], dims: TransformerDims, names: list[str], perm: list[int]):
    out = dict(grads)
    p = torch.tensor(perm)
    for k in dims.layer_blocks:
        for what in ("weight", "bias"):
            name = f"{names[k]}.attn.qkv.{what}"
            g = torch.empty_like(grads[name])
            g[p] = grads[name]
            out[name] = g
    return out


class TPExecutor:
    """One rank of a plan of data-parallel replicas of tensor groups (rank = replica x tp + position)."""

    def __init__(self, plan, ctx):
        self.plan, self.ctx = plan, ctx
        self.model = ctx.workload.model().to(ctx.device)
        self.names = [n for n, _ in self.model.named_children()]
        dims = dims_from_spec(ctx.workload.spec, self.names)
        if dims is None:
            raise InfeasiblePlanError(f"tensor parallelism needs a gpt workload, not {ctx.workload.spec!r}")
        self.dims = dims
        tp, dp = plan.tp_size, len(plan.local_batch)
        mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        self.tp_group = mesh["tp"].get_group()
        position, replica = ctx.rank % tp, ctx.rank // tp
        self.clock = SyncClock(ctx.emulator)
        self.index: ShardIndex = {}
        self.perm: list[int] | None = None
        if plan.dtensor:
            self.perm = shard_with_dtensor(self.model, dims, mesh["tp"], self.clock, plan.sequence_parallel)
        else:
            self.index = shard_locally(self.model, dims, plan.heads, plan.hidden, position, self.tp_group, self.clock)
        self.ddp = None
        if dp > 1:
            self.ddp = DistributedDataParallel(self.model, process_group=mesh["dp"].get_group())
        self.opt = ctx.workload.make_optimizer(self.model.parameters())
        if ctx.emulator is not None:
            ctx.emulator.wrap_optimizer(self.opt)
        x, y = ctx.workload.make_batch(plan.global_batch, ctx.seed)
        lo = offsets(plan.local_batch)[replica]
        hi = lo + plan.local_batch[replica]
        sizes = even_split(hi - lo, plan.accum_steps)
        self.micro = own_micro_batches(x, y, lo, hi, sizes, ctx.device)
        # DDP averages over replicas: scale each replica's loss sum by dp / global batch.
        self.scale = dp / plan.global_batch

    def _forward_backward(self) -> float:
        total = 0.0
        module = self.ddp or self.model
        for j, (x, y) in enumerate(self.micro):
            last = j == len(self.micro) - 1
            with self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext():
                self.clock.after_collective()  # the step starts here
                loss = self.ctx.workload.loss_sum(module(x).float(), y) * self.scale
                loss.backward()
                self.clock.before_collective()  # throttle the tail of backward (embedding, last segment)
                self.clock.after_collective()
            total += float(loss.detach())
        return total

    def step(self) -> float:
        return train_step(self.opt, self._forward_backward)

    def compute_grads(self) -> dict[str, torch.Tensor]:
        grads = grads_of_one_pass(self.opt, self._forward_backward, [self.model])
        if self.perm is not None:
            return unpermute_qkv(grads, self.dims, self.names, self.perm)
        return assemble_full(grads, self.index, self.tp_group)
