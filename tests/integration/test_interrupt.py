"""Interrupted searches lose nothing.

- Ctrl-C (SIGINT) during a real run: that run finishes, nothing after it starts, the report of
  what is done is written, exit code 130.
- SIGKILL during the search and again during the real runs: rerunning the same command resumes
  the study; every trial written before a kill (trials are written once a second: a kill loses
  at most the last second's) and every measurement is still there, the trial
  count continues from the stored trials up to --trials (the study's total), and a stored
  measurement is not run again.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from clitools import ROOT, TINY, cli, processes_naming

pytestmark = pytest.mark.slow


def _load(out: Path, study: str):
    """The study as stored in the CLI's default journal (None before it exists)."""
    import optuna
    from hetsim.search.persist import make_storage

    path = out / "hetsim.journal"
    if not path.exists():
        return None
    try:
        return optuna.load_study(study_name=study, storage=make_storage(f"journal:{path}"))
    except KeyError:  # the study is not created yet
        return None


def complete_trials(out: Path, study: str) -> int:
    import optuna

    st = _load(out, study)
    return 0 if st is None else len(st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def measurements(out: Path, study: str) -> int:
    st = _load(out, study)
    return 0 if st is None else sum(k.startswith("measured:") for k in st.user_attrs)


def start(out: Path, study: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    log = out.parent / f"{study}-{time.monotonic_ns()}.log"
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cli(*TINY, "--out", str(out), "--study", study, "--timeout", "180", *extra),
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
    return proc, log


def wait_for(cond, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the CLI ended (rc {proc.returncode}) before the moment to interrupt it:\n"
                        f"{log.read_text()[-3000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail(f"timed out waiting to interrupt the CLI:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def wait_nothing_left(text: str, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while processes_naming(text) and time.monotonic() - t0 < timeout:
        time.sleep(0.5)
    assert not processes_naming(text), f"processes outlived the search: {processes_naming(text)}"


def study_state(out: Path, study: str) -> tuple[dict[int, tuple], dict[str, dict]]:
    """Finished trials by number (params, value, plan) and stored measurements by key."""
    import optuna

    st = _load(out, study)
    trials = {t.number: (t.params, t.value, t.user_attrs.get("plan"))
              for t in st.get_trials(states=(optuna.trial.TrialState.COMPLETE,))}
    meas = {k: v for k, v in st.user_attrs.items() if k.startswith("measured:")}
    return trials, meas


def test_ctrl_c_finishes_the_current_run_writes_the_report_and_exits_130(seeded_out):
    out, study = seeded_out, "ctrl-c"
    proc, log = start(out, study, "--trials", "6", "--top-k", "2")
    wait_for(lambda: (out / "runs" / study / "run-1" / "job.json").exists(), proc, log)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=300)
    text = log.read_text()
    assert rc == 130, text[-3000:]
    assert "Traceback" not in text
    assert "stopped early on Ctrl-C" in text and f"--study {study}" in text
    folder = out / "reports" / study
    s = json.loads((folder / "summary.json").read_text())
    assert s["candidates"][0]["measured"]["status"] == "ok"  # the run under way finished
    later = [c["measured"]["status"] for c in s["candidates"][1:]] + [s["baselines"]["uniform_ddp"]["measured"]["status"]]
    assert later and all(st in ("not_run", "ok") for st in later)
    assert measurements(out, study) == 1 + later.count("ok")  # an identical plan reuses run 1
    assert (folder / "report.md").exists() and (folder / "report.html").exists()
    wait_nothing_left(str(out))


def test_sigkill_loses_no_trial_or_measurement_and_resume_continues(seeded_out):
    out, study, total = seeded_out, "killed", "30"
    # Trials are written once a second (hetsim.search.persist.FLUSH_EVERY_S); a 0.1 s wait per trial
    # makes the search last ~3 s, so that the kill lands half-way.
    args = ("--trials", total, "--top-k", "1", "--trial-delay", "0.1")

    # 1. Killed during the search, once a batch of trials is written.
    proc, log = start(out, study, *args)
    wait_for(lambda: complete_trials(out, study) >= 6, proc, log)
    proc.kill()
    proc.wait()
    trials_a, _ = study_state(out, study)
    assert 6 <= len(trials_a) < int(total), "the search should have been killed half-way"

    # 2. The same command resumes: the count continues to --trials; killed during the real runs.
    proc, log = start(out, study, *args)
    wait_for(lambda: measurements(out, study) >= 1, proc, log)
    proc.kill()
    proc.wait()
    text = log.read_text()
    assert "resuming study 'killed'" in text
    trials_b, meas_b = study_state(out, study)
    assert {n: trials_b[n] for n in trials_a} == trials_a  # every finished trial is still there, unchanged
    assert len(trials_b) == int(total)
    assert min(set(trials_b) - set(trials_a)) > max(trials_a)  # numbering continues after the stored ones
    assert len(meas_b) >= 1
    wait_nothing_left(str(out))  # the killed search's torchrun and workers went with it

    # 3. The same command again: nothing finished is redone, the rest is run, the report written.
    proc, log = start(out, study, *args)
    rc = proc.wait(timeout=600)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "already measured" in text
    trials_c, meas_c = study_state(out, study)
    assert trials_c == trials_b  # no new trial: the study already holds --trials
    for key, m in meas_b.items():
        assert meas_c[key] == m  # the stored measurement was reused, not measured again
    s = json.loads((out / "reports" / study / "summary.json").read_text())
    first = s["candidates"][0]["measured"]
    stored = next(iter(meas_b.values()))
    assert first["status"] == "ok" and first["step_time_s"] == stored["step_time_s"]
    assert s["baselines"]["uniform_ddp"]["measured"]["status"] == "ok"
    assert len((out / "reports" / study / "trials.csv").read_text().splitlines()) - 1 >= int(total)
