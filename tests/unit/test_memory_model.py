"""The memory model of the data-parallel families: closed-form model state, sharding, offload."""

from __future__ import annotations

import pytest
from hetsim.strategies.base import SearchContext
from hetsim.strategies.zero import ZeRO, ZeROPlan

from hetsim.errors import InfeasiblePlanError
from hetsim.model.costmodel import CostModel
from hetsim.model.memory import (
    FP32_MASTER,
    LOW_PRECISION_MASTER,
    Sharding,
    data_parallel_memory,
    model_state_bytes,
    zero1_owned_counts,
)

COUNT = 1_000_000
N = 4


def per_param(m) -> tuple[float, float, float, float]:
    return (m.params_bytes / COUNT, m.grads_bytes / COUNT, m.optim_bytes / COUNT, m.host_bytes / COUNT)


@pytest.mark.parametrize(
    "stage, expected",
    [
        (0, (2, 2, 12, 0)),
        (1, (2, 2, 12 / N, 0)),
        (2, (2, 2 / N, 12 / N, 0)),
        (3, (2 / N, 2 / N, 12 / N, 0)),
    ],
)
def test_mixed_precision_adam_zero_paper_layout(stage, expected):
    # 2-byte params and grads, fp32 master + 2 Adam moments in the optimizer: 2 + 2 + 12 bytes.
    m = model_state_bytes(COUNT, optim_states=2, layout=LOW_PRECISION_MASTER, sharding=Sharding.zero_stage(stage, N))
    assert per_param(m) == pytest.approx(expected)


@pytest.mark.parametrize(
    "sharding, expected",
    [
        (Sharding(), (4, 4, 8, 0)),
        (Sharding.zero_stage(1, N), (4, 4, 8 / N, 0)),  # DDP + ZeroRedundancyOptimizer
        (Sharding.fsdp(N), (4 / N, 4 / N, 8 / N, 0)),  # FSDP2, hetsim's ZeRO-2 and ZeRO-3 at rest
        (Sharding.fsdp(N, offload=True), (0, 0, 0, 16 / N)),  # CPUOffloadPolicy: all of it on the host
    ],
)
def test_executor_layout_adam(sharding, expected):
    # What hetsim's executors hold at any precision: fp32 params are the master copy.
    m = model_state_bytes(COUNT, optim_states=2, layout=FP32_MASTER, sharding=sharding)
    assert per_param(m) == pytest.approx(expected)


def test_sgd_momentum_has_one_state():
    m = model_state_bytes(COUNT, optim_states=1, sharding=Sharding.zero_stage(1, N))
    assert per_param(m) == pytest.approx((4, 4, 4 / N, 0))


def test_mixed_precision_totals_agree_when_fully_sharded():
    paper = model_state_bytes(COUNT, optim_states=2, layout=LOW_PRECISION_MASTER, sharding=Sharding.zero_stage(3, N))
    ours = model_state_bytes(COUNT, optim_states=2, layout=FP32_MASTER, sharding=Sharding.fsdp(N))
    assert paper.total_bytes == ours.total_bytes == 16 * COUNT // N


def test_zero1_partition_is_greedy_over_whole_parameters(make_cost):
    cost = make_cost()
    owned = zero1_owned_counts(cost, 2)
    assert sum(owned) == cost.param_count()
    largest = max(n for b in cost.base_profile.blocks for n in b.param_numels)
    assert abs(owned[0] - owned[1]) <= largest


