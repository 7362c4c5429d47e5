"""Which boundary tensors a pipeline stage holds: the blocks that save their ends (`saved_ends`),
the overlap of adjacent blocks placed on the boundaries both sides save, and torch's one-stage-per-rank
schedules' receive slots and input gradients (`_pipeline_memory.rank_memory`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hetsim.strategies._pipeline_memory import rank_memory
from hetsim.strategies._pipeline_sched import rank_actions
from pipeline_synth import synthetic_cost
from torch import nn

from hetsim.model.costmodel import CostModel
from hetsim.model.memory import block_activations
from hetsim.profiling.saved import saved_ends, storage_ids
from hetsim.profiling.store import MemoryCalibration, ProfileSet
from hetsim.types import Fit


class _Cat(nn.Module):
    """A U-Net's decoder step in miniature: a concatenation, which saves nothing for backward."""

    def forward(self, x):
        return torch.cat([x, x * 2], 1)


def test_saved_ends_tell_which_blocks_save_their_input_and_output():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()), _Cat(), nn.Conv2d(8, 2, 1)]
    exclude = storage_ids(p for b in blocks for p in b.parameters())
    x = torch.randn(2, 3, 8, 8)
    # The convolution saves its input, the ReLU its output; the concatenation neither; the last
    # convolution its input only.
    assert saved_ends(blocks, x, exclude) == [(True, True), (False, False), (True, False)]
    # Under bf16 autocast a convolution fed fp32 saves its cast, not the tensor it was handed.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert saved_ends([nn.Conv2d(3, 4, 1)], x, exclude)[0][0] is False


def _flagged(cost: CostModel, ends: list[tuple[bool, bool]], whole_per_sample: float) -> CostModel:
    prof = cost.base_profile
    blocks = tuple(replace(b, saves_input={"fp32": i}, saves_output={"fp32": o})
                   for b, (i, o) in zip(prof.blocks, ends, strict=True))
    cal = MemoryCalibration(saved_bytes={"fp32": Fit(intercept=0.0, slope=whole_per_sample)},
                            temp_bytes={"fp32": Fit(intercept=0.0, slope=0.0)})
    model = replace(prof, blocks=blocks, memory=cal)
    return CostModel(cost.cluster, ProfileSet(models={model.device_kind: model}, comm=cost.profiles.comm), "sgd")


def test_the_overlap_of_adjacent_blocks_sits_on_the_boundaries_both_save():
    """Three blocks of 10 bytes a sample, boundaries of 4; the whole model saved 26: one boundary is
    counted twice.  The middle block ends in a concatenation, so it is the first boundary, not half of
    each (a user U-Net had 1, 2 and 1 MiB taken off where the overlaps were 2, 0 and 2)."""
    base = synthetic_cost([1.0, 1.0], [1e-3] * 3, act_bytes=[10.0] * 3, out_bytes=[4, 4, 4])
    ends = [(True, True), (True, False), (True, False)]
    flagged = _flagged(base, ends, 26.0)
    acts = block_activations(flagged, 1, "fp32", 0)
    assert acts.full == pytest.approx([10.0, 6.0, 10.0])
    # The last block saves its input, which its neighbour does not: counted as its own, so a stage
    # that starts there does not count its received input a second time.
    assert acts.input_in_full[2] == pytest.approx(4.0)
    # A profile without the flags spreads the overlap over both boundaries.
    model = flagged.base_profile
    model = replace(model, blocks=tuple(replace(b, saves_input={}, saves_output={}) for b in model.blocks))
    old = CostModel(base.cluster, ProfileSet(models={model.device_kind: model}, comm=base.profiles.comm), "sgd")
    assert block_activations(old, 1, "fp32", 0).full == pytest.approx([10.0, 8.0, 8.0])


def test_one_stage_per_rank_schedules_keep_every_receive_slot_and_wait_late_on_input_gradients():
    """torch's GPipe and 1F1B stages receive each micro-batch into a slot of its own, kept for the
    step: the second stage holds m slots at its last backward though one micro-batch is in flight
    (a user U-Net's second stage, 1F1B m=4: four 4 MiB slots at its peak).  Their input gradients
    live until the send is waited: GPipe after its last backward, 1F1B after the next backward."""
    slot = 1_000_000  # the first block's output per sample: the second stage's received input
    base = synthetic_cost([1.0, 1.0], [1e-3] * 2, act_bytes=[10.0, 10.0], out_bytes=[slot, 4],
                          param_counts=[10, 10])
    cost = _flagged(base, [(True, False), (True, False)], 20.0)

    def last_rank(schedule: str, m: int):
        return rank_memory(cost, rank_actions(schedule, 2, m, 1)[1], (0, 1, 2), 1, "fp32", 0, schedule)

    two, four = last_rank("1F1B", 2), last_rank("1F1B", 4)
    assert four.activations_bytes - two.activations_bytes == pytest.approx(2 * slot)
    # At its last backward 1F1B still holds the previous input gradient, whatever m; GPipe all three.
    assert four.other_bytes == pytest.approx(two.other_bytes)
    assert four.other_bytes >= 2 * slot  # the previous one and the one being made
    assert last_rank("GPipe", 4).other_bytes - four.other_bytes == pytest.approx(2 * slot)
