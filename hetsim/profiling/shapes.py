"""What a training step of each block computes and moves, from shapes alone (meta tensors, no timing).

A catalog GPU is never measured: its block times come from a roofline
(`hetsim.model.roofline`) that reads, per block and per pass, every aten operator's FLOPs (the
formulas of `torch.utils.flop_counter`) and the bytes it reads and writes (its tensor arguments
and results).  Tracing runs the model on the meta device at two batch sizes, so a catalog question
at 224 px or sequence 512 costs a second or two of Python, never a CPU forward pass.  Both traces
are combined into per-sample and fixed parts (weights are read whatever the batch), so an
operator's cost is known at any micro-batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from hetsim.model.roofline import BlockShapes, ModelShapes, OpCost
from hetsim.profiling.saved import saved_storages, storage_ids
from hetsim.profiling.store import trainable_flags
from hetsim.workloads.builtin import Workload

aten = torch.ops.aten

CONV_OPS = frozenset({aten.convolution, aten._convolution, aten.convolution_backward, aten.cudnn_convolution})
MATMUL_OPS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm})
FREE_OPS = frozenset({aten.detach, aten.alias, aten.lift_fresh, aten.empty, aten.empty_like, aten.zeros,
                      aten.ones, aten.new_empty, aten.new_zeros, aten.empty_strided, aten.new_empty_strided,
                      aten.scalar_tensor, aten._local_scalar_dense, aten.clone})
"""Operators that move no data worth counting (allocations, aliases); clone is counted as a copy below."""
TRACE_BATCHES = (2, 4)
FORMAT = "2"
"""Bump when what a trace records changes meaning, so that kept traces are made again."""


def shapes_fingerprint(spec: str) -> dict[str, str]:
    return {"model": spec, "torch": torch.__version__.split("+")[0], "shapes_format": FORMAT}


def _kind(func, args=()) -> str:
    packet = func._overloadpacket
    if packet in CONV_OPS:
        return "conv3x3" if _winograd_shaped(packet, args) else "conv"
    if packet in MATMUL_OPS:
        return "matmul"
    if "attention" in str(packet):
        return "attn"
    return "mem"


def _winograd_shaped(packet, args) -> bool:
    """A 3x3, stride-1, undilated, ungrouped 2-d convolution: the shape cuDNN's Winograd kernels take.
    `convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)`;
    `convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, ...)`."""
    first = 2 if packet is aten.convolution_backward else 1
    if packet not in (aten.convolution, aten.convolution_backward) or len(args) < first + 8:
        return False
    weight, stride, dilation = args[first], args[first + 2], args[first + 4]
    groups, transposed = args[first + 7], args[first + 5]
    return (isinstance(weight, torch.Tensor) and tuple(weight.shape[2:]) == (3, 3) and not transposed
            and groups == 1 and all(v == 1 for v in stride) and all(v == 1 for v in dilation))


def _nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


class _Recorder(TorchDispatchMode):
    """Records (kind, FLOPs, bytes read + written) of every aten operator that runs under it."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, float, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in FREE_OPS and packet is not aten.clone:
            return out
        if getattr(func, "is_view", False):
            return out
        flops = 0.0
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        moved = sum(_nbytes(t) for t in tree_flatten((args, kwargs))[0]) + sum(_nbytes(t) for t in tree_flatten(out)[0])
        self.ops.append((_kind(func, args), flops, float(moved)))
        return out


class _FusedAttention(TorchFunctionMode):
    """`F.scaled_dot_product_attention` as the fused kernel a GPU runs (memory-efficient attention:
    no materialised score matrix), not the math fallback the meta device would decompose it into."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None and len(args) == 3:
            q, k, v = args
            return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                bool(kwargs.get("is_causal", False)))[0]
        return func(*args, **kwargs)


def _trace_at(model: torch.nn.Module, workload: Workload, batch: int):
    """Per block: (fwd ops, bwd ops, saved bytes, output bytes) at one batch on the meta device."""
    x, _ = workload.make_batch(batch, 0)
    h = torch.empty(x.shape, dtype=x.dtype, device="meta") if x.is_floating_point() else torch.zeros(
        x.shape, dtype=x.dtype, device="meta")
    param_storages = storage_ids(model.parameters())
    rows = []
    for _, blk in model.named_children():
        inp = h.detach().requires_grad_(h.is_floating_point())
        rec_f = _Recorder()
        with _FusedAttention(), rec_f, saved_storages(param_storages) as seen:
            out = blk(inp)
        saved = sum(seen.values())
        rec_b = _Recorder()
        with _FusedAttention(), rec_b:
            out.backward(torch.empty_like(out))
        rows.append((rec_f.ops, rec_b.ops, float(saved), _nbytes(out[:1]) if out.dim() else 4))
        h = out.detach()
    return rows, _nbytes(x[:1]), _whole_saved(model, x)


def _whole_saved(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Distinct bytes the whole model saves for backward (parameters excluded) on the meta device."""
    h = torch.empty(x.shape, dtype=x.dtype, device="meta") if x.is_floating_point() else torch.zeros(
        x.shape, dtype=x.dtype, device="meta")
    with _FusedAttention(), saved_storages(storage_ids(model.parameters())) as seen:
        model(h)
    return float(sum(seen.values()))


def _combine(a: list, b: list, ba: int, bb: int) -> tuple[OpCost, ...]:
    """Per-operator linear coefficients from the same operators traced at batches ba < bb."""
    if len(a) != len(b) or any(x[0] != y[0] for x, y in zip(a, b, strict=False)):
        # The operator sequence changed with the batch: scale the larger trace per sample.
        return tuple(OpCost(k, f / bb, 0.0, m / bb) for k, f, m in b)
    out = []
    for (k, _fa, ma), (_, fb, mb_) in zip(a, b, strict=True):
        per = max(0.0, (mb_ - ma) / (bb - ba))
        fixed = max(0.0, ma - per * ba)
        out.append(OpCost(k, fb / bb, fixed, per))
    return tuple(out)


def trace(workload: Workload) -> ModelShapes:
    """The workload's operators, parameters and saved activations per block, on the meta device."""
    with torch.device("meta"):
        model = workload.model()
    ba, bb = TRACE_BATCHES
    ra, input_bytes, wa = _trace_at(model, workload, ba)
    rb, _, wb = _trace_at(model, workload, bb)
    blocks = []
    for (name, blk), (fa, ga, sa, _oa), (fb, gb, sb, ob) in zip(model.named_children(), ra, rb, strict=True):
        per = max(0.0, (sb - sa) / (bb - ba))
        blocks.append(BlockShapes(
            name=name, fwd=_combine(fa, fb, ba, bb), bwd=_combine(ga, gb, ba, bb),
            param_count=sum(p.numel() for p in blk.parameters()),
            param_bytes=sum(p.numel() * p.element_size() for p in blk.parameters()),
            buffer_bytes=sum(b.numel() * b.element_size() for b in blk.buffers()),
            param_numels=tuple(p.numel() for p in blk.parameters()), param_trainable=trainable_flags(blk),
            saved_bytes_per_sample=per, saved_bytes_fixed=max(0.0, sa - per * ba), out_bytes_per_sample=ob,
        ))
    return ModelShapes(model=workload.spec, blocks=tuple(blocks), input_bytes_per_sample=input_bytes,
                       whole_saved_per_sample=max(0.0, (wb - wa) / (bb - ba)))
