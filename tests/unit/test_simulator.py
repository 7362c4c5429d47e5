import pytest

from hetsim.model.simulator import DeadlockError, TaskGraph, run_graph, run_steady


def test_program_order_and_dependencies():
    g = TaskGraph()
    a = g.add("dev0", "F", 1.0)
    b = g.add("dev1", "F", 2.0, deps=[a])
    c = g.add("dev0", "B", 0.5)
    d = g.add("comm", "allreduce", 1.0, deps=[b, c])
    s = run_graph(g)
    assert s.start_s[b] == 1.0 and s.end_s[b] == 3.0
    assert s.start_s[c] == 1.0  # dev0 runs c right after a, in program order
    assert s.start_s[d] == 3.0 and s.makespan_s == 4.0
    assert s.busy_s(g, "dev0") == pytest.approx(1.5)


def test_deadlock_is_detected():
    g = TaskGraph()
    first = g.add("dev0", "recv", 1.0, deps=[1])  # waits for dev1's task, which waits for dev0's second
    g.add("dev1", "send", 1.0, deps=[2])
    g.add("dev0", "send", 1.0)
    assert first == 0
    with pytest.raises(DeadlockError, match="deadlocks"):
        run_graph(g)


def test_timeline_matches_schedule():
    g = TaskGraph()
    g.add("dev0", "F", 0.25, label="F0")
    g.add("dev0", "B", 0.5, label="B0")
    s = run_graph(g)
    ev = s.timeline(g)
    assert [(e.label, e.start_s, e.end_s) for e in ev] == [("F0", 0.0, 0.25), ("B0", 0.25, 0.75)]


def _two_rank_step(g: TaskGraph) -> None:
    """A model-parallel step: rank 1's optimizer step (3 s) outlasts rank 0's backward and optimizer."""
    f0 = g.add("dev0", "F", 1.0)
    f1 = g.add("dev1", "F", 2.0, [f0])
    b1 = g.add("dev1", "B", 2.0, [f1])
    b0 = g.add("dev0", "B", 1.0, [b1])
    g.add("dev0", "opt", 0.1, [b0])
    g.add("dev1", "opt", 3.0, [b1])


def test_steady_period_overlaps_a_long_optimizer_step_with_the_next_step():
    g = TaskGraph()
    _two_rank_step(g)
    s = run_steady(g)
    assert s.step.makespan_s == pytest.approx(8.0)  # 1 + 2 + 2, then rank 1's optimizer
    # Rank 0 starts its next forward at 6.1; rank 1 loops through F, B and its optimizer: 7 s.
    assert s.period_s == pytest.approx(7.0)


def test_steps_that_start_at_a_barrier_take_one_step_s_makespan():
    """An emulated cluster's runs start every step together (rank 0 times the host probe while the
    others wait), so rank 1's long optimizer step is not hidden behind rank 0's next forward."""
    g = TaskGraph()
    _two_rank_step(g)
    s = run_steady(g, barrier=True)
    assert s.step.makespan_s == pytest.approx(8.0)
    assert s.period_s == pytest.approx(8.0)
    assert run_steady(g).step.end_s == s.step.end_s  # the same first step either way


def test_steady_period_waits_for_a_collective_that_ends_the_step():
    g = TaskGraph()
    _two_rank_step(g)
    g.add("comm", "allgather", 1.0, [4, 5], label="param broadcast")  # after both optimizer steps
    s = run_steady(g)
    assert s.step.makespan_s == pytest.approx(9.0)
    assert s.period_s == pytest.approx(9.0)  # no rank starts its next step before the broadcast