@pytest.mark.parametrize("optimizer, states", [("adamw", 2), ("sgd", 1)])
def test_family_memory_uses_the_closed_forms(make_cost, optimizer, states):
    cost = make_cost(optimizer=optimizer)
    count, buffers = cost.param_count(), cost.buffer_bytes()
    ddp = data_parallel_memory(cost, 0, 4, "fp32", 0)
    assert (ddp.params_bytes, ddp.grads_bytes, ddp.optim_bytes) == (4 * count + buffers, 4 * count, 4 * states * count)
    owned = zero1_owned_counts(cost, 2)
    for r in range(2):
        z1 = data_parallel_memory(cost, r, 4, "fp32", 0, shards=2, zero_stage=1, rank=r)
        assert z1.optim_bytes == 4 * states * owned[r]
        assert z1.grads_bytes == 4 * count
    for stage in (2, 3):
        z = data_parallel_memory(cost, 0, 4, "fp32", 0, shards=2, zero_stage=stage)
        assert z.params_bytes == pytest.approx(4 * count / 2 + buffers, abs=1)
        assert z.grads_bytes == pytest.approx(4 * count / 2, abs=1)
        assert z.optim_bytes == pytest.approx(4 * states * count / 2, abs=1)
        off = data_parallel_memory(cost, 0, 4, "fp32", 0, shards=2, zero_stage=stage, offload=True)
        assert off.host_bytes == pytest.approx((8 + 4 * states) * count / 2, abs=3)
        assert (off.params_bytes, off.grads_bytes, off.optim_bytes) == (buffers, 0, 0)
        # Offload moves state, not the working set: activations and gathered blocks stay on the device.
        assert off.activations_bytes + off.other_bytes == z.activations_bytes + z.other_bytes


def test_working_set_orders(make_cost):
    cost = make_cost()

    def total(**kw):
        return data_parallel_memory(cost, 0, 4, kw.pop("precision", "fp32"), kw.pop("ckpt", 0), shards=2, **kw).total_bytes

    # (ZeRO-3 is not always below ZeRO-2: on a tiny model its re-gathering outweighs the saving.)
    for stage in (1, 2, 3):
        assert total(zero_stage=stage) < total(zero_stage=0)
    assert total(zero_stage=3, offload=True) < total(zero_stage=3)
    assert total(zero_stage=3, ckpt=cost.facts.n_blocks) < total(zero_stage=3)
    # bf16 keeps fp32 state (the master copy) but gathers 2-byte parameters.
    bf = data_parallel_memory(cost, 0, 4, "bf16", 0, shards=2, zero_stage=3)
    fp = data_parallel_memory(cost, 0, 4, "fp32", 0, shards=2, zero_stage=3)
    assert (bf.params_bytes, bf.grads_bytes, bf.optim_bytes) == (fp.params_bytes, fp.grads_bytes, fp.optim_bytes)


def test_memory_grows_with_the_micro_batch(make_cost):
    cost = make_cost()
    for stage in (0, 1, 2, 3):
        sizes = [data_parallel_memory(cost, 0, mb, "fp32", 0, shards=2, zero_stage=stage).total_bytes
                 for mb in (1, 2, 4, 8, 16)]
        assert sizes == sorted(sizes)


def test_profile_has_a_memory_calibration(make_cost):
    cal = make_cost().base_profile.memory
    assert cal is not None and "fp32" in cal.saved_bytes and "fp32" in cal.temp_bytes


# ----------------------------------------------------------------------------- the zero family


def test_examples_cover_every_stage_and_offload(make_cost):
    plans = ZeRO().examples(SearchContext(cost=make_cost(), global_batch=8))
    assert {p.zero_stage for p in plans} == {1, 2, 3}
    assert any(p.offload for p in plans)


def test_label():
    plan = ZeROPlan(devices=(0, 1), local_batch=(5, 3), zero_stage=3, offload=True, precision="bf16")
    assert ZeRO().label(plan) == "zero3 offload 5/3 on dev 0,1 bf16"


def test_validate_refuses_what_cannot_run(make_cost):
    cost = make_cost()
    with pytest.raises(InfeasiblePlanError, match="offload needs zero_stage 2 or 3"):
        ZeRO().validate(ZeROPlan(devices=(0, 1), local_batch=(4, 4), zero_stage=1, offload=True), cost)
    with pytest.raises(InfeasiblePlanError, match="fp16"):
        ZeRO().validate(ZeROPlan(devices=(0, 1), local_batch=(4, 4), precision="fp16"), cost)


