"""Regression: the recorded profiles must still predict what results/golden/ says.

No hardware, no timing, no training: each case loads results/profiles/, simulates every
family's fixed plans and runs a seeded in-memory search (with a sampler whose draws do not depend
on the Optuna release), then compares the best plan, its predicted throughput and memory (within
hetsim.search.golden.REL_TOL) and the number of distinct feasible plans with the golden file.  A deliberate change: `nox -s regen`, review the diff of results/golden/, commit it.
"""

from __future__ import annotations

import json

import pytest
from hetsim.search import golden


@pytest.mark.parametrize("case", golden.CASES, ids=lambda c: c.name)
def test_case_matches_golden(case):
    now, diffs, notes = golden.check(case)
    for n in notes:
        print("note:", n)
    assert not diffs, (
        f"{case.name} no longer matches {golden.golden_path(case)} (tolerance {golden.REL_TOL:.1%}):\n  "
        + "\n  ".join(diffs)
        + "\nif the change is deliberate, run `nox -s regen` and commit the reviewed diff of results/golden/"
    )
    assert now["best"] is not None, f"{case.name}: the search found no feasible plan"


def test_every_golden_file_is_a_case():
    names = {c.name for c in golden.CASES}
    stale = [p.name for p in (golden.RESULTS / "golden").glob("*.json") if p.stem not in names]
    assert not stale, f"golden files {stale} belong to no case in hetsim.search.golden.CASES; delete them"


def test_golden_best_is_the_best_feasible_fixed_plan_or_better():
    """The search's best is at least as fast as every feasible fixed plan of the families it searched,
    up to what a finite search may miss (a sanity check of the golden data itself)."""
    for case in golden.CASES:
        path = golden.golden_path(case)
        if not path.exists():
            pytest.fail(f"{path} does not exist; run `nox -s regen`")
        data = json.loads(path.read_text())
        fixed = [r for rows in data["fixed_plans"].values() for r in rows if r.get("feasible")]
        assert data["best"] is not None and data["best"]["feasible"]
        best_fixed = max((r["samples_per_s"] for r in fixed), default=0.0)
        assert data["best"]["samples_per_s"] >= 0.9 * best_fixed, (case.name, data["best"]["label"])


def test_kendall_tau_and_mape_arithmetic():
    assert golden.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert golden.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # One swapped pair of six: (5 - 1) / 6.
    assert golden.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # With ties, tau-b (scipy's default): x = [1, 1, 2], y = [1, 2, 3] -> 2 / sqrt(2 * 3).
    assert golden.kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / 6**0.5)
    assert golden.mape([(1.1, 1.0), (0.9, 1.0)]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        golden.mape([])


def test_golden_search_draws_do_not_depend_on_order_or_release():
    """The golden search's sampler: a value is a function of (seed, trial number, name) alone."""
    import optuna
    from hetsim.search.study import KeyedRandomSampler

    cat = optuna.distributions.CategoricalDistribution(["a", "b", "c"])
    num = optuna.distributions.IntDistribution(1, 7)
    real = optuna.distributions.FloatDistribution(0.0, 1.0)

    def draws(seed: int, names: list[str]) -> dict:
        study = optuna.create_study(sampler=KeyedRandomSampler(seed))
        out = {}
        for _ in range(5):
            t = study.ask()
            for n in names:
                d = {"c": cat, "i": num, "f": real}[n[0]]
                out[(t.number, n)] = (t.suggest_categorical(n, d.choices) if n[0] == "c"
                                      else t.suggest_int(n, 1, 7) if n[0] == "i" else t.suggest_float(n, 0.0, 1.0))
            study.tell(t, 0.0)
        return out

    a = draws(0, ["cx", "iy", "fz"])
    assert a == draws(0, ["fz", "iy", "cx"])  # asking in another order draws the same values
    assert a != draws(1, ["cx", "iy", "fz"])
    assert all(v in cat.choices or 1 <= v <= 7 or 0.0 <= v <= 1.0 for v in a.values())
    assert len({v for (_, n), v in a.items() if n == "fz"}) == 5
    # Pinned draws (Python's string-seeded `random` is stable across releases): a change of the
    # sampler's keying would move every golden case, so it shows here first.
    assert [a[(n, "cx")] for n in range(5)] == ["b", "a", "c", "b", "c"]
    assert [a[(n, "iy")] for n in range(5)] == [1, 4, 7, 7, 4]
