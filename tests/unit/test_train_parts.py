"""hetsim.search.train's parts without a process group: sampler, plan files, rebalancing, monitoring,
the launch script and bad input."""

from __future__ import annotations

import json

import pytest
from hetsim.search.export import best_row, torchrun_lines, write_launch_script
from hetsim.search.train import __main__ as cli
from hetsim.search.train.monitor import StepRecord, split_phases, write_trace
from hetsim.search.train.rebalance import compare_last, decide, resolve
from hetsim.search.train.sampler import PlanSampler, proportional_split
from hetsim.strategies.ddp import DDPPlan

from hetsim.errors import ConfigError
from hetsim.execution.planfile import PlanFile, load_plan_file, save_plan_file
from hetsim.execution.runner import Launch, device_dicts
from hetsim.hardware.cluster import parse_cluster
from hetsim.profiling.hostspeed import ELASTICITY
from hetsim.serial import to_dict


@pytest.mark.parametrize("n", [64, 100, 103])
@pytest.mark.parametrize("shares", [(20, 12), (1, 30, 1), (32,)])
def test_every_sample_once_per_epoch(n, shares):
    samplers = [PlanSampler(n, shares, r, seed=3) for r in range(len(shares))]
    seen = []
    for _ in range(samplers[0].steps_per_epoch()):
        sizes = set()
        for s in samplers:
            idx, size = s.next_batch()
            seen += idx
            sizes.add(size)
        assert len(sizes) == 1
    assert sorted(seen) == list(range(n))


def test_order_is_deterministic_for_a_seed_and_differs_between_epochs():
    a, b = PlanSampler(50, (7, 3), 0, seed=1), PlanSampler(50, (7, 3), 0, seed=1)
    first = [a.next_batch()[0] for _ in range(5)]
    assert first == [b.next_batch()[0] for _ in range(5)]
    assert first != [a.next_batch()[0] for _ in range(5)]  # epoch 1


def test_resume_state_continues_the_same_stream():
    a = PlanSampler(40, (6, 4), 1, seed=2)
    for _ in range(7):
        a.next_batch()
    b = PlanSampler(40, (6, 4), 1, seed=2)
    b.load_state(json.loads(json.dumps(a.state())))
    assert [a.next_batch() for _ in range(6)] == [b.next_batch() for _ in range(6)]


def test_shares_can_change_between_steps():
    s = [PlanSampler(64, (16, 16), r) for r in range(2)]
    s[0].next_batch(), s[1].next_batch()
    for x in s:
        x.shares = (24, 8)
    assert [len(x.next_batch()[0]) for x in s] == [24, 8]


def test_proportional_split_of_a_short_batch():
    assert proportional_split(7, (20, 12)) == (4, 3)
    assert sum(proportional_split(5, (2, 2, 2))) == 5
    assert proportional_split(40, (20, 12)) == (20, 12)


def test_drop_last_skips_the_short_batch():
    s = PlanSampler(70, (32,), 0, drop_last=True)
    assert s.steps_per_epoch() == 2
    sizes = [s.next_batch()[1] for _ in range(3)]
    assert sizes == [32, 32, 32] and s.epoch == 1


def test_rebalance_gives_a_slower_rank_fewer_samples():
    assert resolve([0.01, 0.02], 30, 1) == (20, 10)
    assert resolve([0.01, 0.01], 32, 1) == (16, 16)
    assert resolve([0.01, 0.05], 30, 8) == (22, 8)  # the floor (accumulation steps) holds


def _window(shares, per_sample, opt, rest, probe=0.0, steps=5):
    """Every rank's records of `steps` steps: compute per_sample[r] x share, wall = slowest compute + opt + rest."""
    comp = [p * b for p, b in zip(per_sample, shares)]
    wall = max(comp) + max(opt) + rest
    return [[StepRecord(step=i, start_s=0.0, wall_s=wall, compute_s=c, optimizer_s=o, samples=b, probe_s=probe)
             for i in range(steps)] for c, o, b in zip(comp, opt, shares)]


def test_rebalance_balances_compute_and_replays_the_window():
    # Rank 1 slowed 2x, its optimizer too: compute is balanced (22/11 of 33), the optimizer is not.
    w = _window((17, 16), (0.01, 0.02), (0.05, 0.10), rest=0.02)
    d = decide(w, 33, 1)
    assert d.shares == (22, 11)
    assert d.current_step_s == pytest.approx(0.32 + 0.10 + 0.02)
    assert d.predicted_step_s == pytest.approx(0.22 + 0.10 + 0.02)
    assert d.changes and d.probe_s == 0.0


