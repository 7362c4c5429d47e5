"""Pipeline stages cut from a user's module by hetsim's cut-point finder, run for real: every rank's
gradient equals the single-process full-batch one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import strategies
from hetsim.testing.contract import check_real_run_gradient, structural_cost
from hetsim.workloads import workload_from_spec
from strategies.pipeline import PipelinePlan

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@pytest.mark.slow
@pytest.mark.parametrize("schedule, boundaries", [("GPipe", (0, 1, 4)), ("1F1B", (0, 2, 4)),
                                                  ("ZBVZeroBubble", (0, 1, 2, 3, 4))])
def test_lstm_stages_match_the_full_batch_gradient(schedule, boundaries, tmp_path, monkeypatch):
    """user_models:lstm_lm is cut into embedding | LSTM | LSTM | head.  A stage that starts with an LSTM
    sends back a gradient that nn.LSTM (batch first) makes non-contiguous, which gloo refused
    ('input tensor has to be contiguous') until every stage after the first made it contiguous."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ASSETS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(ASSETS))
    spec = "user_models:lstm_lm"
    cost = structural_cost(spec)
    plan = PipelinePlan(devices=(1, 0), boundaries=boundaries, schedule=schedule,
                        microbatches=1 if schedule == "GPipe" else 2, batch=8)
    check_real_run_gradient(strategies.get("pipeline"), plan, cost, spec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["pipeline", "ddp"])
def test_a_dict_output_trains_the_full_batch_gradient(family, tmp_path, monkeypatch):
    """user_models:two_heads returns a dict; packed at its last block and unpacked for the loss, a
    pipeline (the last stage computes the loss) and uneven data parallelism match the full-batch
    gradient, the scalar temperature's too."""
    from strategies.ddp import DDPPlan

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ASSETS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(ASSETS))
    spec = "user_models:two_heads"
    cost = structural_cost(spec)
    plan = (PipelinePlan(devices=(0, 1), boundaries=(0, 2, 4), schedule="1F1B", microbatches=2, batch=8)
            if family == "pipeline" else DDPPlan(devices=(0, 1), local_batch=(5, 3)))
    check_real_run_gradient(strategies.get(family), plan, cost, spec, tmp_path)


@pytest.mark.slow
def test_a_last_stage_that_ends_without_parameters_trains(tmp_path, monkeypatch):
    """user_models:tagger's transpose after its head joined the head's block, so a stage of the head alone
    has parameters to train and its gradient equals the full-batch one."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ASSETS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(ASSETS))
    spec = "user_models:tagger"
    cost = structural_cost(spec)
    plan = PipelinePlan(devices=(0, 1), boundaries=(0, 2, 3), schedule="1F1B", microbatches=2, batch=8)
    check_real_run_gradient(strategies.get("pipeline"), plan, cost, spec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["ddp", "zero", "pipeline"])
def test_a_frozen_stem_trains_the_rest_to_the_full_batch_gradient(family, tmp_path, monkeypatch):
    """user_models:frozen_stem's stem does not require gradients: uneven data parallelism, ZeRO-3 (FSDP2)
    and a pipeline whose first stage holds it give the full-batch gradient of every trainable parameter,
    and the checker asks for no gradient of the frozen ones (it had, until 2026-12-05)."""
    from strategies.ddp import DDPPlan
    from strategies.zero import ZeROPlan

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ASSETS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(ASSETS))
    spec = "user_models:frozen_stem"
    from hetsim.testing.contract import model_param_names

    names = model_param_names(spec)
    assert names and not any(n.split(".")[1] == "stem" for n in names)  # trainable only
    cost = structural_cost(spec)
    plan = {"ddp": DDPPlan(devices=(0, 1), local_batch=(5, 3)),
            "zero": ZeROPlan(devices=(0, 1), local_batch=(4, 4), zero_stage=3),
            "pipeline": PipelinePlan(devices=(0, 1), boundaries=(0, 1, 4), schedule="1F1B", microbatches=2,
                                     batch=8)}[family]
    check_real_run_gradient(strategies.get(family), plan, cost, spec, tmp_path)


@pytest.mark.slow
def test_encoder_and_decoder_stages_match_the_full_batch_gradient(tmp_path, monkeypatch):
    """user_models:autoencoder cut at its encoder's and its decoder's layers (float targets, MSE): a
    pipeline of four stages, two on each rank, one cut between encoder and decoder, gives the
    full-batch gradient."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ASSETS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(ASSETS))
    spec = "user_models:autoencoder"
    cost = structural_cost(spec)
    plan = PipelinePlan(devices=(0, 1), boundaries=(0, 2, 3, 5, 6), schedule="Interleaved1F1B", microbatches=2,
                        batch=8)
    check_real_run_gradient(strategies.get("pipeline"), plan, cost, spec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, boundaries", [("1F1B", (0, 2, 5)), ("ZBVZeroBubble", (0, 1, 2, 3, 5))])
def test_layers_after_functional_work_are_stages_of_their_own(schedule, boundaries, tmp_path, monkeypatch):
    """user_models:prenorm_lm normalises functionally before each layer call, so before 2026-12-06 no cut
    between its layers held and it was two blocks; cut at the residual adds it is embedding | layer x3 |
    head, and every stage's gradient equals the full-batch one."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ASSETS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(ASSETS))
    spec = "user_models:prenorm_lm"
    assert workload_from_spec(spec, "adamw").block_names() == ["0_tok", "1_layers_0", "2_layers_1", "3_layers_2",
                                                                "4_out"]
    cost = structural_cost(spec)
    plan = PipelinePlan(devices=(1, 0), boundaries=boundaries, schedule=schedule, microbatches=2, batch=8)
    check_real_run_gradient(strategies.get("pipeline"), plan, cost, spec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, boundaries", [("1F1B", (0, 2, 5)), ("ZBVZeroBubble", (0, 1, 2, 3, 5))])
def test_stages_handing_on_a_packed_mask_match_the_full_batch_gradient(schedule, boundaries, tmp_path, monkeypatch):
    """user_models:masked_encoder hands its padding mask to every layer beside the hidden state: each cut
    between its layers sends the two packed into one tensor, and every stage's gradient equals the
    full-batch one."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ASSETS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(ASSETS))
    spec = "user_models:masked_encoder"
    assert len(workload_from_spec(spec, "adamw").block_names()) == 5
    cost = structural_cost(spec)
    plan = PipelinePlan(devices=(1, 0), boundaries=boundaries, schedule=schedule, microbatches=2, batch=8)
    check_real_run_gradient(strategies.get("pipeline"), plan, cost, spec, tmp_path)
