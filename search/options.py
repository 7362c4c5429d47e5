"""The main job's options, resolved and checked by the CLI (`__main__.resolve`) before anything runs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hetsim.names import CALIB_REPEATS, REPEATS

if TYPE_CHECKING:  # annotations only: the CLI imports this module for --help, before torch
    from hetsim.execution.runner import Launch
    from hetsim.execution.worker import Fault
    from hetsim.hardware.cluster import Cluster
    from hetsim.profiling.obtain import ProfileRequest

RESULTS = Path(__file__).resolve().parents[1] / "results"
"""The checkout's committed recordings (profiles, golden files, bench runs): read, never written by a run."""
DEFAULT_OUT = Path("results") / "local"
"""Where a run writes by default: its profiles cache, the study database, real-run logs and
reports.  Ignored by git, apart from the committed recordings in results/ that runs never write."""


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str
    cluster: Cluster
    workload: object
    global_batch: int
    strategies: tuple[str, ...]
    trials: int
    top_k: int
    steps: int
    warmup: int
    repeats: int = REPEATS
    """Real runs of each shortlisted plan (more while no two agree): `realruns.run_plan`."""
    calib_repeats: int = CALIB_REPEATS
    """Real runs of each calibration plan (more while no two agree): `ProfileRequest.repeats`."""
    timeout_s: float
    storage: str | None
    jobs: int = 1
    """Search workers on one study (journal storage)."""
    study: str
    out: Path
    execute: bool
    seed: int
    reprofile: bool
    precisions: tuple[str, ...]
    min_local_batch: int
    checkpointing: bool
    launch: Launch
    notes: tuple[str, ...] = ()
    fault: Fault | None = None
    """For tests: a fault injected into the first real run (hidden --inject-fault)."""
    trial_delay_s: float = 0.0
    """For tests: a wait after each trial, so a kill can land half-way through a search (hidden --trial-delay)."""

    @property
    def profiling(self) -> ProfileRequest:
        """The profiles this run needs, cached under OUT/profiles/."""
        from hetsim.profiling.obtain import ProfileRequest  # imports torch: not at --help time

        return ProfileRequest(root=self.out, global_batch=self.global_batch, precisions=self.precisions,
                              reprofile=self.reprofile, launch=self.launch, strategies=self.strategies,
                              repeats=self.calib_repeats)


DEFAULT_PRECISIONS = ("fp32", "bf16")


def default_study_name(model: str, cluster_spec: str, gb: int, names: tuple[str, ...],
                       precisions: tuple[str, ...] = DEFAULT_PRECISIONS, checkpointing: bool = True,
                       min_local_batch: int = 1) -> str:
    """The study a run resumes unless --study names one: one per model, cluster, global batch and
    search space.  Options that change the space and differ from their defaults are part of the name
    (`-fp16`, `-nockpt`, `-minlb8`), so a run with another --precisions searches anew instead of
    resuming a study whose trials never tried that precision."""
    space = "".join((f"-{'+'.join(sorted(set(precisions)))}" if set(precisions) != set(DEFAULT_PRECISIONS) else "",
                     "" if checkpointing else "-nockpt", f"-minlb{min_local_batch}" if min_local_batch != 1 else ""))
    raw = re.sub(r"[^A-Za-z0-9_.@+-]+", "_", f"{model}-{cluster_spec}-b{gb}-{'+'.join(names)}")
    return raw[:120 - len(space)] + space
