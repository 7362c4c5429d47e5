"""Constants every benchmark shares (a plain module: conftest.py is not meant to be imported)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
BENCH = RESULTS / "bench"

MODEL = "resnet18"
IMAGE_SIZE = 64
"""resnet18 at 64 px: a step of 32 samples is ~0.5-1 s on this CPU, so compute dominates the
fixed costs (launch, collectives' latency, Python) and the whole bench fits in ~30 minutes (27-29 measured)."""
GLOBAL_BATCH = 32
PRECISIONS = ("fp32", "bf16")
