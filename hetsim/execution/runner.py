"""Launch real runs through torchrun and turn their rank files into a Measurement.

Every run is one `torch.distributed.run` process group, started with an
argument list (no shell) in its own session so that a timeout or a failed rank
takes the whole group down and nothing outlives the run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from hetsim.errors import HetsimError
from hetsim.execution import warm
from hetsim.execution.worker import Fault, Job, RankResult, summarize_steps
from hetsim.hardware.cluster import Cluster
from hetsim.profiling.hostspeed import ELASTICITY, ref_of
from hetsim.profiling.store import CommProfile
from hetsim.serial import dump_json, from_dict, to_dict
from hetsim.types import Fit, Measurement

WORKER_MODULE = "hetsim.strategies.rank"
"""What torchrun starts on every rank (by module name: the core launches it, never imports it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """torchrun settings; the defaults run one node on the loopback interface."""

    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_id: str = "hetsim"
    max_restarts: int = 0

    def args(self, nproc: int, run_dir: Path | None = None) -> list[str]:
        """torchrun's arguments for `nproc` ranks on this node; with `run_dir`, torchrun's own (empty) log
        folders go into `run_dir`/torchelastic, not one more /tmp/torchelastic_* a run."""
        a = ["--nnodes", self.nnodes, "--nproc-per-node", str(nproc), "--max-restarts", str(self.max_restarts)]
        if run_dir is not None:
            a += ["--log-dir", str(run_dir / "torchelastic")]
        if self.rdzv_endpoint:
            a += ["--rdzv-backend", self.rdzv_backend, "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]
            if self.node_rank is not None:
                a += ["--node-rank", str(self.node_rank)]
        else:
            # One node on the loopback interface: port 0 lets the store pick a free port without a race,
            # hetsim.execution.launcher binds it to 127.0.0.1, and the workers reach it at --local-addr.
            a += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", f"hetsim-{uuid.uuid4().hex[:12]}",
                  "--local-addr", "127.0.0.1"]
        return a

    @property
    def local(self) -> bool:
        """True when nothing but this machine takes part (no user rendezvous endpoint)."""
        return not self.rdzv_endpoint


def _project_root() -> str:
    """The folder that holds the `hetsim` package: on the workers' PYTHONPATH so that a clean
    clone runs without an install (the one path setting the fixed layout needs)."""
    return str(Path(__file__).resolve().parents[2])


def launch(job: Job, nproc: int, timeout_s: float, launch_cfg: Launch | None = None) -> tuple[list[RankResult], str, bool]:
    """Run the job on nproc ranks; returns (rank results, output tail, timed_out)."""
    cfg = launch_cfg or Launch()
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("rank*.json"):
        f.unlink()
    job_file = out_dir / "job.json"
    dump_json(job, job_file)
    torchrun_args = cfg.args(nproc, run_dir=out_dir)
    cmd = [sys.executable, "-m", "hetsim.execution.launcher", *torchrun_args, "-m", WORKER_MODULE, str(job_file)]
    env = dict(os.environ)
    env["PYTHONPATH"] = _project_root() + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if cfg.local:
        _loopback_only(env)
    log_path = out_dir / "torchrun.log"
    warm_launcher = warm.active()
    if warm_launcher is not None and cfg.local and not _on_gpu(job):
        # Inside `warm_launches()` (calibration): torchrun's agent in a warm server, fresh ranks forked from it.
        # Never for GPU ranks: CUDA does not survive a fork (every calibration run on an H200 failed
        # "Cannot re-initialize CUDA in forked subprocess"), and a GPU machine's cores pay torchrun's
        # start-up quickly anyway.
        timed_out = warm_launcher.run(job_file, torchrun_args, log_path, timeout_s, env)
        cut = log_path.stat().st_size if timed_out and log_path.exists() else None
    else:
        timed_out, cut = _torchrun(cmd, env, log_path, job_file, timeout_s)
    results = []
    for r in range(nproc):
        f = out_dir / f"rank{r}.json"
        if f.exists():
            try:
                results.append(from_dict(RankResult, json.loads(f.read_text())))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                pass  # a rank killed while writing: treated as a rank without a result
    text = log_path.read_bytes()[:cut].decode(errors="replace") if log_path.exists() else ""
    tail = text[-4000:]
    return results, tail, timed_out


def _on_gpu(job: Job) -> bool:
    """True when a rank of the job runs on a CUDA device."""
    return any(d.get("backend") == "cuda" for d in job.devices)


def _torchrun(cmd: list[str], env: dict[str, str], log_path: Path, job_file: Path,
              timeout_s: float) -> tuple[bool, int | None]:
    """Run the torchrun command, its output into log_path; (timed out, the log's size when the time ran out)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
            return False, None
        except subprocess.TimeoutExpired:
            log.flush()
            return True, log_path.stat().st_size
        finally:  # also on Ctrl-C: nothing of this run outlives it
            stop_run(proc, str(job_file))


def _loopback_only(env: dict[str, str]) -> None:
    """Keep gloo's and NCCL's own sockets on the loopback interface for a one-machine run."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (OSError, AttributeError):
        return
    if "lo" in names:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")


def _descendants(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _marked(marker: str) -> list:
    """Processes whose command line names this run's job file: torchrun and its workers, also
    a worker whose torchrun already died (it has been re-parented)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and marker in (p.info.get("cmdline") or ()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def stop_run(proc: subprocess.Popen, marker: str, grace_s: float = 15.0) -> None:
    """Stop torchrun and every worker of its run.

    torchrun stops its workers when it gets SIGTERM, but it starts each worker in a
    session of its own, so a signal to torchrun's process group does not reach them:
    whatever is still alive after the grace period is killed by pid.
    """
    import psutil

    procs = {}
    was_running = proc.poll() is None
    if was_running:  # before torchrun is reaped, its pid and its children's are still ours
        procs.update((p.pid, p) for p in _descendants(proc.pid))
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    procs.update((p.pid, p) for p in _marked(marker))
    left = []
    for p in procs.values():
        try:
            if p.is_running():  # psutil also checks that the pid was not reused
                p.kill()
                left.append(p)
        except psutil.Error:
            pass
    if was_running:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        proc.wait()
    psutil.wait_procs(left, timeout=5)


def device_dicts(cluster: Cluster, devices: tuple[int, ...]) -> tuple[dict, ...]:
    return tuple(to_dict(cluster.devices[d]) for d in devices)


def measure(plan, *, cluster: Cluster, workload_spec: str, optimizer: str, steps: int, warmup: int,
            timeout_s: float, seed: int = 0, out_dir: str | None = None, fault: Fault | None = None,
            launch_cfg: Launch | None = None) -> Measurement:
    """Run `plan` for real and measure it; failures come back as a status, never as an exception."""
    if out_dir is None:  # the run's files only serve this measurement: gone once it is read
        with tempfile.TemporaryDirectory(prefix="hetsim-run-") as tmp:
            return measure(plan, cluster=cluster, workload_spec=workload_spec, optimizer=optimizer, steps=steps,
                           warmup=warmup, timeout_s=timeout_s, seed=seed, out_dir=tmp, fault=fault,
                           launch_cfg=launch_cfg)
    out = out_dir
    job = Job(task="train", plan=to_dict(plan), workload=workload_spec, optimizer=optimizer,
              global_batch=plan.global_batch, devices=device_dicts(cluster, plan.devices),
              steps=steps, warmup=max(2, warmup), seed=seed, out_dir=str(out), fault=fault,
              probe=all(cluster.devices[d].backend == "emulated" for d in plan.devices))
    t0 = time.perf_counter()
    results, tail, timed_out = launch(job, len(plan.devices), timeout_s, launch_cfg)
    wall = time.perf_counter() - t0
    n = len(plan.devices)
    by_rank = {r.rank: r for r in results}
    if all(r in by_rank and by_rank[r].status == "ok" for r in range(n)):
        ranks = [by_rank[r] for r in range(n)]
        step, meds = summarize_steps(ranks)
        probes = [p for r in ranks for p in r.probe_s]
        probed = all(len(r.probe_s) == len(r.step_s) > 0 for r in ranks)
        mems = tuple(r.memory for r in ranks)
        return Measurement(status="ok", step_time_s=step, samples_per_s=plan.global_batch / step,
                           peak_mem_bytes=tuple(m.total_bytes for m in mems), memory=mems, rank_median_step_s=meds,
                           wall_s=wall, probe_s=ref_of(probes) if probed else None,
                           steps_per_probe=summarize_steps(ranks, 1.0)[0] if probed else None,
                           probe_elasticity=ELASTICITY,
                           **measured_timeline(ranks))
    return _failure(by_rank, n, tail, timed_out, timeout_s, wall)


def measured_timeline(ranks: list[RankResult]) -> dict[str, tuple[tuple[float, ...], ...]]:
    """Measurement fields of the ranks' timed steps: starts relative to the earliest (perf_counter is
    one clock per machine: ranks on other nodes are only aligned by their first step)."""
    if not ranks or any(len(r.step_starts_s) != len(r.step_s) or not r.step_starts_s for r in ranks):
        return {}
    t0 = min(r.step_starts_s[0] for r in ranks)
    return {"step_starts_s": tuple(tuple(t - t0 for t in r.step_starts_s) for r in ranks),
            "step_durations_s": tuple(tuple(r.step_s) for r in ranks)}


# torchrun's failure summary: "rank : 1 (local_rank: 1)" then "exitcode : -9 (pid: 123)  (SIGKILL)".
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)[^\n]*")
_ROOT_CAUSE = "Root Cause (first observed failure)"


def _torchrun_root_cause(tail: str) -> tuple[int, int] | None:
    """(rank, exit code) of the first failure torchrun observed, if its summary is in the log."""
    at = tail.rfind(_ROOT_CAUSE)
    m = _TORCHRUN_FAILURE.search(tail, at) if at >= 0 else None
    return (int(m.group(1)), int(m.group(2))) if m else None


# Errors a rank reports when a peer went away: consequences, not causes.
_SECONDARY = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Connection refused|"
                        r"NCCL communicator was aborted|recvBytes|failed to recv|Socket Timeout|"
                        # torchrun's agent stops the survivors with SIGTERM once a rank has died
                        r"SignalException: Process \d+ got signal: 15", re.IGNORECASE)


def _exit_code_of(tail: str, rank: int) -> int | None:
    """The exit code torchrun's failure summary gives for `rank`, if it is in the log."""
    for m in _TORCHRUN_FAILURE.finditer(tail):
        if int(m.group(1)) == rank:
            return int(m.group(2))
    return None


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = "; the kernel's out-of-memory killer also sends it" if -code == signal.SIGKILL else ""
        return f"was killed by signal {-code} ({name}{hint})"
    return f"exited with code {code}"


def _last_lines(text: str, n: int = 25, limit: int = 2500) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:])[-limit:]


