"""Launch real runs through torchrun and turn their rank files into a Measurement.

Every run is one `torch.distributed.run` process group, started with an
argument list (no shell) in its own session so that a timeout or a failed rank
takes the whole group down and nothing outlives the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hetsim.cluster import Cluster
from hetsim.profiles import CommProfile
from hetsim.serial import dump_json, from_dict, to_dict
from hetsim.types import Fit, Measurement
from hetsim.worker import Fault, Job, RankResult, summarize_steps


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """torchrun settings; the defaults run one node on the loopback interface."""

    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_id: str = "hetsim"
    max_restarts: int = 0

    def args(self, nproc: int) -> list[str]:
        a = ["--nnodes", self.nnodes, "--nproc-per-node", str(nproc), "--max-restarts", str(self.max_restarts)]
        if self.rdzv_endpoint:
            a += ["--rdzv-backend", self.rdzv_backend, "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]
            if self.node_rank is not None:
                a += ["--node-rank", str(self.node_rank)]
        else:
            a = ["--standalone"] + a  # localhost rendezvous on a free port: nothing listens off-host
        return a


def _project_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def launch(job: Job, nproc: int, timeout_s: float, launch_cfg: Launch | None = None) -> tuple[list[RankResult], str, bool]:
    """Run the job on nproc ranks; returns (rank results, output tail, timed_out)."""
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("rank*.json"):
        f.unlink()
    job_file = out_dir / "job.json"
    dump_json(job, job_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", *(launch_cfg or Launch()).args(nproc),
           "-m", "hetsim.worker", str(job_file)]
    env = dict(os.environ)
    env["PYTHONPATH"] = _project_root() + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    log_path = out_dir / "torchrun.log"
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
        finally:
            _kill_group(proc)
    results = []
    for r in range(nproc):
        f = out_dir / f"rank{r}.json"
        if f.exists():
            try:
                results.append(from_dict(RankResult, json.loads(f.read_text())))
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
    tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
    return results, tail, timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    """Terminate torchrun and every worker it started (they share its session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers that ignored SIGTERM
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()


def device_dicts(cluster: Cluster, devices: tuple[int, ...]) -> tuple[dict, ...]:
    return tuple(to_dict(cluster.devices[d]) for d in devices)


def measure(plan, *, cluster: Cluster, workload_spec: str, optimizer: str, steps: int, warmup: int,
            timeout_s: float, seed: int = 0, out_dir: str | None = None, fault: Fault | None = None,
            launch_cfg: Launch | None = None) -> Measurement:
    """Run `plan` for real and measure it; failures come back as a status, never as an exception."""
    out = out_dir or tempfile.mkdtemp(prefix="hetsim-run-")
    job = Job(task="train", plan=to_dict(plan), workload=workload_spec, optimizer=optimizer,
              global_batch=plan.global_batch, devices=device_dicts(cluster, plan.devices),
              steps=steps, warmup=max(2, warmup), seed=seed, out_dir=str(out), fault=fault)
    t0 = time.perf_counter()
    results, tail, timed_out = launch(job, len(plan.devices), timeout_s, launch_cfg)
    wall = time.perf_counter() - t0
    by_rank = {r.rank: r for r in results}
    bad = [r for r in results if r.status != "ok"]
    if timed_out and not bad:
        missing = [r for r in range(len(plan.devices)) if r not in by_rank]
        return Measurement(status="timeout", wall_s=wall,
                           error=f"run exceeded the {timeout_s:g} s timeout (ranks without a result: {missing}); "
                                 f"raise --timeout if the plan is just slow\n{tail[-1500:]}")
    if bad:
        # The first failing rank's own status wins (an OOM explains the others' broken pipes).
        order = {"oom": 0, "nonfinite": 1, "error": 2}
        first = min(bad, key=lambda r: (order.get(r.status, 3), r.rank))
        mems = tuple(by_rank[r].memory for r in range(len(plan.devices)) if r in by_rank and by_rank[r].memory)
        return Measurement(status=first.status, wall_s=wall, error=f"rank {first.rank}: {first.error}",
                           memory=mems if len(mems) == len(plan.devices) else None)
    if len(results) != len(plan.devices):
        missing = [r for r in range(len(plan.devices)) if r not in by_rank]
        return Measurement(status="error", wall_s=wall,
                           error=f"rank(s) {missing} ended without a result (killed by a signal?)\n{tail[-1500:]}")
    step, meds = summarize_steps([by_rank[r] for r in range(len(plan.devices))])
    mems = tuple(by_rank[r].memory for r in range(len(plan.devices)))
    return Measurement(
        status="ok",
        step_time_s=step,
        samples_per_s=plan.global_batch / step,
        peak_mem_bytes=tuple(m.total_bytes for m in mems),
        memory=mems,
        step_times_s=meds,
        wall_s=wall,
    )


def commbench(cluster: Cluster, nproc: int, fingerprint: dict[str, str], timeout_s: float = 300,
              launch_cfg: Launch | None = None) -> CommProfile:
    """Measure all-reduce, all-gather and send/recv over a real group of nproc ranks."""
    from hetsim.errors import HetsimError

    out = tempfile.mkdtemp(prefix="hetsim-comm-")
    devs = tuple(range(nproc))
    job = Job(task="commbench", devices=device_dicts(cluster, devs), out_dir=out)
    results, tail, timed_out = launch(job, nproc, timeout_s, launch_cfg)
    r0 = next((r for r in results if r.rank == 0 and r.status == "ok"), None)
    if r0 is None:
        raise HetsimError(f"collective benchmark on {nproc} ranks failed{' (timeout)' if timed_out else ''}:\n{tail[-1500:]}")

    def fit(key: str) -> Fit:
        pts = r0.extra[key]
        return Fit.least_squares([float(n) for n, _ in pts], [float(t) for _, t in pts])

    backend = "nccl" if all(d.backend == "cuda" for d in cluster.devices) else "gloo"
    return CommProfile(backend=backend, world_size=nproc, fingerprint=fingerprint,
                       allreduce_s=fit("allreduce"), allgather_s=fit("allgather"), sendrecv_s=fit("sendrecv"))
