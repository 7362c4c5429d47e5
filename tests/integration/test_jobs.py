"""`--jobs 2`: two search worker processes on one study finish the same number of trials as one, all stored."""

from __future__ import annotations

import optuna
import pytest
from clitools import TINY, run_cli
from hetsim.search.persist import make_storage

pytestmark = pytest.mark.slow


def _stored(out, study: str) -> list[optuna.trial.FrozenTrial]:
    st = optuna.load_study(study_name=study, storage=make_storage(f"journal:{out / 'hetsim.journal'}"))
    return st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def test_two_jobs_store_as_many_trials_as_one(seeded_out):
    out = seeded_out
    for jobs, study in (("1", "one"), ("2", "two")):
        p = run_cli(*TINY, "--out", str(out), "--study", study, "--trials", "40", "--no-execute", "--jobs", jobs)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "40 trials" in p.stdout
    one, two = _stored(out, "one"), _stored(out, "two")
    assert len(one) == len(two) == 40
    assert sorted(t.number for t in two) == list(range(40))
    assert all("plan" in t.user_attrs or "infeasible" in t.user_attrs for t in two)


def test_jobs_refuse_sqlite(seeded_out):
    p = run_cli(*TINY, "--out", str(seeded_out), "--trials", "5", "--no-execute", "--jobs", "2",
                "--storage", f"sqlite:///{seeded_out / 'x.db'}")
    assert p.returncode == 2
    assert p.stderr.startswith("hetsim: error: --jobs 2") and "journal" in p.stderr
