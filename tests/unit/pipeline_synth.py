"""A synthetic cost model for pipeline unit tests: block times and sizes chosen by the test."""

from __future__ import annotations

from collections.abc import Sequence

from hetsim.hardware.cluster import parse_cluster
from hetsim.model.costmodel import CostModel
from hetsim.profiling.store import BlockProfile, BlockTiming, CommProfile, ModelProfile, ProfileSet
from hetsim.types import Fit


def synthetic_cost(speeds: Sequence[float], fwd_s: Sequence[float], *, bwd_ratio: float = 2.0,
                   caps: Sequence[str] | None = None, param_counts: Sequence[int] | None = None,
                   act_bytes: Sequence[float] | None = None, out_bytes: Sequence[int] | None = None,
                   p2p_s_per_byte: float = 0.0, opt_s_per_param: float = 0.0) -> CostModel:
    """Blocks with forward time fwd_s[k] per sample (backward bwd_ratio x that) on devices of the given
    relative speeds.  Defaults: no communication cost and no optimizer time."""
    n = len(fwd_s)
    pcs = param_counts or [1000] * n
    acts = act_bytes or [1e4] * n
    outs = out_bytes or [1000] * n
    blocks = tuple(
        BlockProfile(name=f"b{k}", param_count=pcs[k], param_bytes=4 * pcs[k], buffer_bytes=0,
                     timing={"fp32": BlockTiming(fwd_s=Fit(intercept=0.0, slope=fwd_s[k]),
                                                 bwd_s=Fit(intercept=0.0, slope=bwd_ratio * fwd_s[k]))},
                     act_bytes={"fp32": Fit(intercept=0.0, slope=acts[k])}, out_bytes_per_sample=outs[k],
                     flops_per_sample=0.0)
        for k in range(n)
    )
    model = ModelProfile(model="synthetic", device_kind="emu-cpu", fingerprint={}, micro_batches=(1,),
                         blocks=blocks, opt_step_s={"adamw": Fit(intercept=0.0, slope=opt_s_per_param)},
                         step_overhead_s=0.0, input_bytes_per_sample=outs[0])
    caps = caps or ["4G"] * len(speeds)
    cluster = parse_cluster("emu:" + ",".join(f"{s}@{c}" for s, c in zip(speeds, caps)))
    p2p = Fit(intercept=0.0, slope=p2p_s_per_byte)
    comm = {k: CommProfile(backend="gloo", world_size=k, fingerprint={}, allreduce_s=Fit(intercept=0.0, slope=0.0),
                           sendrecv_s=p2p)
            for k in range(2, max(2, len(speeds)) + 1)}
    return CostModel(cluster, ProfileSet(models={"emu-cpu": model}, comm=comm), "adamw")
