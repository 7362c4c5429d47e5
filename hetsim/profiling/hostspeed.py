"""Host speed: a fixed probe timed beside every CPU measurement, so that times measured while the
host runs slow can be compared with times measured while it runs fast.

Why: the emulated cluster shares a virtual machine's cores with a busy host.  Measured here (2
vCPUs, resnet18@64 steps, two processes): the median step of 5-second windows ranged 220-352 ms
and 20-second windows still varied with a CV of 10%, in phases of 10-60 s, with no steal time
reported by the kernel.  A profile recorded in a fast phase and a run in a slow one then differ by
up to 30-60% for no reason of the plan.  The probe (a resnet18 forward of 2 images at 64 px, ~16 ms,
one thread) slows down with the phases: the step-to-probe ratio of those windows varied with a
CV of 3.6-5% where the step alone varied 14.5-15%.  A small convolution that fits in cache tracked
the phases but not their size (CV 6.5%), hence a whole small network.

Use: every timed CPU quantity is taken beside a probe time p, and kept as t x (ref / p)^ELASTICITY,
where ref is the profile's median probe (`ModelProfile.probe_s`): "this time, at the speed the host
had when the profile was recorded".  In a run of several ranks p is rank 0's probe of that step, timed
alone while the others wait (`RunProbe`), which every rank records (`shared_probes` combines them).  Measurements keep their raw times too.  GPU times are not
probed (a GPU is not shared with the host's other guests); their profiles have probe_s = 0.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence

PROBE_BATCH = 2
PROBE_IMAGE = 64
PROBE_REPS = 2

ELASTICITY = 0.7
"""How much of the probe's change a step follows: log step moves by this much per unit of log probe.

Measured here (2 vCPUs, AMD EPYC and an earlier VM), every way giving less than 1:
- within each bench run, over the three passes of every plan (pooled, each plan's mean removed):
  0.68 over 1,680 resnet18@64 passes and 0.68 over 570 gpt@tiny@64 passes (results/bench/runs;
  0.88 over the 303 passes of four ranks on two cores);
- the two recordings of one bench, made at probes of 16.6 and 14.5 ms, predicted the suite alike
  at 0.73 (with 1 their normalised predictions were 4.1 % apart, every plan on one side);
- one process timing probe and step in turn: 0.51-0.64.
With 1 (t x ref / p, until 2026-12-06) a run in a fast phase read slow and one in a slow phase fast:
three searches (two user models, gpt) had normalised errors of -11.9, +18.2 and -16 % where the raw steps were
within 4-8 % of their predictions.  The slope of the pooled fit is the factor that leaves the least
spread in the normalised steps with probes as noisy as these (results/README.md)."""


class HostProbe:
    """A fixed small network, built once per process; calling it times one probe (seconds)."""

    def __init__(self) -> None:
        import torch
        import torchvision

        gen_state = torch.random.get_rng_state()
        torch.manual_seed(0)
        self._model = torchvision.models.resnet18(num_classes=10).eval()
        self._x = torch.randn(PROBE_BATCH, 3, PROBE_IMAGE, PROBE_IMAGE)
        torch.random.set_rng_state(gen_state)  # the caller's random stream is left as it was
        self()  # first call allocates

    def __call__(self) -> float:
        import torch

        best = float("inf")
        with torch.inference_mode():
            for _ in range(PROBE_REPS):
                t = time.perf_counter()
                self._model(self._x)
                best = min(best, time.perf_counter() - t)
        return best


class RunProbe:
    """The host-speed probe of a run of several ranks, called by every rank before each step: the
    ranks wait at a barrier while rank 0 alone times the probe, and every rank gets its time.

    Why alone: with more ranks than cores, a probe timed by every rank at once ran while other
    ranks were still computing or probing, a different number of them each time.  Measured here (2
    vCPUs, four ranks of gpt@tiny@64, five runs of each plan interleaved): probes of 17-26 ms,
    and the step normalised by them scattered more than the raw step (CV 10-27 % against 4-13 %
    for tensor-parallel plans); rank 0 probing alone read 12-13 ms as one process does, and the
    normalised step's CV fell to 1.6-3.4 %.  On two ranks, each on its own core, both ways read
    the same probe.

    With more ranks than cores every rank gets cores / ranks of the host (the emulated devices
    compute or spin all step long), and each emulated device is compared at the speed of a whole
    core, as its profile was recorded: the step is divided by ranks / cores.  That share is not a
    phase of the host, so the time returned is the lone probe x share^(1 / ELASTICITY) (`with_share`):
    `at_ref` then divides the step by the whole share and normalises only the probe's phase."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._together = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._rank = dist.get_rank() if self._together else 0
        self._probe = HostProbe() if self._rank == 0 else None
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) if self._together else 1
        self.share = max(1.0, local / host_cores())
        """Ranks per core of this host (1 with a core each)."""

    def __call__(self) -> float:
        if not self._together:
            return self._probe()
        import torch
        import torch.distributed as dist

        dist.barrier()
        t = torch.tensor([self._probe() if self._probe is not None else 0.0], dtype=torch.float64)
        dist.broadcast(t, 0)
        return with_share(float(t.item()), self.share)


def host_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def with_share(lone: float, share: float) -> float:
    """The probe time to record for a step run on 1/`share` of a core while the lone probe read `lone`:
    `at_ref` then divides the step by `share` whole and normalises the probe's own phase by ELASTICITY."""
    return lone * share ** (1.0 / ELASTICITY)


def at_ref(times: Sequence[float], probes: Sequence[float], ref: float,
           elasticity: float = ELASTICITY) -> list[float]:
    """Times taken beside probe times, expressed at the host speed whose probe time is `ref`:
    t x (ref / p)^elasticity (`ELASTICITY`)."""
    if not ref or len(probes) != len(times) or not all(p > 0 for p in probes):
        return list(times)
    return [t * (ref / p) ** elasticity for t, p in zip(times, probes)]


def shared_probes(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """One host-speed probe per step for all the ranks of a run: the mean of the probes the ranks
    timed before that step (empty when a rank has none, not one per step, or an unprobed step: 0).

    The ranks of a run share one step period, so one estimate of the host's speed applies to all of
    them.  A rank's own probe also carries its recent past: a vCPU that idled (a pipeline rank
    waiting for its peer) runs the probe 20-30 % slower for 100 ms and more (measured here: after
    300 ms of sleep 17-21 ms, after 300 ms of work 14-17 ms).  Normalising each rank by its own
    probe and taking the slowest rank then picked the rank whose probe happened to be warm: in one
    model-parallel run the two ranks' probes were 18.5 and 14 ms for the same steps."""
    if not per_rank or not all(p and all(x > 0 for x in p) for p in per_rank) or len({len(p) for p in per_rank}) != 1:
        return []
    return [sum(ps) / len(ps) for ps in zip(*per_rank)]


def ref_of(probes: Sequence[float]) -> float:
    """The reference probe time of a set of measurements: their median probe (0 when unprobed)."""
    good = [p for p in probes if p > 0]
    return statistics.median(good) if good else 0.0


def profile_ref(models) -> float:
    """The host reference of a set of model profiles: the probe time of the (one) probed CPU profile,
    0 when none is probed or they disagree (no common reference to express times at)."""
    refs = {m.probe_s for m in models if getattr(m, "probe_s", 0.0)}
    return refs.pop() if len(refs) == 1 else 0.0