def test_space_solves_the_split_with_the_sharded_memory(make_cost):
    optuna = pytest.importorskip("optuna")
    cost = make_cost()
    ctx = SearchContext(cost=cost, global_batch=12)
    trial = optuna.trial.FixedTrial({"use_dev0": True, "use_dev1": True, "precision": "fp32", "checkpoint_blocks": 0,
                                     "zero_stage": 3, "offload": True, "accum_steps": 1})
    plan = ZeRO().space(trial, ctx)
    assert plan.zero_stage == 3 and plan.offload and sum(plan.local_batch) == 12
    assert plan.local_batch[0] > plan.local_batch[1]  # device 0 is twice as fast
    pred, _, _ = ZeRO().predict(plan, cost)
    assert pred.feasible and all(m.host_bytes > 0 for m in pred.memory)


def test_batchnorm_small_batches_warn(gn_profile):
    from hetsim.hardware.cluster import parse_cluster
    from hetsim.profiling.store import ProfileSet
    from hetsim.testing import synthetic_comm

    _, model, dev = gn_profile
    ps = ProfileSet(models={"emu-cpu": model}, devices={"emu-cpu": dev}, comm={2: synthetic_comm(2)})
    bn = CostModel(parse_cluster("emu:1.0@4G,0.5@4G"), ps, has_batchnorm=True)
    small = ZeROPlan(devices=(0, 1), local_batch=(5, 3))
    pred, _, _ = ZeRO().predict(small, bn)
    assert pred.feasible and pred.warnings and "device 1: 3" in pred.warnings[0]
    big = ZeROPlan(devices=(0, 1), local_batch=(16, 8))
    assert ZeRO().predict(big, bn)[0].warnings == ()


def test_offload_costs_host_transfers_on_real_gpus_only(make_cost):
    plan = ZeROPlan(devices=(0, 1), local_batch=(4, 4), zero_stage=3)
    off = ZeROPlan(devices=(0, 1), local_batch=(4, 4), zero_stage=3, offload=True)
    gpus = make_cost("catalog:rtx_3090,t4")
    assert ZeRO().predict(off, gpus)[0].step_time_s > ZeRO().predict(plan, gpus)[0].step_time_s
    # On an emulated device the offloaded shard is already where the device reads it: no copy.
    emu = make_cost()
    t_emu = {p.offload: ZeRO().predict(p, emu)[0] for p in (plan, off)}
    assert t_emu[True].breakdown_s.get("F") == pytest.approx(t_emu[False].breakdown_s.get("F"))


def test_fsdp_collectives_block_on_cpu_but_overlap_on_gpus(make_cost):
    plan = ZeROPlan(devices=(0, 1), local_batch=(4, 4), zero_stage=3)
    for spec, blocking in (("emu:1.0@4G,0.5@4G", True), ("catalog:rtx_3090,t4", False)):
        cost = make_cost(spec)
        pred, sched, g = ZeRO().predict(plan, cost)
        busy = sum(sched.busy_s(g, f"dev{d}") for d in plan.devices) / 2
        comm = sched.busy_s(g, "comm")
        # Blocking: the step is at least compute + communication; overlapping: less than that.
        assert (pred.step_time_s >= busy + comm * 0.999) == blocking, spec


def test_batchnorm_gets_two_samples_per_micro_batch(gn_profile):
    optuna = pytest.importorskip("optuna")
    from hetsim.hardware.cluster import parse_cluster
    from hetsim.profiling.store import ProfileSet
    from hetsim.testing import synthetic_comm

    _, model, dev = gn_profile
    ps = ProfileSet(models={"emu-cpu": model}, devices={"emu-cpu": dev}, comm={2: synthetic_comm(2)})
    bn = CostModel(parse_cluster("emu:1.0@4G,0.05@4G"), ps, has_batchnorm=True)
    trial = optuna.trial.FixedTrial({"use_dev0": True, "use_dev1": True, "precision": "fp32", "checkpoint_blocks": 0,
                                     "zero_stage": 2, "offload": False, "accum_steps": 2})
    plan = ZeRO().space(trial, SearchContext(cost=bn, global_batch=16))
    assert min(plan.micro_batches()) >= 2 and min(plan.local_batch) >= 4  # the slow device still gets 2 x 2
    with pytest.raises(InfeasiblePlanError, match="micro-batch of 1"):
        ZeRO().validate(ZeROPlan(devices=(0, 1), local_batch=(13, 3), accum_steps=2), bn)
    user = SearchContext(cost=bn, global_batch=16, min_local_batch=6)
    assert min(ZeRO().space(trial, user).local_batch) >= 6


