"""Training with a found plan, on every rank (started by torchrun): the plan's family wraps the
model, hetsim's sampler feeds each rank its share, and checkpoints, rebalancing and monitoring
happen around each step."""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from hetsim.search.train import checkpoint, monitor, rebalance
from hetsim.search.train.data import collate
from hetsim.search.train.sampler import PlanSampler
from hetsim.strategies import get, plan_from_dict
from hetsim.strategies.base import WorkerContext
from torch import nn

from hetsim.execution.emulation import Emulator
from hetsim.execution.planfile import PlanFile
from hetsim.execution.worker import RankResult, summarize_steps
from hetsim.hardware.hostalloc import steady_malloc
from hetsim.profiling.hostspeed import RunProbe
from hetsim.workloads import Workload

TIMING_WARMUP = 3
"""Steps left out of the throughput figures (the optimizer creates its state lazily, caches warm)."""


@dataclass(frozen=True, kw_only=True)
class Slowdown:
    """Emulation: rank `rank` runs `factor` times slower from step `from_step` on."""

    rank: int
    factor: float
    from_step: int


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int
    out: Path
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    rebalance_every: int = 0
    log_every: int = 10
    tensorboard: bool = True
    slow: Slowdown | None = None
    seed: int = 0
    lr_schedule: str = "constant"


@dataclass
class Feed:
    """How a family's ranks share a global batch."""

    shares: tuple[int, ...]
    index: int
    """Which share is this rank's (its replica's, for pipelines)."""
    data_parallel: bool
    """Ranks are data-parallel peers: rebalancing applies, each rank's loss is a 1/world share."""


