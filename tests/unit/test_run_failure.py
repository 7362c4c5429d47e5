"""Which rank a failed run blames (`hetsim.execution.runner._failure`)."""

from hetsim.execution.runner import _failure
from hetsim.execution.worker import RankResult


def test_a_survivor_stopped_by_torchruns_sigterm_is_not_the_cause_of_a_killed_ranks_failure():
    # Rank 1 was SIGKILLed before it wrote a result; the agent then sent rank 0 SIGTERM, which torch's
    # handler raised as a SignalException that rank 0 reported as its own error.
    survivor = RankResult(rank=0, status="error", failed_at_s=12.0,
                          error="SignalException: Process 13186 got signal: 15\n  File ...")
    m = _failure({0: survivor}, 2, tail="", timed_out=False, timeout_s=60, wall=13.0)
    assert m.failed_rank == 1
    assert m.error.startswith("rank 1 ended before it wrote a result (then rank 0: SignalException"), m.error


def test_a_rank_that_raised_is_still_the_cause():
    crashed = RankResult(rank=1, status="error", failed_at_s=5.0, error="RuntimeError: injected crash")
    survivor = RankResult(rank=0, status="error", failed_at_s=6.0,
                          error="SignalException: Process 1 got signal: 15")
    m = _failure({0: survivor, 1: crashed}, 2, tail="", timed_out=False, timeout_s=60, wall=7.0)
    assert m.failed_rank == 1 and m.error.startswith("rank 1: RuntimeError: injected crash")
