"""Pipeline schedules as data: action lists, their simulation, bubbles and in-flight memory."""

from __future__ import annotations

import pytest
from hetsim.strategies._pipeline_sched import (
    Action,
    _single_stage_actions,
    available_schedules,
    inflight_counts,
    rank_actions,
)
from hetsim.strategies.pipeline import PipelinePlan
from pipeline_synth import synthetic_cost

from hetsim import strategies
from hetsim.errors import InfeasiblePlanError, UnknownNameError
from hetsim.model.memory import LOSS_KEPT_COPIES

PIPE = strategies.get("pipeline")


def uniform_plan(p: int, m: int, schedule: str, v: int = 1, per_stage: int = 2) -> PipelinePlan:
    s = p * v
    return PipelinePlan(devices=tuple(range(p)), boundaries=tuple(range(0, s * per_stage + 1, per_stage)),
                        schedule=schedule, microbatches=m, batch=4 * m)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_bubble_matches_analytic(p, m):
    """Equal devices, stages of equal time, free communication and a free optimizer step.

    The analytic bubble (p - 1) / (m + p - 1) counts forward and backward compute only, so the
    synthetic cost model has zero p2p time and zero optimizer time (predict counts 'opt' as busy;
    with opt > 0 the simulated bubble would be slightly lower).  1F1B needs m >= p in torch.
    """
    cost = synthetic_cost([1.0] * p, [1e-3] * (2 * p))
    analytic = (p - 1) / (m + p - 1)
    for schedule in ("GPipe", "1F1B"):
        if schedule == "1F1B" and m < p:
            continue
        pred, _, _ = PIPE.predict(uniform_plan(p, m, schedule), cost)
        assert pred.bubble_fraction == pytest.approx(analytic, abs=0.01), (schedule, p, m)


@pytest.mark.parametrize("p", [2, 4])
def test_interleaving_shrinks_the_bubble(p):
    """Interleaved 1F1B with v stages per rank: bubble (p - 1) / (v m + p - 1) < plain 1F1B's (Narayanan et al.)."""
    m = 2 * p
    cost = synthetic_cost([1.0] * p, [1e-3] * (4 * p))
    plain, _, _ = PIPE.predict(uniform_plan(p, m, "1F1B", per_stage=4), cost)
    inter, _, _ = PIPE.predict(uniform_plan(p, m, "Interleaved1F1B", v=2, per_stage=2), cost)
    assert inter.bubble_fraction < plain.bubble_fraction
    assert inter.bubble_fraction == pytest.approx((p - 1) / (2 * m + p - 1), abs=0.01)


