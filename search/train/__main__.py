"""`python -m hetsim.search.train`: train a model with a plan a search found (the only place that reads
this tool's argv).

Under torchrun (launch.sh) every rank trains; run directly, it checks everything first (one
`hetsim: error:` line and exit 2 on bad input, nothing written) and then starts torchrun itself
with the plan's number of ranks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from hetsim.errors import ConfigError, HetsimError

LR_SCHEDULES = ("constant", "cosine")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hetsim.search.train", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="best_plan.json (or plans/*.json) written by hetsim.search")
    p.add_argument("--model", help="the plan's workload (default: the one in the plan file); must match it")
    p.add_argument("--data", help="module:function returning a torch Dataset of (input, target) pairs "
                                  "(default: the workload's synthetic samples)")
    p.add_argument("--steps", type=int, help="optimizer steps in all (default: one epoch)")
    p.add_argument("--epochs", type=int, help="passes over the dataset (instead of --steps)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), help="default: the plan file's")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the workload's)")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant")
    p.add_argument("--out", default="results/local/train",
                   help="summary, trace and TensorBoard files (default results/local/train, ignored by git)")
    p.add_argument("--checkpoint-dir", help="torch.distributed.checkpoint folder; a run resumes from its latest")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (default 10)")
    p.add_argument("--rebalance-every", type=int, default=0,
                   help="re-solve the data-parallel batch split from measured compute every N steps (0: never)")
    p.add_argument("--log-every", type=int, default=10, help="steps between console tables (default 10)")
    p.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard scalars")
    p.add_argument("--slow", help="emulation: RANK:FACTOR@STEP slows one emulated rank FACTOR times from STEP")
    p.add_argument("--seed", type=int, default=0, help="data order and synthetic data (default 0)")
    p.add_argument("--check", action="store_true", help="check the inputs and exit")
    return p


def _positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"--{name} {value}: must be a positive whole number")


def parse_slow(text: str | None, world: int):
    from hetsim.search.train.loop import Slowdown

    if text is None:
        return None
    try:
        rank_s, rest = text.split(":", 1)
        factor_s, step_s = rest.split("@", 1)
        slow = Slowdown(rank=int(rank_s), factor=float(factor_s), from_step=int(step_s))
    except ValueError:
        raise ConfigError(f"--slow {text!r}: write RANK:FACTOR@STEP, e.g. 1:2@20 (rank 1 twice as slow from step 20)") from None
    if not 0 <= slow.rank < world or not 1.0 <= slow.factor <= 100.0 or slow.from_step < 0:
        raise ConfigError(f"--slow {text!r}: rank must be 0..{world - 1}, factor 1..100, step >= 0")
    return slow


def check_slow(slow, pf) -> None:
    if slow is not None and pf.devices[slow.rank].get("backend") != "emulated":
        raise ConfigError(f"--slow: rank {slow.rank} runs on a real device ({pf.devices[slow.rank].get('name')}); "
                          "only an emulated device can be slowed")


def prepare(args):
    """Everything checked and loaded, nothing written: (plan file, workload, dataset, config)."""
    from hetsim.search.train import checkpoint
    from hetsim.search.train.data import check_size, load_dataset, synthetic_dataset
    from hetsim.search.train.loop import TrainConfig
    from hetsim.search.train.sampler import PlanSampler

    from hetsim.execution.planfile import load_plan_file
    from hetsim.workloads import workload_from_spec

    for name in ("steps", "epochs", "checkpoint_every", "log_every"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.rebalance_every < 0:
        raise ConfigError(f"--rebalance-every {args.rebalance_every}: must be 0 (never) or a positive number of steps")
    pf = load_plan_file(args.plan)
    if args.model is not None and args.model != pf.workload:
        raise ConfigError(f"--model {args.model!r} is not the model the plan was found for ({pf.workload!r}); "
                          "run hetsim.search for this model, or drop --model")
    world = int(os.environ.get("WORLD_SIZE", pf.world_size))
    if world != pf.world_size:
        raise ConfigError(f"the plan runs on {pf.world_size} ranks (its devices), torchrun started {world}; "
                          f"use --nproc-per-node {pf.world_size} (launch.sh does)")
    wl = workload_from_spec(pf.workload, args.optimizer or pf.optimizer)
    if args.lr is not None:
        if not 0 < args.lr < 10:
            raise ConfigError(f"--lr {args.lr}: must be in (0, 10)")
        wl.lr = args.lr
    if args.data:
        ds = load_dataset(args.data)
        check_size(ds, pf.global_batch, args.data)
    else:
        ds = synthetic_dataset(wl, pf.global_batch, args.seed)
    per_epoch = PlanSampler(len(ds), (pf.global_batch,), 0).steps_per_epoch()
    steps = args.steps or (args.epochs or 1) * per_epoch
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt is not None:
        if ckpt.exists() and not ckpt.is_dir():
            raise ConfigError(f"--checkpoint-dir {str(ckpt)!r} is a file; pass a folder")
        checkpoint.check_resumable(ckpt, checkpoint.plan_fingerprint(pf.plan, pf.workload))
    cfg = TrainConfig(steps=steps, out=Path(args.out), checkpoint_dir=ckpt, checkpoint_every=args.checkpoint_every,
                      rebalance_every=args.rebalance_every, log_every=args.log_every,
                      tensorboard=not args.no_tensorboard, slow=parse_slow(args.slow, pf.world_size),
                      seed=args.seed, lr_schedule=args.lr_schedule)
    check_slow(cfg.slow, pf)
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("TensorBoard scalars need the tensorboard package: pip install tensorboard "
                              "(or pass --no-tensorboard)") from None
    return pf, wl, ds, cfg


def _relaunch(argv: list[str], n: int, out: str) -> int:
    """Not under torchrun: start the plan's ranks through torchrun (loopback only), its own log folders
    under `out`/torchelastic rather than a new /tmp/torchelastic_* each run."""
    from hetsim.execution.runner import Launch

    cmd = [sys.executable, "-m", "hetsim.execution.launcher", *Launch().args(n, run_dir=Path(out)), "-m",
           "hetsim.search.train", *argv]
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    under_torchrun = "LOCAL_RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    try:
        pf, wl, ds, cfg = prepare(args)
    except HetsimError as e:
        if rank == 0:
            print(f"hetsim: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"ok: {pf.label} on {pf.world_size} ranks, {len(ds)} samples, {cfg.steps} steps")
        return 0
    if not under_torchrun:
        return _relaunch(argv, pf.world_size, args.out)
    return _train(pf, wl, ds, cfg)


def _train(pf, wl, ds, cfg) -> int:
    import torch.distributed as dist
    from hetsim.search.train.loop import Trainer

    backend = "nccl" if all(d.get("backend") == "cuda" for d in pf.devices) else "gloo"
    dist.init_process_group(backend=backend)
    try:
        out = Trainer(pf, wl, ds, cfg).run()
    except HetsimError as e:
        print(f"hetsim: error: rank {dist.get_rank()}: {e}", file=sys.stderr)
        return 2
    if dist.get_rank() == 0:
        _print_summary(out, cfg)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _print_summary(out: dict, cfg) -> None:
    if out["samples_per_s"] is None:
        print(f"nothing left to train: the checkpoint is at the last step; final loss {out['final_loss']:.6f}", flush=True)
        return
    line = f"trained {out['steps']} steps: final loss {out['final_loss']:.6f}; {out['samples_per_s']:.2f} samples/s raw"
    if out.get("samples_per_s_at_ref"):
        line += f", {out['samples_per_s_at_ref']:.2f} samples/s at the profiles' host speed"
        if out.get("search_measured_samples_per_s_at_ref"):
            ratio = out["samples_per_s_at_ref"] / out["search_measured_samples_per_s_at_ref"]
            line += f" ({ratio:.3f} x the search's measurement of this plan)"
    print(line, flush=True)
    if "last20_samples_per_s" in out:
        msg = f"last 20 steps: {out['last20_samples_per_s']:.2f} samples/s"
        check = out.get("rebalance_check")
        if check:
            msg += (f"; their re-solved splits predict {check['predicted_samples_per_s']:.2f}, measured "
                    f"{check['measured_samples_per_s']:.2f} at the prediction's host speed ({check['ratio']:.3f} "
                    f"of it; raw {check['measured_raw_samples_per_s']:.2f}, {check['ratio_raw']:.3f})")
        print(msg, flush=True)
    print(f"wrote {cfg.out}/summary.json, trace.json (Perfetto), steps.json"
          + (", tensorboard/" if cfg.tensorboard else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
