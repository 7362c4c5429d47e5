"""Constants every benchmark shares (a plain module: conftest.py is not meant to be imported)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
BENCH = RESULTS / "bench"
"""Committed bench history (pytest-benchmark's saved runs, adding files) and the recorded fidelity pairs
the regression tests replay: a bench run reads them and never rewrites them."""
LOCAL = RESULTS / "local" / "bench"
"""What a bench run measures (ignored by git): its profiles, recorded anew at the start of every run,
`fidelity.json`, `fidelity_gpt.json`, `whatif.json`.  Copy a run's files to results/ by hand to
make them the recording the regression tests replay."""

MODEL = "resnet18"
IMAGE_SIZE = 64
"""resnet18 at 64 px: a step of 32 samples is ~0.5-1 s on this CPU, so compute dominates the
fixed costs (launch, collectives' latency, Python) and the whole bench fits in ~30 minutes (27-29 measured)."""
GLOBAL_BATCH = 32
PRECISIONS = ("fp32", "bf16")
