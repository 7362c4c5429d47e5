"""Fixtures for tests that drive the real CLI on a tiny model: one profile, measured once a session."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from clitools import TINY, run_cli


@pytest.fixture(scope="session")
def tiny_profiles(tmp_path_factory) -> Path:
    """Profiles of TINY with their calibration terms, measured once (about a minute on two cores): a search
    that executes (--no-execute would skip calibration), its one candidate and the baseline run once."""
    out = tmp_path_factory.mktemp("tiny-profiles")
    p = run_cli(*TINY, "--trials", "1", "--top-k", "1", "--out", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out / "profiles"


@pytest.fixture
def seeded_out(tmp_path, tiny_profiles) -> Path:
    """An --out folder that already holds TINY's profiles."""
    out = tmp_path / "OUT"
    shutil.copytree(tiny_profiles, out / "profiles")
    return out
