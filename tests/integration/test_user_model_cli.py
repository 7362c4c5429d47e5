"""A user's plain nn.Module (tests/assets/user_models.py, kinds hetsim has no built-in for) planned
and executed end to end through the CLI, with hetsim finding its cut points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # profiling, calibration runs and a real run, one each: ~10 minutes on a busy 2-core host
@pytest.mark.parametrize("fn, strategies", [("list_mlp", "pipeline"), ("skip_all", "ddp,pipeline")])
def test_user_module_is_planned_and_run(fn, strategies, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "assets"), str(ROOT)]))
    argv = [sys.executable, "-m", "hetsim.search", "--model", f"user_models:{fn}", "--cluster", "emu:1.0@1G,0.5@1G",
            "--global-batch", "8", "--precisions", "fp32", "--strategies", strategies, "--trials", "12",
            "--top-k", "1", "--steps", "2", "--warmup", "2", "--repeats", "1", "--calib-repeats", "1", "--out", str(tmp_path)]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads(next((tmp_path / "reports").glob("*/summary.json")).read_text())
    ran = summary["candidates"][0]
    assert ran["measured"]["status"] == "ok", ran["measured"]
    if fn == "list_mlp":
        assert ran["plan"]["strategy"] == "pipeline"  # cut between its ModuleList layers
    else:
        assert ran["plan"]["strategy"] == "ddp"  # one block: no pipeline, and the report says why
        assert any("one block" in n for n in summary["notes"])
