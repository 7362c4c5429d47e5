"""Tensor-parallel plan arithmetic, without torch: the transformer's sizes, which heads and hidden
units each rank holds, the shard solver, tensor groups, and a rank's share of a layer's time.

A transformer layer runs as two segments between all-reduces (Megatron's split): the attention
segment (ln1, qkv, attention, the local part of proj) and the MLP segment (ln2, fc, GELU, the local
part of proj).  A rank holding `h` of `H` heads does a fraction h/H of the attention segment's
matmul work and of its softmax; a rank holding `u` of `U` hidden units does u/U of the MLP's.  The
norms and residual adds (`REPLICATED_SHARE` of a layer's time) run in full on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetsim.errors import InfeasiblePlanError
from hetsim.model.batchsplit import min_max_split
from hetsim.workloads.transformer import GPT_PRESETS

REPLICATED_SHARE = 0.05
"""Share of a layer's time that tensor parallelism does not split (LayerNorms, residual adds,
bias adds of the row-parallel outputs).  An estimate, not a measurement: elementwise work over
d_model per token against ~24 d_model^2 + 4 seq d_model matmul flops per token is a few percent
by flops, more where elementwise ops run at memory bandwidth.  Timing one gpt@tiny layer at full,
half and quarter width on the shared 2-core host (load ~16) was too noisy to fit it (it gave
negative shares); the calibration of a real tp run would be the place to measure it."""
HIDDEN_GRANULE = 8
"""MLP hidden units are split in multiples of this (whole SIMD vectors; any split is exact)."""


@dataclass(frozen=True, slots=True)
class TransformerDims:
    """What tensor parallelism needs to know about a GPT-style model."""

    n_layer: int
    n_head: int
    d_model: int
    hidden: int
    seq_len: int
    layer_blocks: tuple[int, ...]
    """Indices of the transformer layers among the model's blocks (the others are replicated)."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def attn_share(self) -> float:
        """The attention segment's share of a layer's matmul flops (per token: qkv 6d^2, proj 2d^2,
        scores and weighted sum 4 t d; the MLP 4 d hidden)."""
        d, t = self.d_model, self.seq_len
        attn = 8 * d * d + 4 * t * d
        return attn / (attn + 4 * d * self.hidden)

    def activation_bytes(self, micro_batch: int) -> int:
        """fp32 bytes of one all-reduced activation (micro_batch x seq x d_model)."""
        return 4 * micro_batch * self.seq_len * self.d_model


def dims_from_spec(spec: str, block_names: Sequence[str]) -> TransformerDims | None:
    """The sizes of a `gpt@PRESET[@SEQ]` workload from its spec (None for any other model)."""
    m = re.fullmatch(r"gpt@(\w+)(?:@(\d+))?", spec or "")
    if not m or m.group(1) not in GPT_PRESETS:
        return None
    cfg = GPT_PRESETS[m.group(1)]
    seq = int(m.group(2)) if m.group(2) else cfg.seq_len
    layers = tuple(i for i, n in enumerate(block_names) if re.fullmatch(r"layer\d+", n))
    if len(layers) != cfg.n_layer:
        return None
    return TransformerDims(n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
                           hidden=cfg.mlp_ratio * cfg.d_model, seq_len=seq, layer_blocks=layers)


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each rank's slice: [0, s0, s0 + s1, ...]."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def qkv_rows(dims: TransformerDims, heads: Sequence[int], position: int) -> list[int]:
    """Rows of the full qkv weight that rank `position` holds: q, k and v of its own heads, in that
    order (the model lays qkv's output out as [q of all heads | k of all heads | v of all heads],
    so a rank's heads are three separate runs of rows)."""
    lo = offsets(heads)[position] * dims.head_dim
    hi = lo + heads[position] * dims.head_dim
    d = dims.d_model
    return [part * d + u for part in range(3) for u in range(lo, hi)]


def unit_range(sizes: Sequence[int], position: int, unit: int = 1) -> range:
    lo = offsets(sizes)[position] * unit
    return range(lo, lo + sizes[position] * unit)


def shard_split(total: int, speeds: Sequence[float], *, granule: int = 1, fits: Callable[[int, int], bool]
                | None = None) -> tuple[int, ...]:
    """Split `total` units (in multiples of `granule`) over positions of relative speed `speeds` to
    minimise the slowest position's time units/speed, every position getting at least one granule:
    hetsim.model.batchsplit.min_max_split over granules.  `fits(position, units)` bounds a position
    by its memory; when the bounds leave units over, no split fits."""
    n = len(speeds)
    granules = total // granule
    if granules < n or total % granule:
        raise InfeasiblePlanError(f"cannot split {total} units in multiples of {granule} over {n} ranks, at "
                                  "least one each; use fewer ranks in the tensor group")
    room = (lambda i, u: fits(i, u * granule)) if fits is not None else (lambda i, u: True)
    units = min_max_split(n, granules, 1, lambda i, u: u / speeds[i], room)
    over = [i for i, u in enumerate(units) if u > 1 and not room(i, u)]
    if over:
        raise InfeasiblePlanError(f"the tensor group's memory cannot hold {total} units; use more or larger devices")
    return tuple(u * granule for u in units)


def even_split(total: int, n: int, granule: int = 1) -> tuple[int, ...]:
    """DTensor's split: equal shards (only when `total` divides evenly; else the first ones larger)."""
    g, rem = divmod(total // granule, n)
    return tuple((g + (1 if i < rem else 0)) * granule for i in range(n))


def tensor_groups(devices: Sequence[int], tp: int, speeds: Sequence[float], link_bps: Callable[[int, int], float],
                  grouping: str) -> tuple[tuple[int, ...], ...]:
    """Split `devices` into len/tp tensor groups of `tp` devices.

    'fast_links': greedy, fast links first: each group starts from the fastest device left and
    adds the device with the fastest link to the group's members (ties: the fastest device, then
    the lowest index), so a group of identical devices forms where links do not differ.
    'strided': group g takes the g-th device of each speed tier (devices sorted by speed), so
    every group has the same mix of speeds and proportional shards suit every replica.
    """
    order = sorted(devices, key=lambda d: (-speeds[d], d))
    dp = len(devices) // tp
    if grouping == "strided":
        return tuple(tuple(order[g + dp * j] for j in range(tp)) for g in range(dp))
    left = list(order)
    groups = []
    for _ in range(dp):
        group = [left.pop(0)]
        while len(group) < tp:
            best = max(left, key=lambda d: (min(link_bps(m, d) for m in group), speeds[d], -d))
            left.remove(best)
            group.append(best)
        groups.append(tuple(sorted(group, key=lambda d: (-speeds[d], d))))  # position 0: the fastest
    return tuple(groups)
