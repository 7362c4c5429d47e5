"""Several real runs in one torchrun launch, for the short runs of calibration.

Starting torchrun and importing torch on every rank takes about 9 s on two CPU cores, more than
the steps a calibration run times (6-10 steps of 0.1-1 s), and a search makes two or three such
runs for each of its up to eleven calibration plans.  Inside `pooled_runs()`, `runner.launch` hands
one-machine jobs to a pool instead: the pool keeps one torchrun running (`hetsim.execution.worker.serve`
on every rank) and writes each job into its folder; the ranks run it in their existing process group
and write their rank files as a fresh launch would.  Each job still builds its model, runs the
instrumented memory step, warms up and times its steps.  A job of another world size or device
backend stops the pool's torchrun and starts one for it.  A failing, timed-out or interrupted job
ends the pool's torchrun, reported as a fresh launch's would be, and the next job starts a new one.

The executed plans a search reports are not pooled: each is one fresh launch, as `launch.sh` is.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hetsim.execution.runner import (
    Launch,
    prepare_out_dir,
    read_rank_results,
    start_torchrun,
    stop_run,
)
from hetsim.execution.worker import Job, RankResult
from hetsim.serial import dump_json

_ACTIVE: list[Pool] = []


def active_pool() -> Pool | None:
    """The innermost `pooled_runs` pool, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def pooled_runs(root: str | Path | None = None) -> Iterator[Pool]:
    """Run the one-machine jobs launched inside this block in a pool (its folders under `root`, by
    default the temporary folder); its torchrun stops at the end."""
    pool = Pool(root)
    _ACTIVE.append(pool)
    try:
        yield pool
    finally:
        _ACTIVE.remove(pool)
        pool.close()


@dataclass
class _Server:
    key: tuple
    proc: subprocess.Popen
    folder: Path
    log: IO[bytes]
    jobs: int = 0


class Pool:
    """One running torchrun at a time, fed job files (`launch` has `runner.launch`'s contract)."""

    def __init__(self, root: str | Path | None = None, poll_s: float = 0.02):
        self.root, self.poll_s = root, poll_s
        self.launches = 0
        """torchrun processes started: one per world size and backend in a row, plus one after each failure."""
        self._server: _Server | None = None

    def launch(self, job: Job, nproc: int, timeout_s: float) -> tuple[list[RankResult], str, bool]:
        key = (nproc, tuple(d.get("backend") for d in job.devices))
        if self._server is not None and (self._server.key != key or self._server.proc.poll() is not None):
            self.close()
        if self._server is None:
            self._server = self._start(key, nproc)
        srv = self._server
        out_dir = prepare_out_dir(job)
        log_path = srv.folder / "torchrun.log"
        start = log_path.stat().st_size
        dump_json(job, srv.folder / f"job-{srv.jobs}.json")
        srv.jobs += 1
        deadline = time.monotonic() + timeout_s
        timed_out = ended = False
        try:
            while not all((out_dir / f"rank{r}.json").exists() for r in range(nproc)):
                if srv.proc.poll() is not None:
                    ended = True
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(self.poll_s)
        except BaseException:  # Ctrl-C: nothing of the pool outlives it
            self.close()
            raise
        results = read_rank_results(out_dir, nproc)
        if ended or timed_out or any(r.status != "ok" for r in results):
            srv.log.flush()
            cut = log_path.stat().st_size if timed_out else None
            self.close()
            text = log_path.read_bytes()[start:cut].decode(errors="replace")
        else:
            text = ""
        return results, text[-4000:], timed_out

    def _start(self, key: tuple, nproc: int) -> _Server:
        if self.root is not None:
            Path(self.root).mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="hetsim-pool-", dir=self.root))
        log = open(folder / "torchrun.log", "wb")  # noqa: SIM115 (closed by close())
        self.launches += 1
        return _Server(key=key, proc=start_torchrun(nproc, Launch(), ["--serve", str(folder)], log), folder=folder,
                       log=log)

    def close(self) -> None:
        """Stop the running torchrun: the ranks end at the stop file; whatever is left is stopped."""
        srv, self._server = self._server, None
        if srv is None:
            return
        (srv.folder / "stop").touch()
        try:
            srv.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        stop_run(srv.proc, str(srv.folder))
        srv.log.close()
