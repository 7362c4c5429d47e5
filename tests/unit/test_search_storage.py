"""The search keeps its trials: batched journal writes, resume to the study's total, --jobs workers.

On the golden catalog case (recorded profiles, simulation only, no process group): a journal study
filled by `run_search` holds exactly --trials finished trials, each with its plan; resuming adds only
the missing ones; two worker processes (`jobs=2`) store every trial; a journal whose last line was
torn by a kill is still read, and the next write cuts the torn line off instead of gluing onto it.
"""

from __future__ import annotations

import json

import optuna
import pytest
from hetsim.search import golden
from hetsim.search.persist import FLUSH_EVERY_S, TrialWriter, make_storage
from hetsim.search.study import complete_count, feasible_candidates, open_study, run_search

from hetsim import strategies
from hetsim.errors import ConfigError

CASE = next(c for c in golden.CASES if c.name == "catalog-mixed")


@pytest.fixture(scope="module")
def ctx():
    return golden._context(CASE, golden.RESULTS)


def _stored(path) -> list[optuna.trial.FrozenTrial]:
    st = optuna.load_study(study_name="s", storage=make_storage(f"journal:{path}"))
    return st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def test_journal_study_holds_exactly_the_trials_and_resumes_to_the_total(tmp_path, ctx):
    path = tmp_path / "h.journal"
    study = open_study("s", f"journal:{path}", seed=0)
    run_search(study, ctx, strategies.names(), 40)
    first = _stored(path)
    assert len(first) == 40
    assert all("plan" in t.user_attrs or "infeasible" in t.user_attrs for t in first)
    assert feasible_candidates(study)  # the caller's study object reads what the writer stored

    again = open_study("s", f"journal:{path}", seed=0)
    run_search(again, ctx, strategies.names(), 70)
    second = _stored(path)
    assert len(second) == 70
    assert sorted(t.number for t in second) == list(range(70))
    old = {t.number: (t.params, t.value) for t in first}
    assert {t.number: (t.params, t.value) for t in second if t.number < 40} == old  # kept, unchanged


def test_two_jobs_store_every_trial(tmp_path, ctx):
    path = tmp_path / "h.journal"
    study = open_study("s", f"journal:{path}", seed=0)
    run_search(study, ctx, strategies.names(), 60, jobs=2)
    stored = _stored(path)
    assert len(stored) == 60 == complete_count(study)
    assert sorted(t.number for t in stored) == list(range(60))
    # Both workers searched: the second one's plans are there too (not 60 copies of one search).
    assert len({json.dumps(t.params, sort_keys=True, default=str) for t in stored}) > 40


def test_jobs_need_a_journal(ctx):
    study = open_study("s", None, seed=0)
    with pytest.raises(ConfigError, match="journal"):
        run_search(study, ctx, strategies.names(), 10, jobs=2)


def test_a_torn_last_line_is_skipped_then_cut_before_the_next_write(tmp_path, ctx):
    path = tmp_path / "h.journal"
    study = open_study("s", f"journal:{path}", seed=0)
    run_search(study, ctx, strategies.names(), 25)
    with open(path, "ab") as f:
        f.write(b'{"op_code": 4, "study_id": 0, "datetime_sta')  # a writer killed mid-line
    assert len(_stored(path)) == 25  # Optuna's reader skips the torn tail
    # A resumed search appends after it: the file stays readable and holds every trial.
    run_search(open_study("s", f"journal:{path}", seed=0), ctx, strategies.names(), 45)
    assert len(_stored(path)) == 45
    assert path.read_bytes().endswith(b"\n")


def test_writer_batches_and_the_flush_bound(tmp_path, ctx):
    """Trials are written when a second has passed since the last write (and on flush): what a kill
    can lose is what finished within FLUSH_EVERY_S."""
    path = tmp_path / "h.journal"
    study = open_study("s", f"journal:{path}", seed=0)
    mem = optuna.create_study(direction="maximize")
    run_search(mem, ctx, strategies.names(), 5)
    writer = TrialWriter(study, every_s=3600.0)
    for t in mem.get_trials(deepcopy=False):
        writer.add(t)
    assert len(_stored(path)) == 0  # within the interval: pending
    writer.flush()
    assert len(_stored(path)) == len(mem.trials) and writer.written == len(mem.trials)
    assert FLUSH_EVERY_S <= 1.0


def test_default_study_name_follows_the_search_space():
    """A run with other --precisions (or without checkpointing, or another --min-local-batch) gets a
    study of its own; the defaults keep the name that earlier runs resume."""
    from hetsim.search.options import default_study_name

    base = default_study_name("resnet50@224", "catalog:v100_sxm2_16gb", 256, ("ddp", "zero"))
    assert base == "resnet50@224-catalog_v100_sxm2_16gb-b256-ddp+zero"
    assert default_study_name("resnet50@224", "catalog:v100_sxm2_16gb", 256, ("ddp", "zero"),
                              ("bf16", "fp32")) == base
    fp16 = default_study_name("resnet50@224", "catalog:v100_sxm2_16gb", 256, ("ddp", "zero"), ("fp16",))
    assert fp16 == base + "-fp16"
    assert default_study_name("m", "c", 8, ("ddp",), checkpointing=False, min_local_batch=4) == "m-c-b8-ddp-nockpt-minlb4"
    long = default_study_name("m" * 200, "c", 8, ("ddp",), ("fp16",))
    assert len(long) == 120 and long.endswith("-fp16")


def test_a_resumed_study_shows_this_runs_predictions(tmp_path, ctx, monkeypatch):
    """Stored predictions are those of the run that stored them (other profiles after --reprofile, a
    new calibration): on resume, every candidate is predicted again with this run's cost model."""
    import io
    from dataclasses import replace

    from hetsim.search import study as study_mod
    from rich.console import Console

    path = tmp_path / "h.journal"
    quiet = Console(file=io.StringIO())
    first = study_mod.search_step(open_study("s", f"journal:{path}", seed=0), ctx, strategies.names(), 30, quiet,
                                  lambda: False)
    stale = [replace(c, prediction=replace(c.prediction, samples_per_s=c.prediction.samples_per_s * 3))
             for c in first]
    again = study_mod.predicted_again(stale, ctx)
    for c in again:
        fresh = strategies.get(c.plan.strategy).predict(c.plan, ctx.cost)[0]
        assert c.prediction.samples_per_s == fresh.samples_per_s
    assert [c.prediction.samples_per_s for c in again] == sorted((c.prediction.samples_per_s for c in again),
                                                                 reverse=True)
    calls = []
    monkeypatch.setattr(study_mod, "predicted_again", lambda found, c: calls.append(len(found)) or found)
    study_mod.search_step(open_study("s", f"journal:{path}", seed=0), ctx, strategies.names(), 30, quiet,
                          lambda: False)
    assert calls == [len(first)]  # resumed (30 trials stored): predicted again
