"""Training with a found plan, for real (torchrun, gloo): the library API's gradient equals the
single-process full-batch gradient, and a run killed with SIGKILL resumes to the same loss."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hetsim.search.train.data import synthetic_dataset
from hetsim.strategies.ddp import DDPPlan
from hetsim.strategies.zero import ZeROPlan

from hetsim.execution.planfile import PlanFile, save_plan_file
from hetsim.execution.runner import device_dicts
from hetsim.hardware.cluster import parse_cluster
from hetsim.serial import to_dict
from hetsim.workloads import load_workload

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def plan_file(tmp_path: Path, plan, name: str = "plan.json") -> Path:
    spec = "emu:1.0@4G,1.0@4G"
    pf = PlanFile(plan=to_dict(plan), label=name, cluster_spec=spec, devices=device_dicts(parse_cluster(spec), (0, 1)),
                  workload="mlp", global_batch=plan.global_batch)
    return save_plan_file(pf, tmp_path / name)


def torchrun(log_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hetsim.execution.launcher", "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--local-addr", "127.0.0.1",
            "--log-dir", str(log_dir / "torchelastic"), *args]


@pytest.mark.parametrize("plan", [DDPPlan(devices=(0, 1), local_batch=(20, 12), accum_steps=2),
                                  ZeROPlan(devices=(0, 1), local_batch=(9, 23), zero_stage=3),
                                  ZeROPlan(devices=(0, 1), local_batch=(21, 11), zero_stage=1)],
                         ids=["ddp-uneven-accum", "zero3-uneven", "zero1-uneven"])
def test_prepare_gives_the_full_batch_gradient(tmp_path, plan):
    path = plan_file(tmp_path, plan)
    script = str(Path(__file__).with_name("train_api_script.py"))
    subprocess.run(torchrun(tmp_path, script, str(path), str(tmp_path)), env=ENV, check=True, timeout=300,
                   capture_output=True)
    wl = load_workload("mlp")
    ds = synthetic_dataset(wl, 32)
    from hetsim.search.train.sampler import PlanSampler

    idx = [i for r in range(2) for i in PlanSampler(len(ds), plan.local_batch, r).next_batch()[0]]
    model = wl.model()
    x, y = ds.tensors[0][idx], ds.tensors[1][idx]
    (wl.loss_sum(model(x), y) / 32).backward()
    for r in range(2):
        got = torch.load(tmp_path / f"grads{r}.pt")
        for name, p in model.named_parameters():
            err = float((got[name] - p.grad).norm() / p.grad.norm())
            assert err < 1e-5, (r, name, err)


def _train_cmd(plan: Path, ck: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "hetsim.search.train", "--plan", str(plan), "--steps", "16", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "4", "--out", str(out), "--log-every", "1", "--no-tensorboard"]


def test_sigkill_then_the_same_command_resumes_to_the_same_loss(tmp_path):
    plan = plan_file(tmp_path, DDPPlan(devices=(0, 1), local_batch=(20, 12)))
    subprocess.run(_train_cmd(plan, tmp_path / "ck-a", tmp_path / "a"), env=ENV, check=True, timeout=300,
                   capture_output=True)
    whole = json.loads((tmp_path / "a" / "summary.json").read_text())["losses"]

    kill_at = random.Random().randint(5, 14)
    cmd = _train_cmd(plan, tmp_path / "ck-b", tmp_path / "b")
    log = tmp_path / "b.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while f"step {kill_at}/16" not in log.read_text() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "ck-b" / "latest").is_file(), log.read_text()[-6000:]
    again = subprocess.run(cmd, env=ENV, timeout=300, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-8000:]
    assert "resumed from" in again.stdout
    resumed = json.loads((tmp_path / "b" / "summary.json").read_text())["losses"]
    assert len(resumed) == len(whole) == 16
    assert abs(resumed[-1] - whole[-1]) <= 1e-4, (kill_at, resumed[-1], whole[-1])