def feed_of(plan, rank: int, world: int) -> Feed:
    if hasattr(plan, "local_batch"):
        return Feed(tuple(plan.local_batch), rank, True)
    if hasattr(plan, "replica_batch"):
        per = world // len(plan.replica_batch)
        return Feed(tuple(plan.replica_batch), rank // per, False)
    return Feed((plan.global_batch,), 0, False)


def _blocks(ex) -> list[nn.Module]:
    if hasattr(ex, "seqs"):
        return [b for seq in ex.seqs for b in seq.children()]
    return list(ex.model.children())


def _state_module(ex) -> nn.Module:
    """The module whose state dict a checkpoint holds: pipeline stages under their stage names, so
    two ranks' different stages never share a key."""
    if hasattr(ex, "seqs"):
        return nn.ModuleDict({f"stage{s}": seq for s, seq in zip(ex.stage_ids, ex.seqs)})
    return ex.model


def _scheduler(opt, kind: str, steps: int):
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    return None


@dataclass
class Trainer:
    pf: PlanFile
    workload: Workload
    dataset: object
    cfg: TrainConfig
    records: list[monitor.StepRecord] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    rebalances: list[dict] = field(default_factory=list)

    def setup(self) -> None:
        torch.set_num_threads(1)
        steady_malloc()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        dev = self.pf.devices[self.rank]
        self.device = torch.device("cuda", dev.get("index", 0)) if dev.get("backend") == "cuda" else torch.device("cpu")
        self.emulator = None
        if dev.get("backend") == "emulated":
            slowed = self.cfg.slow is not None and self.cfg.slow.rank == self.rank
            self.emulator = Emulator(float(dev["speed"]), int(dev["memory_bytes"]), dev.get("name", f"rank {self.rank}"),
                                     adjustable=slowed)
        self.plan = plan_from_dict(self.pf.plan)
        ctx = WorkerContext(rank=self.rank, world_size=self.world, device=self.device, workload=self.workload,
                            global_batch=self.pf.global_batch, seed=self.cfg.seed, emulator=self.emulator,
                            backend=dist.get_backend())
        self.ex = get(self.plan.strategy).executor(self.plan, ctx)
        self.feed = feed_of(self.plan, self.rank, self.world)
        self.sampler = PlanSampler(len(self.dataset), self.feed.shares, self.feed.index, seed=self.cfg.seed,
                                   drop_last=not self.feed.data_parallel)
        self.clock = monitor.PhaseClock(_blocks(self.ex))
        self.opt_s = 0.0
        t = {}
        self.ex.opt.register_step_pre_hook(lambda o, a, k: t.__setitem__("t", time.perf_counter()))
        self.ex.opt.register_step_post_hook(lambda o, a, k: setattr(self, "opt_s", self.opt_s + time.perf_counter() - t["t"]))
        self.sched = _scheduler(getattr(self.ex, "stepper", self.ex.opt), self.cfg.lr_schedule, self.cfg.steps)
        self.fingerprint = checkpoint.plan_fingerprint(self.pf.plan, self.pf.workload)
        self.start = 0
        # Emulated ranks share the host: a probe before each step (rank 0's, timed alone) gives every figure one host speed.
        self.probe = RunProbe() if self.emulator is not None else None

    # ------------------------------------------------------------------ checkpoints
    def resume(self) -> None:
        root = self.cfg.checkpoint_dir
        if root is None:
            return
        meta = checkpoint.check_resumable(root, self.fingerprint)
        if meta is None:
            return
        checkpoint.load(root / meta["name"], _state_module(self.ex), self.ex.opt)
        self.sampler.load_state(meta["sampler"])
        self.feed.shares = self.sampler.shares
        self.losses = list(meta["losses"])
        self.rebalances = list(meta.get("rebalances", []))
        if self.sched is not None and meta.get("scheduler"):
            self.sched.load_state_dict(meta["scheduler"])
        self.start = int(meta["step"]) + 1
        if self.rank == 0:
            print(f"resumed from {root / meta['name']} (step {meta['step']})", flush=True)

    def save(self, step: int) -> None:
        root = self.cfg.checkpoint_dir
        meta = {"name": f"step-{step:08d}", "step": step, "fingerprint": self.fingerprint, "label": self.pf.label,
                "sampler": self.sampler.state(), "losses": self.losses, "rebalances": self.rebalances,
                "scheduler": self.sched.state_dict() if self.sched is not None else None}
        checkpoint.save(root, step, _state_module(self.ex), self.ex.opt, meta)

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> monitor.StepRecord:
        slow = self.cfg.slow
        if slow is not None and slow.rank == self.rank and step == slow.from_step and self.emulator is not None:
            self.emulator.set_speed(self.emulator.speed / slow.factor)
        idx, size = self.sampler.next_batch()
        x, y = collate(self.dataset, idx)
        self.ex.load_batch(x, y, size)
        probe = self.probe() if self.probe is not None else 0.0  # untimed; the ranks leave it together
        self.clock.take()
        self.opt_s = 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        loss = self.ex.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        if self.sched is not None:
            self.sched.step()
        share = (float(loss) / self.world if self.feed.data_parallel else float(loss)) if loss is not None else 0.0
        total = torch.tensor([share], dtype=torch.float64)
        dist.all_reduce(total)
        value = float(total)
        if not math.isfinite(value):
            raise FloatingPointError(f"non-finite loss {value} at step {step}")
        self.losses.append(value)
        return monitor.StepRecord(step=step, start_s=t0, wall_s=wall, compute_s=self.clock.take(),
                                  optimizer_s=self.opt_s, samples=len(idx), loss=value, probe_s=probe,
                                  peak_mem_bytes=monitor.peak_memory(self.device),
                                  util_pct=monitor.gpu_utilisation(self.device))

    def gather(self, recs: list[monitor.StepRecord]) -> list[list[monitor.StepRecord]]:
        out: list = [None] * self.world
        dist.all_gather_object(out, recs)
        return out

    def maybe_rebalance(self, step: int) -> None:
        n = self.cfg.rebalance_every
        if not n or not self.feed.data_parallel or (step + 1) % n or len(self.records) < n:
            return
        if step + 1 >= self.cfg.steps:  # shares re-solved after the last step would never run
            return
        window = self.gather(self.records[-n:])
        d = rebalance.decide(window, self.pf.global_batch, max(1, getattr(self.plan, "accum_steps", 1)))
        if d.shares != self.sampler.shares and d.changes:
            self.rebalances.append({"step": step + 1, "from": list(self.sampler.shares), "to": list(d.shares),
                                    "predicted_step_s": d.predicted_step_s, "current_step_s": d.current_step_s,
                                    "probe_s": d.probe_s})
            if self.rank == 0:
                print(f"rebalanced at step {step + 1}: shares {self.sampler.shares} -> {d.shares} "
                      f"(predicted step {d.predicted_step_s:.3f} s, {d.current_step_s:.3f} s with the current shares)",
                      flush=True)
            self.sampler.shares = d.shares

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        self.setup()
        self.resume()
        scalars = None
        if self.rank == 0 and self.cfg.tensorboard:
            scalars = monitor.Scalars(self.cfg.out / "tensorboard")
        for step in range(self.start, self.cfg.steps):
            self.records.append(self.step(step))
            self.maybe_rebalance(step)
            if self.cfg.log_every and ((step + 1) % self.cfg.log_every == 0 or step + 1 == self.cfg.steps):
                every = self.gather(self.records[-1:])
                if self.rank == 0:
                    from rich.console import Console

                    Console(width=120).print(monitor.console_table(every, 0, self.sampler.shares))
                    print(f"step {step + 1}/{self.cfg.steps}: loss {self.losses[-1]:.6f}", flush=True)
                    if scalars is not None:
                        scalars.write(every, 0, self.pf.global_batch / every[0][0].wall_s)
            if self.cfg.checkpoint_dir is not None and self.cfg.checkpoint_every and (step + 1) % self.cfg.checkpoint_every == 0:
                self.save(step)
        if scalars is not None:
            scalars.close()
        return self.finish()

    def finish(self) -> dict:
        every = self.gather(self.records)
        if self.rank != 0:
            return {}
        return summarize(self.pf, every, self.losses, self.rebalances, self.cfg)


def summarize(pf: PlanFile, every: list[list[monitor.StepRecord]], losses: list[float], rebalances: list[dict],
              cfg: TrainConfig) -> dict:
    """Throughput of the timed steps (raw and at the profiles' host speed), loss, rebalancing; files."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    if not every[0]:  # resumed from the last step's checkpoint: nothing left to run
        out = {"plan": pf.label, "steps": 0, "final_loss": losses[-1] if losses else None, "losses": losses,
               "samples_per_s": None, "rebalances": rebalances}
        (cfg.out / "summary.json").write_text(json.dumps(out, indent=1))
        return out
    timed = slice(TIMING_WARMUP, None) if len(every[0]) > TIMING_WARMUP else slice(0, None)
    ranks = [RankResult(rank=r, status="ok", step_s=tuple(x.wall_s for x in recs[timed]),
                        probe_s=tuple(x.probe_s for x in recs[timed]))  # 0: unprobed (shared_probes)
             for r, recs in enumerate(every)]
    raw_step, _ = summarize_steps(ranks)
    at_ref_step, _ = summarize_steps(ranks, pf.ref_probe_s) if pf.ref_probe_s else (raw_step, ())
    gb = pf.global_batch
    out = {"plan": pf.label, "steps": len(every[0]), "final_loss": losses[-1] if losses else None,
           "losses": losses, "samples_per_s": gb / raw_step,
           "samples_per_s_at_ref": gb / at_ref_step if pf.ref_probe_s else None,
           "search_measured_samples_per_s_at_ref": pf.measured_at_ref_samples_per_s,
           "search_measured_samples_per_s": pf.measured_samples_per_s, "rebalances": rebalances}
    last = [recs[-20:] for recs in every]
    if len(every[0]) >= 20:
        out["last20_samples_per_s"] = gb / statistics.median(max(r[i].wall_s for r in last) for i in range(len(last[0])))
        check = rebalance.compare_last(every, rebalances)
        if check is not None:
            out["rebalance_check"] = {**check, "predicted_samples_per_s": gb / check["predicted_step_s"],
                                      "measured_samples_per_s": gb / check["measured_step_s"],
                                      "measured_raw_samples_per_s": gb / check["measured_raw_step_s"]}
    monitor.write_trace(every, cfg.out / "trace.json")
    (cfg.out / "steps.json").write_text(json.dumps(monitor.records_json(every)))
    (cfg.out / "summary.json").write_text(json.dumps(out, indent=1))
    return out
