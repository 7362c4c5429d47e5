"""Warm launches: torchrun's launcher API run from one long-lived process, forking fresh ranks.

A calibration makes 20-30 short real runs.  Started as `torchrun` commands, each pays about 10 s
before its first step on two CPU cores (torchrun imports torch, every rank imports torch, DDP
imports torch._dynamo), more than the run's own steps.  Inside `warm_launches()` the runner
instead hands each job to a server process (`python -m hetsim.execution.warm`) that has imported
torch, torch._dynamo and the rank module once.  For every job the server calls
`torch.distributed.launcher.api.elastic_launch` (what torchrun's `main` calls: the same elastic
agent, c10d rendezvous, failure summary) with `start_method="fork"`, so each rank is a new process
forked from a parent that has never run a step nor joined a process group.  Ranks are never
reused: a process reused for a second job measured its steps 3-5 % faster than a fresh launch
(README, "Launch costs"); forked ranks measured within about 3 % of fresh ones, either side.

One difference in what a failure reads like: the fork agent's failure summary lists the first failed
rank it polls, not every one with its exit code, so a rank killed by a signal may read "ended before it
wrote a result" (the runner still names it as the cause).

Only local CPU runs inside `warm_launches()` go through the server (calibration's); GPU runs (CUDA
cannot be used in a forked child), executed plans, `launch.sh` and multi-node runs stay `torchrun`
commands.  A job that outlives its time limit takes the server
down with it (its ranks die with it: `die_with_parent`); the next job starts a new one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

_active: WarmLauncher | None = None
"""The launcher of the `warm_launches()` block the process is in (any thread: the runner may be called
from a worker thread)."""


class WarmLauncher:
    """The client side: starts the server on first use, sends it one job at a time."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] | None = None

    def _start(self, env: dict[str, str]) -> subprocess.Popen:
        if self.proc is not None and (self.proc.poll() is not None or env != self.env):
            self.close()
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "hetsim.execution.warm"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
            self.env = env
        return self.proc

    def run(self, job_file: Path, torchrun_args: list[str], log_path: Path, timeout_s: float,
            env: dict[str, str]) -> bool:
        """Run the job with the torchrun arguments the command would have (`Launch.args`, `--log-dir`), its
        ranks forked (the server started with `env`, the ranks' environment), their output into log_path;
        returns True on a timeout (the server and every rank of the job are then gone)."""
        proc = self._start(env)
        request = {"job": str(job_file), "args": torchrun_args, "log": str(log_path)}
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.close(kill=True)
                    return True
                ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
                if ready:
                    if not proc.stdout.readline():  # the server died: the job's rank files and log say what they can
                        self.close(kill=True)
                    return False
        except BrokenPipeError:  # the server was gone before the job was sent
            self.close(kill=True)
            return False
        except BaseException:  # Ctrl-C: nothing of this job outlives it
            self.close(kill=True)
            raise

    def close(self, kill: bool = False) -> None:
        """End the server: at the end of its input, or (kill) with SIGKILL to its whole session."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if not kill:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


@contextlib.contextmanager
def warm_launches() -> Iterator[WarmLauncher]:
    """Within this block the runner's local jobs go through one warm server."""
    global _active
    outer, launcher = _active, WarmLauncher()
    _active = launcher
    try:
        yield launcher
    finally:
        _active = outer
        launcher.close()


def active() -> WarmLauncher | None:
    """The warm launcher of the enclosing `warm_launches()` block, if any."""
    return _active


# ---- the server ---------------------------------------------------------------------------------

def _rank_entry(job_file: str) -> None:
    """What every forked rank runs: the worker's loop; a failed rank exits with its code."""
    import importlib

    from hetsim.execution.runner import WORKER_MODULE
    from hetsim.execution.worker import run_rank

    code = run_rank(job_file, importlib.import_module(WORKER_MODULE).build_executor)
    if code:
        raise SystemExit(code)


def _launch_one(request: dict) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from hetsim.execution.runner import WORKER_MODULE

    # torchrun's own parser turns the command's arguments into its launch settings; only the start method differs.
    cfg, _, _ = config_from_args(parse_args([*request["args"], "--start-method", "fork", "-m", WORKER_MODULE,
                                             request["job"]]))
    try:
        elastic_launch(cfg, _rank_entry)(request["job"])
        return 0
    except ChildFailedError as e:  # the failure summary torchrun prints, which the runner reads
        print(e.format_msg(), flush=True)
        return 1


def serve() -> None:
    """Read one JSON request a line from stdin ({"job", "args", "log"}), run it, answer one line."""
    from hetsim.execution.launcher import die_with_parent, install_loopback_stores

    die_with_parent(signal.SIGKILL)
    reply = os.fdopen(os.dup(1), "w")  # the answers; fds 1 and 2 become each job's log
    # What every rank would import on its own: torch, the rank module (the strategies), DDP's torch._dynamo.
    import importlib

    import torch._dynamo  # noqa: F401

    from hetsim.execution.runner import WORKER_MODULE

    importlib.import_module(WORKER_MODULE)
    install_loopback_stores()
    # What is imported stays out of the collector's passes, so a rank's collections do not copy every
    # page the parent shares with it (a gpt pipeline step measured 5.6 % slower forked without this,
    # -1.1 % with it; README, "Launch costs").
    gc.collect()
    gc.freeze()
    for line in sys.stdin:
        request = json.loads(line)
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        try:
            rc = _launch_one(request)
        except Exception as e:  # the agent itself failed: said in the log, the ranks' files say the rest
            print(f"hetsim warm launcher: {type(e).__name__}: {e}", flush=True)
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        reply.write(json.dumps({"rc": rc}) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve()
