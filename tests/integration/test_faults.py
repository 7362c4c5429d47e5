"""Faults in real runs: each ends its run with a status and the error's last lines, the whole
process group is cleaned up, and the search CLI reports the failed run and goes on.

Two emulated ranks on the MLP; every run is a real torchrun launch (about 10-20 s here).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from clitools import TINY, processes_naming, run_cli
from hetsim.strategies.ddp import DDPPlan

from hetsim.execution.runner import measure
from hetsim.execution.worker import Fault
from hetsim.hardware.cluster import parse_cluster

pytestmark = pytest.mark.slow

CLUSTER = parse_cluster("emu:1.0@1G,1.0@1G")
PLAN = DDPPlan(devices=(0, 1), local_batch=(4, 4))


def run_with(fault: Fault | None, out, timeout_s: float = 180):
    return measure(PLAN, cluster=CLUSTER, workload_spec="mlp", optimizer="adamw", steps=2, warmup=2,
                   timeout_s=timeout_s, out_dir=str(out), fault=fault)


def assert_nothing_left(out) -> None:
    left = processes_naming(str(out))
    assert not left, f"processes outlived their run: {left}"


def test_out_of_memory_rank(tmp_path):
    m = run_with(Fault(kind="oom", rank=1), tmp_path / "run")
    assert m.status == "oom", m.error
    assert "out of memory" in m.error and m.error.startswith("rank 1:")
    assert m.failed_rank == 1 and m.failed_peak_bytes > CLUSTER.devices[1].memory_bytes
    assert_nothing_left(tmp_path)


def test_rank_killed_by_a_signal(tmp_path):
    m = run_with(Fault(kind="kill", rank=1, at_step=2), tmp_path / "run")
    assert m.status == "error", m.error
    # The killed rank is named as the cause, not the survivor's broken connection.
    assert m.error.startswith("rank 1 was killed by signal 9 (SIGKILL"), m.error
    assert m.failed_rank == 1
    assert_nothing_left(tmp_path)


def test_rank_with_nonfinite_loss(tmp_path):
    m = run_with(Fault(kind="nan", rank=0, at_step=2), tmp_path / "run")
    assert m.status == "nonfinite", m.error
    assert "non-finite loss nan at step 2 on rank 0" in m.error
    assert_nothing_left(tmp_path)


def test_crashing_rank_is_the_cause(tmp_path):
    m = run_with(Fault(kind="raise", rank=1, at_step=2), tmp_path / "run")
    assert m.status == "error", m.error
    assert m.error.startswith("rank 1: RuntimeError: injected crash"), m.error
    assert_nothing_left(tmp_path)


def test_hanging_rank_times_out_and_listens_on_loopback_only(tmp_path):
    """A hang ends at the per-run timeout with every process gone; while it hangs, every socket
    the run listens on (torchrun's stores, gloo's pairs) is bound to the loopback interface."""
    import psutil

    result = {}
    out = tmp_path / "run"
    t = threading.Thread(target=lambda: result.update(m=run_with(Fault(kind="hang", rank=0, at_step=2), out,
                                                                 timeout_s=40)))
    t0 = time.monotonic()
    t.start()
    listening: dict[int, list] = {}
    # Wait until torchrun and both workers are up and the group is formed (the ranks are past
    # init_process_group once step 2 hangs; their gloo listeners exist from then on).
    while time.monotonic() - t0 < 35 and t.is_alive():
        procs = [pid for pid, _ in processes_naming(str(out / "job.json"))]
        listening = {}
        for pid in procs:
            try:
                listening[pid] = [c.laddr for c in psutil.Process(pid).net_connections(kind="inet")
                                  if c.status == psutil.CONN_LISTEN]
            except psutil.Error:
                continue
        if len(procs) >= 3 and sum(len(v) for v in listening.values()) >= 4:
            break
        time.sleep(0.5)
    t.join(timeout=120)
    assert not t.is_alive()
    addrs = [a for v in listening.values() for a in v]
    assert len(addrs) >= 4, f"expected torchrun's two stores and one gloo listener per rank, saw {listening}"
    assert all(a.ip in ("127.0.0.1", "::1") for a in addrs), f"a run listens beyond loopback: {addrs}"
    m = result["m"]
    assert m.status == "timeout", m.error
    assert "exceeded the 40 s timeout" in m.error
    assert_nothing_left(tmp_path)


def test_cli_reports_a_failed_run_and_goes_on(seeded_out):
    """The first real run gets a non-finite loss; the search reports it and runs the others."""
    p = run_cli(*TINY, "--trials", "6", "--top-k", "2", "--out", str(seeded_out), "--study", "faulty",
                "--inject-fault", "nan:0:2", "--timeout", "180")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "run failed (nonfinite)" in p.stdout and "continuing with the next plan" in p.stdout
    s = json.loads((seeded_out / "reports" / "faulty" / "summary.json").read_text())
    runs = [c["measured"] for c in s["candidates"]] + [s["baselines"]["uniform_ddp"]["measured"]]
    assert runs[0]["status"] == "nonfinite" and "non-finite loss" in runs[0]["error"]
    assert any(r["status"] == "ok" for r in runs[1:]), runs
    report = (seeded_out / "reports" / "faulty" / "report.md").read_text()
    assert "nonfinite" in report and "FloatingPointError: non-finite loss" in report
    assert_nothing_left(seeded_out)