def test_one_device_needs_offload(make_cost):
    cost = make_cost("emu:1.0@4G")
    with pytest.raises(InfeasiblePlanError, match="shards nothing"):
        ZeRO().validate(ZeROPlan(devices=(0,), local_batch=(8,), zero_stage=3), cost)
    plans = ZeRO().examples(SearchContext(cost=cost, global_batch=8))
    assert plans and all(p.offload for p in plans)
    for p in plans:
        ZeRO().validate(p, cost)
    assert ZeRO().baseline(SearchContext(cost=cost, global_batch=8)) is None


def test_pipeline_rank_peaks_in_the_optimizer_step_when_its_activations_are_small():
    """A late stage with tiny activations peaks in AdamW's step: two temporaries of its largest
    parameter (foreach=False), which MemTracker showed on the last resnet50 stage (18 MiB)."""
    from dataclasses import replace

    from hetsim.strategies._pipeline_memory import rank_memory
    from hetsim.strategies._pipeline_sched import rank_actions
    from pipeline_synth import synthetic_cost

    from hetsim.model.costmodel import CostModel
    from hetsim.model.memory import optimizer_step_temp_bytes
    from hetsim.profiling.store import ProfileSet

    base = synthetic_cost([1.0, 1.0], [1e-3] * 4, act_bytes=[1.0] * 4, param_counts=[1000, 1000, 1000, 250_000])
    model = next(iter(base.profiles.models.values()))
    blocks = tuple(replace(b, param_numels=(b.param_count,)) for b in model.blocks)
    model = replace(model, blocks=blocks)
    cost = CostModel(base.cluster, ProfileSet(models={model.device_kind: model}, comm=base.profiles.comm), "adamw")
    assert optimizer_step_temp_bytes("adamw", [3, 250_000]) == 2 * 4 * 250_000
    assert optimizer_step_temp_bytes("sgd", [250_000]) == 0
    acts = rank_actions("1F1B", 2, 2, 1)
    last = rank_memory(cost, acts[1], (0, 2, 4), 1, "fp32", 0)
    assert last.other_bytes == 2 * 4 * 250_000
    assert last.activations_bytes == 0
    first = rank_memory(cost, acts[0], (0, 2, 4), 1, "fp32", 0)
    assert first.other_bytes == 2 * 4 * 1000  # its largest parameter; its activations are 2 bytes


def test_blocks_add_up_to_the_whole_models_saved_bytes(make_cost):
    """Where the per-block saved bytes over-count more than the shared boundaries explain, the
    blocks are scaled down to the calibrated whole-model total (simclr's blocks over-counted 17 MiB
    at 40 samples, predicting 10% over the measured peak)."""
    from dataclasses import replace

    from hetsim.model.memory import block_activations
    from hetsim.types import Fit

    cost = make_cost()
    prof = cost.base_profile
    mb = 16
    per_block = sum(b.act_bytes["fp32"](mb) for b in prof.blocks)
    boundary = sum(b.out_bytes_per_sample * mb for b in prof.blocks[:-1])
    whole = (per_block - boundary) * 0.8  # the boundaries alone cannot explain the excess
    cal = replace(prof.memory, saved_bytes={"fp32": Fit(intercept=0.0, slope=whole / mb)})
    ps = replace(cost.profiles, models={prof.device_kind: replace(prof, memory=cal)})
    tight = CostModel(cost.cluster, ps, "adamw")
    kept = sum(block_activations(tight, mb, "fp32", 0).kept)
    assert kept == pytest.approx(whole, rel=0.02)
    assert sum(block_activations(cost, mb, "fp32", 0).kept) > kept


