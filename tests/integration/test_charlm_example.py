"""The examples/charlm example for real: hetsim.search.train with a hand-made uneven data-parallel plan
trains the built-in `gpt` on the standard library's source bytes, and its loss falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hetsim.strategies.ddp import DDPPlan

from hetsim.execution.planfile import PlanFile, save_plan_file
from hetsim.execution.runner import device_dicts
from hetsim.hardware.cluster import parse_cluster
from hetsim.serial import to_dict

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
STEPS = 12


def test_charlm_loss_falls(tmp_path):
    spec = "emu:1.0@4G,0.5@2G"
    plan = DDPPlan(devices=(0, 1), local_batch=(10, 6))  # the faster device takes the larger share
    pf = PlanFile(plan=to_dict(plan), label="ddp-10-6", cluster_spec=spec, devices=device_dicts(parse_cluster(spec), (0, 1)),
                  workload="gpt@tiny@64", global_batch=plan.global_batch)
    path = save_plan_file(pf, tmp_path / "plan.json")
    cmd = [sys.executable, "-m", "hetsim.search.train", "--plan", str(path), "--data", "examples.charlm.data:train_set",
           "--steps", str(STEPS), "--lr", "3e-3", "--out", str(tmp_path / "out"), "--log-every", "4", "--no-tensorboard"]
    run = subprocess.run(cmd, env=ENV, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    losses = json.loads((tmp_path / "out" / "summary.json").read_text())["losses"]
    assert len(losses) == STEPS
    # Bytes of source text: the first step is near ln(2048) = 7.6 (uniform over the gpt preset's vocabulary);
    # a dozen steps learn the byte frequencies. Compare means of the first and last three steps.
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, losses
