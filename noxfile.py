"""Sessions: tests, bench, lint, regen.  They run in the current environment (torch is a 5 GB
install that a fresh virtualenv per session would download again); `pip install -e .[test]` first."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """Unit, contract, integration and regression tests (no timing assertions)."""
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """The command-line fuzz test with 10x the examples of `tests`, random rather than fixed ones
    (HETSIM_FUZZ_SCALE=N for another multiple); failures are kept in .hypothesis/ and replayed first."""
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/integration/test_fuzz_cli.py",
                "--hypothesis-show-statistics", *session.posargs, env={"HETSIM_FUZZ": "long"})


@nox.session
def bench(session: nox.Session) -> None:
    """Fidelity suite and speed benchmarks (pytest-benchmark), saved under results/bench/."""
    session.run(
        "python", "-m", "pytest", "benchmarks", "-q", "-p", "no:cacheprovider",
        "--benchmark-autosave", "--benchmark-storage=file://results/bench",
        "--benchmark-compare",  # against the previous saved run (only a warning when there is none)
        "--benchmark-compare-fail=mean:50%" if "--compare" in session.posargs else "--benchmark-columns=min,mean,max",
        *[a for a in session.posargs if a != "--compare"],
    )


@nox.session
def lint(session: nox.Session) -> None:
    session.run("ruff", "check", "hetsim", "strategies", "search", "tests", "benchmarks", "examples", "noxfile.py")


@nox.session
def regen(session: nox.Session) -> None:
    """Rewrite the golden expectations under results/golden/ from the recorded profiles; print the diff."""
    session.run("python", "-m", "hetsim.search.golden", "--write", *session.posargs)
