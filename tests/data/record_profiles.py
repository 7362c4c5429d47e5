"""Record the small profile the unit, contract and integration tests read instead of measuring it.

    python tests/data/record_profiles.py    # rewrites tests/data/profiles/emu-cpu/*.json

gn_resnet at 32 px and gpt@tiny@16 (fp32) (GroupNorm, so data-parallel gradients match the full batch exactly) on this
machine's CPU as one emulated device, at micro-batches 2, 4 and 8, fp32 and bf16, one repetition:
the blocks' sizes, activation bytes and memory calibration are what the tests rely on; its
timings only have to be plausible, so a recording from any machine serves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hetsim.profiling.measure import profile_device, profile_model
from hetsim.profiling.store import device_profile_path, model_profile_path, save
from hetsim.workloads.builtin import load_workload, workload_from_spec

ROOT = Path(__file__).resolve().parent
"""Holds profiles/ as a results folder does."""
KIND = "emu-cpu"
MODEL, IMAGE_SIZE = "gn_resnet", 32
MICRO_BATCHES = (2, 4, 8)
PRECISIONS = ("fp32", "bf16")
GPT_SPEC = "gpt@tiny@16"
"""The contract suite's transformer: the smallest gpt, 16 tokens, fp32 only."""


def main() -> None:
    torch.set_num_threads(1)
    wl = load_workload(MODEL, IMAGE_SIZE)
    model = profile_model(wl, KIND, torch.device("cpu"), MICRO_BATCHES, PRECISIONS, reps=1)
    save(model, model_profile_path(ROOT, KIND, wl.spec))
    gpt = workload_from_spec(GPT_SPEC)
    save(profile_model(gpt, KIND, torch.device("cpu"), MICRO_BATCHES, ("fp32",), reps=1),
         model_profile_path(ROOT, KIND, gpt.spec))
    save(profile_device(KIND, torch.device("cpu")), device_profile_path(ROOT, KIND))
    print(f"recorded {model_profile_path(ROOT, KIND, wl.spec)} and {device_profile_path(ROOT, KIND)}")


if __name__ == "__main__":
    main()
