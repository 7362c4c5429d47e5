"""Accuracy gate: the recorded predicted-vs-measured pairs of the fidelity suite must stay in bounds.

results/bench/fidelity.json is written by `nox -s bench` (real runs on the default emulated
cluster) and committed.  These tests only read it:

1. the recorded pairs: step-time MAPE <= hetsim.search.golden.STEP_TIME_MAPE_MAX (and the summary figures
   are the ones the pairs give);
2. the current cost model replayed on the recorded measurements: every recorded plan predicted
   again from the recorded profiles it was measured with, against the recorded measurement. A cost
   model change that makes predictions worse fails here without running anything.

A gate that cannot check fails, never skips: a missing fidelity.json, or profiles whose sha256 no
longer matches the ones the fidelity run recorded, is a failure that says what to record.
"""

from __future__ import annotations

import json
import shutil

import pytest
from hetsim.search import golden

FIDELITY = golden.RESULTS / "bench" / "fidelity.json"


@pytest.fixture(scope="module")
def fidelity() -> dict:
    if not FIDELITY.exists():
        pytest.fail(f"{FIDELITY} is not recorded: run `nox -s bench` on a quiet machine and commit it")
    return json.loads(FIDELITY.read_text())


def test_recorded_pairs_within_bound(fidelity):
    records = fidelity["plans"]
    acc = golden.accuracy_of(records)
    assert acc.n_plans == fidelity["n_plans"] >= 20, "the fidelity suite has fewer than 20 executed plans"
    for key in ("step_time_mape", "step_time_max_err", "peak_mem_mape", "kendall_tau"):
        assert getattr(acc, key) == pytest.approx(fidelity[key], rel=1e-9), f"{key} does not follow from the pairs"
    failed = [r["label"] for r in records if r["status"] != "ok"]
    assert not failed, f"plans of the recorded suite that did not run: {failed}"
    assert acc.step_time_mape <= golden.STEP_TIME_MAPE_MAX, (
        f"recorded step-time MAPE {acc.step_time_mape:.3f} > {golden.STEP_TIME_MAPE_MAX} over {acc.n_plans} plans"
    )


def test_current_cost_model_on_recorded_measurements(fidelity):
    now = golden.profile_digests(golden.RESULTS, fidelity["model"])
    changed = sorted(k for k in set(now) | set(fidelity["profiles"]) if now.get(k) != fidelity["profiles"].get(k))
    assert not changed, (
        f"the accuracy gate is stale: {', '.join(changed)} changed since {FIDELITY.name} was recorded (sha256 "
        "differs), so its measurements belong to other profiles and nothing checks the cost model against real "
        "runs; record both together (`rm -r results/profiles/emu-cpu && nox -s bench`, see results/README.md) "
        "or restore the profiles with `git checkout results/profiles`")
    replayed = golden.replay(fidelity, golden.RESULTS)
    acc = golden.accuracy_of(replayed)
    worst = sorted(replayed, key=lambda r: -abs(golden.rel_err(r["pred_step_time_s"], r["meas_step_time_s"])))[:3]
    detail = "; ".join(f"{r['label']}: {golden.rel_err(r['pred_step_time_s'], r['meas_step_time_s']):+.1%}"
                       for r in worst)
    assert acc.step_time_mape <= golden.STEP_TIME_MAPE_MAX, (
        f"the current cost model's step-time MAPE on the recorded runs is {acc.step_time_mape:.3f} "
        f"> {golden.STEP_TIME_MAPE_MAX} (worst: {detail})"
    )
    assert acc.peak_mem_mape <= golden.PEAK_MEM_MAPE_MAX, (
        f"the current cost model's peak-memory MAPE on the recorded runs is {acc.peak_mem_mape:.3f} "
        f"> {golden.PEAK_MEM_MAPE_MAX}"
    )


def test_replay_cli_prints_every_plan_and_refuses_a_missing_run(fidelity, capsys, tmp_path):
    assert golden.main(["--replay", str(FIDELITY), "--root", str(golden.RESULTS)]) == 0
    lines = capsys.readouterr().out.splitlines()
    acc = golden.accuracy_of(golden.replay(fidelity, golden.RESULTS))
    assert f"step-time MAPE {acc.step_time_mape:.4f}" in lines[0]
    assert len(lines) == 1 + sum(r["status"] == "ok" for r in fidelity["plans"])
    missing = tmp_path / "missing.json"
    assert golden.main(["--replay", str(missing), "--root", str(golden.RESULTS)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "nox -s bench" in err and err.count("\n") == 1


def test_replay_runs_cli_replays_each_kept_run_with_its_recording(capsys, tmp_path):
    """Every fidelity file beside its recording is replayed (the gpt suite's files name no optimizer); one
    whose recording lacks its cluster's size (the tensor-parallel suite records four devices elsewhere)
    is left out; the kinds of plan are summed over the runs."""
    runs = tmp_path / "runs"
    (runs / "recording-X-a").mkdir(parents=True)
    shutil.copytree(golden.RESULTS / "profiles", runs / "recording-X-a" / "profiles")
    fid = json.loads(FIDELITY.read_text())
    (runs / "fidelity-X-a.json").write_text(json.dumps(fid))
    (runs / "fidelity_gpt-X-a.json").write_text(json.dumps(
        {k: v for k, v in fid.items() if k != "optimizer"} | {"plans": fid["plans"][:3]}))
    (runs / "fidelity_tp-X-a.json").write_text(json.dumps(fid | {"cluster": "emu:1.0@2G,1.0@2G,0.5@1G,0.5@1G"}))
    (runs / "fidelity-Y-b.json").write_text(json.dumps(fid))  # no recording-Y-b beside it
    assert [p.name for p, _ in golden.replay_runs(runs)] == ["fidelity-X-a.json", "fidelity_gpt-X-a.json"]
    assert golden.main(["--replay-runs", str(runs)]) == 0
    out = capsys.readouterr().out
    acc = golden.accuracy_of(golden.replay(fid, golden.RESULTS))
    assert f"fidelity-X-a.json: step-time MAPE {acc.step_time_mape:.4f}" in out
    assert "by kind of plan over 2 runs" in out and "fidelity_gpt: " in out and "fidelity_tp" not in out
    assert golden.main(["--replay-runs", str(tmp_path / "empty")]) == 2
    assert "no fidelity" in capsys.readouterr().err
