"""The whole loop through the real CLI, on a tiny model and two emulated devices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetsim.search", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_whole_loop_ddp_on_two_emulated_devices(tmp_path):
    out = tmp_path / "OUT"
    p = run_cli("--model", "mlp", "--cluster", "emu:1.0@1G,0.5@1G", "--global-batch", "16", "--trials", "30",
                "--top-k", "2", "--steps", "3", "--warmup", "2", "--strategies", "ddp", "--out", str(out),
                "--precisions", "fp32")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.splitlines()[0].startswith("EMULATED cluster")
    folder = next((out / "reports").iterdir())
    for name in ("summary.json", "trials.csv", "report.md", "report.html", "predicted_vs_measured.png"):
        assert (folder / name).exists(), name
    s = json.loads((folder / "summary.json").read_text())
    assert s["emulated"] is True and s["model"] == "mlp" and s["global_batch"] == 16
    assert [d["memory_bytes"] for d in s["cluster"]["devices"]] == [2**30, 2**30]
    assert 1 <= len(s["candidates"]) <= 2
    for c in s["candidates"] + [s["baselines"]["uniform_ddp"]]:
        assert c["plan"]["strategy"] == "ddp"
        assert c["measured"]["status"] == "ok", c["measured"]["error"]
        assert c["measured"]["step_time_s"] > 0 and c["predicted"]["step_time_s"] > 0
        assert len(c["measured"]["peak_mem_bytes"]) == len(c["plan"]["devices"])
        # Emulated ranks time the host-speed probe before every step (hetsim.profiling.hostspeed).
        assert c["measured"]["probe_s"] > 0 and c["measured"]["steps_per_probe"] > 0
    assert s["baselines"]["uniform_ddp"]["plan"]["local_batch"] == [8, 8]
    assert "EMULATED" in (folder / "report.md").read_text()
    assert "host speed" in (folder / "report.md").read_text()
    prof = json.loads((out / "profiles" / "emu-cpu" / "model-mlp.json").read_text())
    assert prof["probe_s"] > 0  # CPU profiles are kept at the host speed of this probe
    # Every trial is in the CSV; a second run resumes the study and re-runs nothing.
    assert len((folder / "trials.csv").read_text().splitlines()) == 31
    p2 = run_cli("--model", "mlp", "--cluster", "emu:1.0@1G,0.5@1G", "--global-batch", "16", "--trials", "30",
                 "--top-k", "2", "--steps", "3", "--warmup", "2", "--strategies", "ddp", "--out", str(out),
                 "--precisions", "fp32")
    assert p2.returncode == 0, p2.stderr[-2000:]
    assert "resuming study" in p2.stdout and "already measured" in p2.stdout
    s2 = json.loads((folder / "summary.json").read_text())
    assert s2["candidates"] == s["candidates"]
