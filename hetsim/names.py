"""Names and small rules that several stages share, importable without torch (the CLI checks its
input against them before torch loads)."""

from __future__ import annotations

REPEATS = 2
"""Real runs of an executed plan unless `--repeats` says otherwise: with two or more, up to three more
while no two agree within the noise floor (`hetsim.reporting.decision.NOISE_FLOOR_REL`), and the median
of the runs kept (`hetsim.search.realruns.repeated_runs`, `consensus`)."""

CALIB_REPEATS = 4
"""Real runs of a calibration plan unless `--calib-repeats` says otherwise (more while no two agree, the
median kept, as for executed plans).  Four, because a term is read once and then moves every prediction
of its family, and a run's noise is independent of the next's: the 1,512 pass residuals of the
2026-12-04..07 bench runs (resnet18@64, each pass's log step from its plan's mean) put one run's noise
at 2.9 % (sd), and resampling them, two recordings' terms read a median 2.05 % apart with two runs and
the mean of the two that agree best (the rule until 2026-12-07, which gains nothing from more runs:
2.10 % with four), 1.90 % with the median of two, 1.45 % with the median of four (results/README.md)."""

MORE_RUNS = 3
"""Runs beyond `--repeats` that a plan gets while no two of its runs agree within the noise floor."""

PRECISIONS = ("fp32", "bf16", "fp16")
"""'fp32'; 'bf16' and 'fp16' run under torch.autocast (fp16 with loss scaling, CUDA only)."""

OPTIMIZER_STATE_PER_PARAM = {"adamw": 2, "adam": 2, "sgd": 1}
"""Optimizer state tensors per parameter (exp_avg + exp_avg_sq; momentum buffer)."""
OPTIMIZERS = tuple(OPTIMIZER_STATE_PER_PARAM)
"""The optimizer names a workload accepts."""
PROFILED_OPTIMIZERS = ("adamw", "sgd")
"""The optimizers whose step profiling times (adam steps as adamw does: the cost model falls back to it)."""

BN_MIN_SAMPLES = 2
"""BatchNorm in training mode needs more than one value per channel: every micro-batch of a
BatchNorm model holds at least this many samples (torch raises on one)."""


def min_samples_per_micro_batch(has_batchnorm: bool, min_local: int = 1) -> int:
    """Fewest samples a micro-batch may hold: the user's `--min-local-batch`, and two for BatchNorm."""
    return max(min_local, BN_MIN_SAMPLES if has_batchnorm else 1)
