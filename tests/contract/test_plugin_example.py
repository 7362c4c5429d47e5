"""The example third-party family (examples/plugin_family) passes the contract suite, found through its entry point.

No `pip install` is needed: the example's package folder and a minimal `.dist-info` that declares its
entry point (what pip would write) go on PYTHONPATH of a child `pytest --pyargs hetsim.testing`, so
importlib.metadata finds the `hetsim.strategies` entry point exactly as for an installed plugin, and
the suite's real runs (torchrun children) inherit the same path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plugin_family"
DIST, VERSION = "hetsim-single", "0.1.0"
ENTRY_POINT = 'single = "hetsim_single:Single"'
"""As examples/plugin_family/pyproject.toml declares them (checked below)."""


def _fake_install(target: Path) -> dict[str, str]:
    """A .dist-info with the example's entry points under `target`; the environment that finds it."""
    project = (EXAMPLE / "pyproject.toml").read_text()
    assert f'name = "{DIST}"' in project and f'version = "{VERSION}"' in project and ENTRY_POINT in project
    dist = target / f"{DIST.replace('-', '_')}-{VERSION}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {VERSION}\n")
    (dist / "entry_points.txt").write_text("[hetsim.strategies]\n" + ENTRY_POINT.replace('"', "") + "\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(EXAMPLE), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _suite(tmp_path: Path, marks: str) -> subprocess.CompletedProcess:
    env = _fake_install(tmp_path / "site")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "hetsim.testing",
           "-k", "single", "-m", marks, "-rA"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)


def test_example_family_is_found_through_its_entry_point(tmp_path):
    env = _fake_install(tmp_path / "site")
    code = "from hetsim import strategies; print(strategies.names())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "'single'" in out.stdout, out.stdout + out.stderr


def test_example_family_passes_the_fast_contract(tmp_path):
    res = _suite(tmp_path, "not slow")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "single-gn_resnet@32" in res.stdout and "single-mlp" in res.stdout, res.stdout[-4000:]


@pytest.mark.slow
def test_example_family_real_runs_match_the_full_batch_gradient(tmp_path):
    res = _suite(tmp_path, "slow")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "PASSED" in res.stdout and "test_real_run_matches_full_batch_gradient[single-mlp]" in res.stdout, (
        res.stdout[-4000:])
