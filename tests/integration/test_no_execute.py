"""--no-execute: profiles, simulation and search, with no calibration runs and no real runs of plans;
calibration terms recorded earlier are used and the recording is left as it was."""

from __future__ import annotations

import json

import pytest
from clitools import TINY, run_cli

pytestmark = pytest.mark.slow


def _model_profile(out):
    (path,) = (out / "profiles").glob("*/model-*.json")
    return path


def test_no_execute_measures_no_calibration_term_and_says_so(tmp_path):
    out = tmp_path / "OUT"
    p = run_cli(*TINY, "--trials", "3", "--no-execute", "--out", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "calibrating" not in p.stdout and "no calibration runs with --no-execute" in p.stdout
    assert "no plan was executed" in p.stdout and "train with the best predicted plan" in p.stdout
    prof = json.loads(_model_profile(out).read_text())
    assert prof["calib_residual_s"] is None and prof["speed_scale"] == {}
    (summary,) = (out / "reports").glob("*/summary.json")
    assert json.loads(summary.read_text())["accuracy"]["executed"] == 0
    assert not (out / "runs").exists() or not any((out / "runs").rglob("*.log"))


def test_no_execute_uses_recorded_terms_and_leaves_them_as_they_were(seeded_out):
    path = _model_profile(seeded_out)
    before = path.read_bytes()
    assert json.loads(before)["calib_residual_s"] is not None  # the fixture's search calibrated
    p = run_cli(*TINY, "--trials", "3", "--no-execute", "--out", str(seeded_out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "calibrating" not in p.stdout
    assert path.read_bytes() == before