def _failure(by_rank: dict[int, RankResult], n: int, tail: str, timed_out: bool, timeout_s: float,
             wall: float) -> Measurement:
    """The status of a run that did not finish on every rank, and the failure that explains it.

    A rank's own out-of-memory or non-finite loss explains the others' broken connections, so
    those win; otherwise the failure torchrun observed first, then the earliest reported one.
    """
    failed = [r for r in by_rank.values() if r.status != "ok"]
    missing = [r for r in range(n) if r not in by_rank]
    if timed_out and not failed:
        return Measurement(status="timeout", wall_s=wall,
                           error=f"run exceeded the {timeout_s:g} s timeout (ranks without a result: {missing}); "
                                 f"a rank hangs, or the plan is just slow (then raise --timeout)\n"
                                 f"{_last_lines(tail)}")
    root = _torchrun_root_cause(tail)
    first: RankResult | None = None
    specific = [r for r in failed if r.status in ("oom", "nonfinite")]
    # A survivor's broken connection is the echo of another rank's failure, never its cause.
    primary = [r for r in failed if not _SECONDARY.search(r.error or "")]
    if specific:
        first = min(specific, key=lambda r: (r.failed_at_s or float("inf"), r.rank))
    elif primary:
        first = min(primary, key=lambda r: (r.failed_at_s or float("inf"), r.rank))
    elif missing:
        dead = root[0] if root is not None and root[0] in missing else missing[0]
        code = _exit_code_of(tail, dead)
        how = _exit_text(code) if code is not None else "ended"
        others = "; ".join(f"rank {r.rank}: {(r.error or r.status).splitlines()[0]}" for r in failed)
        return Measurement(status="error", wall_s=wall, failed_rank=dead,
                           error=f"rank {dead} {how} before it wrote a result"
                                 + (f" (then {others})" if others else "") + f"\n{_last_lines(tail)}")
    elif failed:
        first = min(failed, key=lambda r: (r.failed_at_s or float("inf"), r.rank))
    if first is None:
        return Measurement(status="error", wall_s=wall,
                           error=f"rank(s) {missing} ended without a result (killed by a signal?)\n{_last_lines(tail)}")
    mems = tuple(by_rank[r].memory for r in range(n) if r in by_rank and by_rank[r].memory)
    return Measurement(status=first.status, wall_s=wall, error=f"rank {first.rank}: {first.error}",
                       memory=mems if len(mems) == n else None, failed_rank=first.rank,
                       failed_peak_bytes=first.memory.total_bytes if first.memory else None)


def commbench(cluster: Cluster, nproc: int, fingerprint: dict[str, str], timeout_s: float = 300,
              launch_cfg: Launch | None = None) -> CommProfile:
    """Measure all-reduce, all-gather and send/recv over a real group of nproc ranks."""

    with tempfile.TemporaryDirectory(prefix="hetsim-comm-") as out:
        job = Job(task="commbench", devices=device_dicts(cluster, tuple(range(nproc))), out_dir=out)
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