def test_zero_bubble_keeps_split_gradients_from_input_to_weight_backward():
    """torch's stage_backward_input keeps each parameter group's captured activation gradients until
    stage_backward_weight (resnet50 ZBVZeroBubble: 61.6 MiB on a stage whose rank measured 64.6 MiB
    of temporaries); it skips the first stage's input backward, whose weight backward is one full
    backward.  The weight backward's transient is one parameter group, about the largest parameter."""
    from dataclasses import replace

    from hetsim.strategies._pipeline_memory import rank_memory
    from hetsim.strategies._pipeline_sched import rank_actions
    from pipeline_synth import synthetic_cost

    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.store import ProfileSet

    def memory(split: dict[int, float]):
        base = synthetic_cost([1.0, 1.0], [1e-3] * 4, param_counts=[1000, 2000, 3000, 4000])
        model = next(iter(base.profiles.models.values()))
        blocks = tuple(replace(b, param_numels=(b.param_count,),
                               split_grad_bytes_per_sample={"fp32": split.get(k, 0.0)})
                       for k, b in enumerate(model.blocks))
        cost = CostModel(base.cluster, ProfileSet(models={model.device_kind: replace(model, blocks=blocks)},
                                                  comm=base.profiles.comm), "sgd")
        acts = rank_actions("ZBVZeroBubble", 2, 1, 2)  # rank 0: stages 0 and 3; rank 1: stages 1 and 2
        return [rank_memory(cost, acts[r], (0, 1, 2, 3, 4), 1, "fp32", 0) for r in range(2)]

    none = memory({})
    # Rank 1's peak is a weight backward: what its stage kept (received output gradient, the
    # input's gradient) plus the stage's one parameter as the transient, not twice the stage.
    assert none[1].other_bytes == 1000 + 1000 + 4 * 3000
    g = 1e6
    first, middle, last = memory({0: g}), memory({2: g}), memory({3: g})
    # The first stage's gradients exist only inside its one full backward (plus the whole stage's
    # activations it sweeps), once: never more than g above the peak without them.
    assert none[0].total_bytes < first[0].total_bytes <= none[0].total_bytes + g
    assert middle[1].other_bytes == none[1].other_bytes + g
    assert last[0].other_bytes >= g and last[0].total_bytes > none[0].total_bytes


def test_pipeline_replicas_sum_their_gradients_in_place():
    """Data-parallel replicas of a pipeline all-reduce each gradient in place
    (`_sum_grads_over_replicas`): a replica holds what the same rank of a lone pipeline holds, where a
    flattened copy of the gradients used to set the peak of a rank with small activations."""
    from hetsim.strategies._pipeline_memory import replicas_memory
    from pipeline_synth import synthetic_cost

    cost = synthetic_cost([1.0, 1.0], [1e-3] * 2, param_counts=[100_000, 100_000], act_bytes=[1.0, 1.0])
    one = replicas_memory(cost, "GPipe", 1, (0, 2), 1, [4], "fp32", 0)
    two = replicas_memory(cost, "GPipe", 1, (0, 2), 1, [4, 4], "fp32", 0)
    assert one[0].grads_bytes == 4 * 200_000
    assert one[0].other_bytes < one[0].grads_bytes
    assert len(two) == 2 and all(m == one[0] for m in two)


def test_only_the_last_pipeline_stage_holds_the_loss():
    """A transformer's logits dominate a whole step's temporaries (the output, the log-softmax the
    loss saves, their gradients).  In a pipeline only the stage with the last block computes the
    loss; it keeps the output and the saved log-softmax of every micro-batch in flight (bert GPipe,
    2 x 16 samples: 66.2 MiB of activations measured, 34.1 from its blocks alone), the others none
    (2.9 MiB of temporaries measured on the rank without the head, 16.8 predicted before)."""
    from dataclasses import replace

    from hetsim.strategies._pipeline_memory import rank_memory
    from hetsim.strategies._pipeline_sched import rank_actions
    from pipeline_synth import synthetic_cost

    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.store import MemoryCalibration, ProfileSet
    from hetsim.types import Fit

    out = 1_000_000  # the last block's output per sample: logits
    base = synthetic_cost([1.0, 1.0], [1e-3] * 4, act_bytes=[1000.0] * 4, out_bytes=[100, 100, 100, out])
    model = next(iter(base.profiles.models.values()))
    cal = MemoryCalibration(saved_bytes={"fp32": Fit(intercept=0.0, slope=4000.0)},
                            temp_bytes={"fp32": Fit(intercept=0.0, slope=4.0 * out)})
    cost = CostModel(base.cluster, ProfileSet(models={model.device_kind: replace(model, memory=cal)},
                                              comm=base.profiles.comm), "sgd")
    acts = rank_actions("GPipe", 2, 2, 1)
    first, last = (rank_memory(cost, acts[r], (0, 2, 4), 3, "fp32", 0) for r in range(2))
    assert first.other_bytes < out  # no loss temporaries without the last block
    assert first.activations_bytes < 4 * 2 * 3000  # its blocks' own, for two micro-batches
    # Two micro-batches in flight, each keeping output + saved log-softmax (2 x out x 3 samples).
    assert last.activations_bytes >= 2 * 2 * out * 3
    assert 2 * out * 3 <= last.other_bytes < 3 * out * 3  # the gradients of those two