def test_rebalance_keeps_a_split_within_the_noise():
    w = _window((17, 15), (0.0100, 0.0105), (0.05, 0.05), rest=0.02)
    d = decide(w, 32, 1)
    assert d.shares == (16, 16)
    assert not d.changes  # 1.6 % faster predicted: below MIN_GAIN


def test_the_last_steps_are_compared_at_the_predictions_host_speed():
    before = _window((16, 16), (0.01, 0.01), (0.0, 0.0), rest=0.0, probe=0.010, steps=10)
    after = _window((16, 16), (0.01, 0.01), (0.0, 0.0), rest=0.0, probe=0.020, steps=20)  # host twice as slow
    every = [a + b for a, b in zip(before, after)]
    for recs in every:
        for i, r in enumerate(recs):
            r.step = i
    rb = [{"step": 10, "predicted_step_s": 0.16, "probe_s": 0.010}]
    check = compare_last(every, rb)
    assert check["steps"] == 20
    assert check["measured_raw_step_s"] == pytest.approx(0.16)
    at_pred = 0.16 * 0.5 ** ELASTICITY  # at the prediction's probe: a step follows ELASTICITY of the probe
    assert check["measured_step_s"] == pytest.approx(at_pred)
    assert check["ratio"] == pytest.approx(0.16 / at_pred) and check["ratio_raw"] == pytest.approx(1.0)
    assert compare_last([recs[:15] for recs in every], rb) is None  # fewer than 20 steps


def _rec(step, wall, compute, opt=0.0, start=0.0):
    return StepRecord(step=step, start_s=start, wall_s=wall, compute_s=compute, optimizer_s=opt, samples=8)


def test_phases_add_up_and_idle_is_waiting_for_the_slowest():
    recs = [[_rec(0, 1.0, 0.5, 0.1)], [_rec(0, 1.0, 0.8, 0.1)]]
    fast, slow = split_phases(recs, 0)
    for ph in (fast, slow):
        assert ph["compute_s"] + ph["optimizer_s"] + ph["idle_s"] + ph["comm_s"] == pytest.approx(ph["wall_s"])
    assert fast["idle_s"] == pytest.approx(0.3) and slow["idle_s"] == 0.0
    assert fast["comm_s"] == pytest.approx(slow["comm_s"]) == pytest.approx(0.1)


def test_trace_has_a_track_per_rank(tmp_path):
    recs = [[_rec(i, 1.0, 0.6, 0.1, start=i) for i in range(3)] for _ in range(2)]
    write_trace(recs, tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["tid"] for e in ev} == {0, 1}
    assert {e["name"] for e in ev if e["ph"] == "X"} >= {"compute", "optimizer", "comm"}


def _plan_file(tmp_path, workload="mlp", spec="emu:1.0@4G,1.0@4G"):
    cluster = parse_cluster(spec)
    plan = DDPPlan(devices=(0, 1), local_batch=(20, 12))
    pf = PlanFile(plan=to_dict(plan), label="ddp 20/12", cluster_spec=spec, devices=device_dicts(cluster, (0, 1)),
                  workload=workload, global_batch=32, predicted_samples_per_s=10.0)
    return save_plan_file(pf, tmp_path / "best_plan.json"), pf


def test_plan_file_round_trips(tmp_path):
    path, pf = _plan_file(tmp_path)
    assert load_plan_file(path) == pf


@pytest.mark.parametrize("content", ["not json", "[]", '{"format": 99, "plan": {}}', '{"format": 1}'])
def test_a_foreign_plan_file_is_one_clear_error(tmp_path, content):
    p = tmp_path / "p.json"
    p.write_text(content)
    with pytest.raises(ConfigError, match="plan file"):
        load_plan_file(p)


