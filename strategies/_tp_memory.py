"""Peak memory of a tensor-parallel rank (family `tp`): the whole model's data-parallel peak with the
rank's own parameter state, the layers' saved activations cut to its shard (less with sequence
parallelism), and the replicated head's loss tensors whole; `sharded_act_factor` is shared with the
PP x TP stages (`_tp_pipeline.pipeline_memory`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetsim.model.memory import data_parallel_memory, loss_temporaries_bytes
from hetsim.types import MemoryBreakdown

from ._tp_pipeline import position_params
from ._tp_shards import TransformerDims

if TYPE_CHECKING:
    from hetsim.model.costmodel import CostModel

    from .tp import TPPlan

REPLICATED_ACT_SHARE = 0.25
"""Share of a layer's saved activations that every rank keeps in full, by count: per token a GPT
layer saves about 16 d_model (the norms' inputs and outputs, qkv's output 3, attention's output,
proj's input, the residual, fc's and GELU's outputs 4 each); the norms' inputs and outputs (4 of
them) are replicated, the rest is split with the heads and units.  Measured against it (gpt@tiny@64,
uneven tp2 heads 3/1 and its even counterpart, with TP_LOSS_COPIES): 0.0-0.2 % per rank (with 0.3
and the loss's temporaries scaled by the rank's share: +3.6 / -13.5 / -4.0 %)."""
TP_LOSS_COPIES = 3
"""Tensors of the logits' size that a tensor-parallel rank holds at its peak: the replicated head
computes the whole loss on every rank, whatever its shard, so they are not split.  Three of the four
that a whole step's calibrated temporaries hold (`hetsim.model.memory.LOSS_TEMP_COPIES`), fitted:
MemTracker measured 32 MiB of temporaries on every rank of the pair above (two copies) and the third
among its activations."""
SP_GATHERED_SHARE = 0.5
"""Of that replicated share, what a rank still keeps in full under sequence parallelism: the
all-gathered inputs of qkv and fc, which their matmuls save for backward (the norms' outputs, 2 of
the 4 replicated per token); the norms' inputs are split along the sequence.  Measured: DTensor's
sequence parallelism lowered the peak by 4.0 MiB at micro-batch 32 and 2.0 at 16 on gpt@tiny@64 over
two ranks, as this count says."""


def sharded_act_factor(cost: CostModel, dims: TransformerDims, heads: int, hidden: int, lo: int, hi: int,
                       mb: int, seq_split: int = 1) -> float:
    """The share of blocks lo..hi's saved activations a rank keeps with `heads` heads and `hidden`
    units of every layer: the layers' share of those activations is cut to the rank's fraction,
    except REPLICATED_ACT_SHARE of it that every rank keeps in full (with sequence parallelism over
    `seq_split` ranks, all but SP_GATHERED_SHARE of that split along the sequence)."""
    frac = dims.attn_share * heads / dims.n_head + (1 - dims.attn_share) * hidden / dims.hidden
    total = cost.act_bytes(lo, hi, mb) or 1
    layers = sum(cost.act_bytes(k, k + 1, mb) for k in dims.layer_blocks if lo <= k < hi) / total
    kept = REPLICATED_ACT_SHARE * (SP_GATHERED_SHARE + (1 - SP_GATHERED_SHARE) / seq_split if seq_split > 1 else 1.0)
    return 1.0 - min(1.0, layers) * (1 - kept - (1 - REPLICATED_ACT_SHARE) * frac)


def tp_memory(plan: TPPlan, cost: CostModel, dims: TransformerDims) -> tuple[MemoryBreakdown, ...]:
    """Per rank: the data-parallel model of the whole model, with its parameter state scaled to the
    rank's own parameters and the layers' sharded activations to its share."""
    n = cost.facts.n_blocks
    full = cost.param_count()
    out = []
    for r, d in enumerate(plan.devices):
        p, gi = r % plan.tp_size, r // plan.tp_size
        mb = -(-plan.local_batch[gi] // plan.accum_steps)
        base = data_parallel_memory(cost, d, mb, "fp32", 0)
        share = position_params(cost, dims, plan.heads[p], plan.hidden[p]) / full
        act = sharded_act_factor(cost, dims, plan.heads[p], plan.hidden[p], 0, n, mb,
                                 plan.tp_size if plan.sequence_parallel else 1)
        loss = min(base.other_bytes, loss_temporaries_bytes(cost, mb))
        kept = loss_temporaries_bytes(cost, mb, TP_LOSS_COPIES) if loss > 0 else 0.0
        out.append(MemoryBreakdown(params_bytes=int(base.params_bytes * share), grads_bytes=int(base.grads_bytes * share),
                                   optim_bytes=int(base.optim_bytes * share),
                                   activations_bytes=int(base.activations_bytes * act),
                                   other_bytes=int(kept + (base.other_bytes - loss) * (share if plan.dp > 1 else act))))
    return tuple(out)