def test_multi_stage_schedules_keep_boundary_tensors_until_the_step_ends():
    """torch's `_PipelineScheduleRuntime` (two or more stages per rank) waits on its sends only at
    the end of the step and hands a same-rank stage its input in that stage's receive slot, and a
    received input keeps its gradient (`inp.grad`) until the next step: each micro-batch's stage
    outputs and input gradients add up over the step (gpt@tiny ZBVZeroBubble, 8 micro-batches of 4:
    the rank holding the middle stages measured 21.6 MiB; predicted 17.5 without them, 20.8 with).
    A one-stage-per-rank schedule (1F1B) waits on each send and keeps none of them."""
    from hetsim.strategies._pipeline_memory import rank_memory
    from hetsim.strategies._pipeline_sched import rank_actions
    from pipeline_synth import synthetic_cost

    big = 10**6  # every block's output, per sample: the boundary tensors dominate
    cost = synthetic_cost([1.0, 1.0], [1e-3] * 4, act_bytes=[1.0] * 4, out_bytes=[big] * 4)
    transient = {}
    for m in (2, 8):
        # rank 1 holds stages 1 and 2: their outputs and their inputs' gradients, per micro-batch
        mid = rank_memory(cost, rank_actions("ZBVZeroBubble", 2, m, 2)[1], (0, 1, 2, 3, 4), 1, "fp32", 0)
        transient[m] = mid.activations_bytes + mid.other_bytes
        assert mid.activations_bytes >= 2 * m * big
        assert mid.other_bytes >= 2 * (m - 1) * big
    # six more micro-batches: at least four boundary tensors each
    assert transient[8] - transient[2] >= 6 * 4 * big
    one = rank_memory(cost, rank_actions("1F1B", 2, 8, 1)[0], (0, 2, 4), 1, "fp32", 0)
    assert one.activations_bytes + one.other_bytes < 8 * big


def test_a_pipeline_stage_holds_its_received_input_whether_or_not_its_first_block_saves_it():
    """torch's pipeline stage keeps each micro-batch's received input until its backward.  A first
    block that saves that input (the whole-model calibration says adjacent blocks share it) holds it
    once; one that saves something else (a cast under autocast) holds the input besides: a ConvNeXt-like
    model's bf16 stages measured their fp32 inputs, 0.79 MiB a stage and micro-batch, on top of the
    predicted activations."""
    from dataclasses import replace

    from hetsim.strategies._pipeline_memory import rank_memory
    from hetsim.strategies._pipeline_sched import rank_actions
    from pipeline_synth import synthetic_cost

    from hetsim.model.costmodel import CostModel
    from hetsim.profiling.store import MemoryCalibration, ProfileSet
    from hetsim.types import Fit

    base = synthetic_cost([1.0, 1.0], [1e-3] * 2, act_bytes=[1e4] * 2, out_bytes=[1000] * 2)
    model = next(iter(base.profiles.models.values()))

    def rank1(saved_per_sample: float) -> int:
        cal = MemoryCalibration(saved_bytes={"fp32": Fit(intercept=0.0, slope=saved_per_sample)},
                                temp_bytes={"fp32": Fit(intercept=0.0, slope=0.0)})
        prof = replace(model, memory=cal)
        cost = CostModel(base.cluster, ProfileSet(models={prof.device_kind: prof}, comm=base.profiles.comm), "adamw")
        return rank_memory(cost, rank_actions("GPipe", 2, 2, 1)[1], (0, 1, 2), 4, "fp32", 0).activations_bytes

    shares_input = rank1(2e4 - 1000)  # the second block saves the first one's output: one storage
    saves_a_cast = rank1(2e4)  # the blocks' saved bytes are all their own
    # Two micro-batches of 4 samples in flight on the last stage, each holding its 4 x 1000-byte input.
    assert saves_a_cast - shares_input == 2 * 4 * 1000
    assert shares_input >= 2 * 4 * 10_000