def _torch_executed_order(schedule: str, p: int, m: int) -> list[list[str]]:
    """Run torch's own single-stage _step_microbatches with stand-in stages that log their calls."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    class Stage:
        def __init__(self, s):
            self.stage_index, self.num_stages = s, p
            self.is_first, self.is_last = s == 0, s == p - 1
            self.group_rank, self.group_size, self.submod = s, p, None
            self.log: list[str] = []

        def forward_one_chunk(self, i, *args, **kwargs):
            self.log.append(f"{self.stage_index}F{i}")

        def backward_one_chunk(self, i, *args, **kwargs):
            self.log.append(f"{self.stage_index}B{i}")

        def get_fwd_recv_ops(self, i):
            return []

        get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

        def perform_reduce_grad(self, *args):
            pass

    out = []
    for s in range(p):
        stage = Stage(s)
        sched = get_schedule_class(schedule)(stage, m)
        sched._initialize_stage = lambda *a, **k: None
        sched._maybe_compute_loss = lambda *a, **k: None
        sched._maybe_get_loss = lambda *a, **k: None
        sched._update_losses = lambda *a, **k: None
        sched._step_microbatches([()] * m, [{}] * m, None, None)
        out.append(stage.log)
    return out


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 2), (2, 4), (4, 4), (4, 8)])
def test_single_stage_order_is_what_torch_runs(schedule, p, m):
    if schedule == "1F1B" and m < p:
        pytest.skip("torch's 1F1B needs m >= p")
    ours = [[str(a) for a in acts] for acts in _single_stage_actions(schedule, p, m)]
    assert ours == _torch_executed_order(schedule, p, m)


def test_multi_stage_order_is_torchs_pipeline_order():
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in ("Interleaved1F1B", "ZBVZeroBubble"):
        if name not in available_schedules():
            continue
        stages = [SimpleNamespace(group_rank=0, group_size=2, num_stages=4, submod=None) for _ in range(2)]
        torch_order = get_schedule_class(name)(stages, 4).pipeline_order
        ours = rank_actions(name, 2, 4, 2)
        for r in range(2):
            assert [str(a) for a in ours[r]] == [str(a) for a in torch_order[r] if a is not None]


def test_action_round_trip():
    for text in ("0F0", "12B3", "1I7", "3W10"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="2F0"):
        Action.parse("F")


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_activations_in_flight(p, m):
    """GPipe holds every micro-batch; torch's 1F1B holds at most p - s on stage s (the last stage
    also keeps each one's output and the loss's saved tensor: `LOSS_KEPT_COPIES` x 1000 bytes).  Every
    stage after the first also holds the receive slot of each of the m micro-batches by its last
    forward, 1000 bytes a sample, which these blocks' saved bytes are not known to include: no
    whole-model calibration says they share it."""
    assert inflight_counts(rank_actions("GPipe", p, m, 1), p) == (m,) * p
    assert inflight_counts(rank_actions("1F1B", p, m, 1), p) == tuple(min(m, p - s) for s in range(p))
    cost = synthetic_cost([1.0] * p, [1e-3] * p, act_bytes=[1e4] * p)
    gp = PIPE.memory(uniform_plan(p, m, "GPipe", per_stage=1), cost)
    ofob = PIPE.memory(uniform_plan(p, m, "1F1B", per_stage=1), cost)
    assert gp[0].activations_bytes == m * 4 * 10_000
    loss = [LOSS_KEPT_COPIES * 1000 if s == p - 1 else 0 for s in range(p)]
    received = [1000 if s > 0 else 0 for s in range(p)]
    assert [x.activations_bytes for x in ofob] == [min(m, p - s) * 4 * (10_000 + loss[s]) + m * 4 * received[s]
                                                   for s in range(p)]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                      "ZBVZeroBubble"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_every_schedule_simulates_all_its_work(schedule, p, m):
    if schedule not in available_schedules():
        pytest.skip(f"torch has no {schedule}")
    v = 1 if schedule in ("GPipe", "1F1B") else 2
    cost = synthetic_cost([1.0, 0.5, 0.8, 0.6][:p], [1e-3] * (p * v * 2), p2p_s_per_byte=1e-9, opt_s_per_param=1e-7)
    plan = uniform_plan(p, m, schedule, v=v)
    pred, sched, g = PIPE.predict(plan, cost)
    assert 0.0 <= pred.bubble_fraction < 1.0
    for d in plan.devices:
        compute = sched.busy_s(g, f"dev{d}", {"F", "B", "W"})
        expect = sum(cost.fwd_s(d, plan.boundaries[s], plan.boundaries[s + 1], 4)
                     + cost.bwd_s(d, plan.boundaries[s], plan.boundaries[s + 1], 4)
                     for s in range(plan.n_stages) if plan.stage_device(s) == d) * m
        assert compute == pytest.approx(expect)
    assert any(t.kind == "p2p" for t in g.tasks)


def test_label_names_model_parallel_and_stages():
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 5)
    mp = PipelinePlan(devices=(0, 1), boundaries=(0, 3, 5), schedule="GPipe", microbatches=1, batch=8)
    assert PIPE.label(mp) == "model parallel [0:3]@dev0 [3:5]@dev1"
    pp = PipelinePlan(devices=(1, 0), boundaries=(0, 2, 5), schedule="1F1B", microbatches=4, batch=8,
                      checkpoint_blocks=2)
    assert PIPE.label(pp) == "pipeline 1F1B m=4 [0:2]@dev1 [2:5]@dev0 ckpt 2"
    PIPE.validate(pp, cost)


def test_invalid_plans_say_why():
    cost = synthetic_cost([1.0, 0.5], [1e-3] * 5)
    with pytest.raises(InfeasiblePlanError, match="rise strictly"):
        PIPE.validate(PipelinePlan(devices=(0, 1), boundaries=(0, 3, 3, 5), schedule="GPipe", batch=8), cost)
    with pytest.raises(InfeasiblePlanError, match="GPipe"):
        PIPE.validate(PipelinePlan(devices=(0, 1), boundaries=(0, 3, 5), schedule="1F1B", microbatches=1,
                                   batch=8), cost)
    with pytest.raises(InfeasiblePlanError, match="divide"):
        PIPE.validate(PipelinePlan(devices=(0, 1), boundaries=(0, 3, 5), schedule="GPipe", microbatches=3,
                                   batch=8), cost)
    with pytest.raises(UnknownNameError, match="Interleaved1F1B"):
        PIPE.validate(PipelinePlan(devices=(0, 1), boundaries=(0, 3, 5), schedule="Zigzag", batch=8), cost)


def test_search_space_gives_valid_plans():
    import optuna
    from hetsim.strategies.base import SearchContext

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cost = synthetic_cost([1.0, 0.5, 0.8], [1e-3, 2e-3, 1e-3, 3e-3, 1e-3, 1e-3], p2p_s_per_byte=1e-9)
    ctx = SearchContext(cost=cost, global_batch=16, checkpointing=True)
    ok = 0

    def objective(trial):
        nonlocal ok
        try:
            plan = PIPE.space(trial, ctx)
        except InfeasiblePlanError:
            return float("inf")
        PIPE.validate(plan, cost)
        ok += 1
        return PIPE.predict(plan, cost)[0].step_time_s

    optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).optimize(objective, n_trials=30)
    assert ok >= 10
