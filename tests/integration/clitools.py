"""Helpers for tests that drive the real CLI (`python -m hetsim.search`) on a tiny model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Every CLI test in this folder that uses `seeded_out` shares these, so that the recorded
# profile's fingerprint (model, micro-batch sizes, precisions) matches and nothing is re-measured.
TINY = ["--model", "mlp", "--cluster", "emu:1.0@1G,0.5@1G", "--global-batch", "16", "--precisions", "fp32",
        "--strategies", "ddp", "--steps", "2", "--warmup", "2", "--repeats", "1", "--calib-repeats", "1"]
# One real run per plan and per calibration plan (--repeats 1 --calib-repeats 1): these tests check what the CLI does,
# not accuracy; repeated runs are covered by tests/unit/test_repeated_runs.py and test_loop.py.


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetsim.search", *args]


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def processes_naming(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line mentions `text` (e.g. a test's tmp folder)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info.get("cmdline") or ())
            if text in cmd and p.info.get("status") != psutil.STATUS_ZOMBIE:
                found.append((p.pid, cmd))
        except psutil.Error:
            continue
    return found