def test_launch_script_runs_the_plan_on_its_ranks(tmp_path):
    path, pf = _plan_file(tmp_path)
    sh = write_launch_script(tmp_path, path, pf, Launch()).read_text()
    assert "--nproc-per-node 2" in sh and "-m hetsim.search.train" in sh and str(path.resolve()) in sh
    assert "127.0.0.1" in sh  # nothing listens off-host
    assert f"--log-dir {path.resolve().parent / 'torchelastic'} " in sh  # no /tmp/torchelastic_* left behind
    multi = torchrun_lines(path, pf, Launch(nnodes="2", rdzv_endpoint="head:29400"))
    assert len(multi) == 2 and all("--rdzv-endpoint head:29400" in line for line in multi)
    assert "--node-rank 1" in multi[1]


def test_best_row_prefers_the_best_measurement(tmp_path):
    from hetsim.reporting.report import Row
    from hetsim.types import Measurement, Prediction

    def row(i, pred_sps, meas_step):
        p = Prediction(step_time_s=32 / pred_sps, samples_per_s=pred_sps, peak_mem_bytes=(1, 1), memory=(), capacity_bytes=(2, 2),
                       feasible=True)
        m = Measurement(status="ok", step_time_s=meas_step, samples_per_s=32 / meas_step) if meas_step else None
        return Row(place=i, label=str(i), plan=DDPPlan(devices=(0, 1), local_batch=(16, 16)), predicted=p, measured=m)

    assert best_row([row(1, 100, 0.5), row(2, 90, 0.4)]).label == "2"
    assert best_row([row(1, 100, None), row(2, 90, None)]).label == "1"


def _args(*argv):
    return cli.parser().parse_args(list(argv))


def test_bad_input_is_one_clear_error(tmp_path, capsys):
    path, _ = _plan_file(tmp_path)
    cases = {
        ("--plan", str(tmp_path / "missing.json")): "no such file",
        ("--plan", str(path), "--model", "resnet18@64"): "not the model the plan was found for",
        ("--plan", str(path), "--steps", "0"): "--steps 0",
        ("--plan", str(path), "--slow", "5:2@3"): "--slow",
        ("--plan", str(path), "--data", "tests.unit.test_train_parts:tiny_dataset"): "fewer than one global batch",
    }
    for argv, want in cases.items():
        assert cli.main([*argv, "--check", "--no-tensorboard"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("hetsim: error:") and want in err[0], (argv, err)


def tiny_dataset():
    import torch
    from torch.utils.data import TensorDataset

    return TensorDataset(torch.zeros(10, 64), torch.zeros(10, dtype=torch.long))


def test_a_checkpoint_of_another_plan_is_refused_and_kept(tmp_path, capsys):
    path, pf = _plan_file(tmp_path)
    ck = tmp_path / "ck"
    (ck / "step-00000004").mkdir(parents=True)
    meta = {"name": "step-00000004", "step": 4, "fingerprint": "another", "label": "zero3 16/16"}
    (ck / "step-00000004" / "meta.json").write_text(json.dumps(meta))
    (ck / "latest").write_text("step-00000004")
    assert cli.main(["--plan", str(path), "--checkpoint-dir", str(ck), "--check", "--no-tensorboard"]) == 2
    assert "another plan" in capsys.readouterr().err
    assert json.loads((ck / "step-00000004" / "meta.json").read_text()) == meta


def test_tensorboard_scalars_are_written(tmp_path):
    from hetsim.search.train.monitor import Scalars

    recs = [[_rec(i, 1.0, 0.6, 0.1, start=i) for i in range(2)] for _ in range(2)]
    sc = Scalars(tmp_path / "tb")
    for i in range(2):
        sc.write(recs, i, 32.0)
    sc.close()
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert files and files[0].stat().st_size > 100


def test_the_printed_launch_command_is_one_line_on_a_narrow_console(tmp_path, monkeypatch):
    """A log of the search (stdout not a terminal) keeps `bash .../launch.sh` whole, to copy or grep."""
    import io

    from hetsim.search import app
    from rich.console import Console

    folder = tmp_path / ("a-long-study-name-" * 6) / "report"
    folder.mkdir(parents=True)
    path, _ = _plan_file(folder)
    monkeypatch.setattr(app, "export_plans", lambda *a, **k: folder / "launch.sh")
    out = io.StringIO()
    app.export_step(folder, type("P", (), {"rows": ()})(), type("O", (), dict(
        cluster=None, workload=type("W", (), {"spec": "mlp", "optimizer": "adamw"})(), study="s", launch=None))(),
        Console(file=out, width=60))
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and f"bash {folder / 'launch.sh'} " in lines[0] and "ddp 20/12" in lines[0]