def _bf16_cost(casts: float, per_sample: float, out_itemsize: int = 2):
    """A synthetic two-block model whose bf16 saved bytes are `casts` + `per_sample` x samples a
    block (1000 parameters each), its outputs 1000 fp32 bytes a sample, `out_itemsize` under bf16."""
    from dataclasses import replace

    from pipeline_synth import synthetic_cost

    from hetsim.profiling.store import ProfileSet
    from hetsim.types import Fit

    base = synthetic_cost([1.0, 1.0], [1e-3] * 2, act_bytes=[per_sample] * 2, out_bytes=[1000] * 2)
    model = next(iter(base.profiles.models.values()))
    blocks = tuple(replace(b, act_bytes={**b.act_bytes, "bf16": Fit(intercept=casts, slope=per_sample)},
                           out_itemsize={"fp32": 4, "bf16": out_itemsize}) for b in model.blocks)
    prof = replace(model, blocks=blocks)
    return CostModel(base.cluster, ProfileSet(models={prof.device_kind: prof}, comm=base.profiles.comm), "adamw")


def test_the_last_stage_keeps_its_output_in_the_blocks_dtype_and_the_log_softmax_in_fp32():
    """The loss's saved tensors on a pipeline's last stage: the logits in the dtype the last block returns
    under autocast and the log-softmax in fp32 (gpt@tiny@64 LoopedBFS m=4 bf16: 2 + 4 MiB a micro-batch
    measured, where two fp32 logits said 8)."""
    from hetsim.model.memory import LOSS_KEPT_COPIES, loss_kept_bytes

    cost = _bf16_cost(0.0, 1e4)
    assert loss_kept_bytes(cost, 8, "fp32") == LOSS_KEPT_COPIES * 1000 * 8
    assert loss_kept_bytes(cost, 8, "bf16") == (500 + 1000) * 8


def test_a_pipeline_stage_holds_autocasts_weight_copies_once_whatever_its_micro_batches_in_flight():
    """Under autocast a block's saved bytes have a part that does not grow with the batch: the bf16
    copies of its weights, cached for the whole step.  A stage with m micro-batches in flight holds
    them once (gpt@tiny@64 LoopedBFS m=4 bf16, MemTracker after each action: a one-layer stage's first
    forward added 2.91 MiB, each later one 2.52; its bf16 weights are 0.375 MiB).  What exceeds two
    bytes a trainable parameter is not a weight copy and stays per micro-batch, and fp32 has none."""
    from hetsim.strategies._pipeline_memory import rank_memory
    from hetsim.strategies._pipeline_sched import rank_actions

    def first_rank(cost, m: int, precision: str = "bf16") -> int:
        return rank_memory(cost, rank_actions("GPipe", 2, m, 1)[0], (0, 1, 2), 4, precision, 0).activations_bytes

    per_mb = 4 * 1e4
    casts = 2 * 1000  # two bytes for each of the block's 1000 parameters
    cost = _bf16_cost(casts, 1e4)
    assert first_rank(cost, 1) == pytest.approx(per_mb + casts)
    assert first_rank(cost, 4) - first_rank(cost, 1) == pytest.approx(3 * per_mb)
    over = _bf16_cost(casts + 3000, 1e4)  # 3000 bytes beyond the weights' copies: per micro-batch
    assert first_rank(over, 4) - first_rank(over, 1) == pytest.approx(3 * (per_mb + 3000))
    assert first_rank(cost, 4, "fp32") - first_rank(cost, 1, "fp32") == pytest.approx(3 * per_mb)
