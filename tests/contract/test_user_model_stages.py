"""Pipeline stages cut from a user's module by hetsim's cut-point finder, run for real: every rank's
gradient equals the single-process full-batch one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import strategies
from hetsim.testing.contract import check_real_run_gradient, structural_cost
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
