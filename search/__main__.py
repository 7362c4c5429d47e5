"""`python -m hetsim.search`: the only place that reads argv."""

from __future__ import annotations

import argparse
import os
import sys

from hetsim.errors import HetsimError, UnknownNameError

from .options import DEFAULT_OUT


def positive_int(name: str):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not a whole number") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} {text!r} must be > 0")
        return v

    return conv


def positive_float(name: str):
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not a number") from None
        if not v > 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{name} {text!r} must be a finite number > 0")
        return v

    return conv


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        sys.stderr.write(f"hetsim: error: {one_line(message)} (see --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m hetsim.search",
               description="Search training plans for a (heterogeneous) cluster, run the best for real, report.")
    p.add_argument("--model", default="resnet50", help="resnet50, resnet18, resnet18_gn, mlp, gn_resnet or module:function")
    p.add_argument("--cluster", default=None, help="emu:SPEED@MEM,... | catalog:KEY[*N],... | cuda | FILE.toml "
                                                   "(default: cuda if GPUs are present, else emu:1.0@4G,0.5@2G)")
    p.add_argument("--global-batch", type=positive_int("--global-batch"), default=32)
    p.add_argument("--image-size", type=positive_int("--image-size"), default=None,
                   help="default: 224 on GPUs, 64 on emulated clusters")
    p.add_argument("--strategies", default=None, help="comma-separated families (default: all registered)")
    p.add_argument("--trials", type=positive_int("--trials"), default=100,
                   help="trials the study should hold in total: a resumed study runs only the missing ones, "
                        "its trial numbers continuing from the stored trials (rerun the same command to finish "
                        "an interrupted search)")
    p.add_argument("--top-k", type=positive_int("--top-k"), default=3)
    p.add_argument("--steps", type=positive_int("--steps"), default=8,
                   help="timed steps per real run (the median is reported; shared CPUs drift by ~10%%)")
    p.add_argument("--warmup", type=positive_int("--warmup"), default=3, help="untimed steps (at least 2: step 1 measures memory)")
    p.add_argument("--timeout", type=positive_float("--timeout"), default=300.0, help="seconds per real run")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite:///OUT/hetsim.db)")
    p.add_argument("--study", default=None, help="study name (also the report folder's name); an existing "
                                                 "study resumes, keeping its trials and real-run measurements")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="output folder: the profiles cache, the study database, real-run logs and reports "
                        "(default: %(default)s, ignored by git; never results/, whose recordings runs only read)")
    p.add_argument("--no-execute", action="store_true", help="simulate and search only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reprofile", action="store_true", help="measure profiles again even if recorded ones match")
    p.add_argument("--precisions", default=None, help="comma-separated from fp32,bf16,fp16 (default: fp32,bf16)")
    p.add_argument("--optimizer", default=None, help="adamw (default), adam or sgd")
    p.add_argument("--min-local-batch", type=positive_int("--min-local-batch"), default=1)
    p.add_argument("--no-checkpointing", action="store_true", help="do not search activation checkpointing")
    g = p.add_argument_group("torchrun (multi-node)")
    g.add_argument("--nnodes", default="1")
    g.add_argument("--node-rank", type=int, default=None)
    g.add_argument("--rdzv-endpoint", default=None,
                   help="HOST:PORT; default: a one-node rendezvous that listens on 127.0.0.1 only")
    # For tests: inject a fault into the first real run, e.g. nan:1:2 (kind:rank:step).
    p.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    return p


def one_line(message: str) -> str:
    """An error message as one line: a multi-line cause (TOML, import errors) is joined with ' | '."""
    return " | ".join(ln.strip() for ln in str(message).splitlines() if ln.strip())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rich.console import Console

    # A wide console when writing to a file or CI log, so the results table does not wrap.
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
    try:
        opts = resolve(args, console)
        from .app import run

        return run(opts, console)
    except HetsimError as e:
        # Plain write, not rich: rich wraps long lines, and an error is exactly one line.
        sys.stderr.write(f"hetsim: error: {one_line(str(e))}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("hetsim: interrupted; every finished trial and real run is kept in the study: "
                         "rerun the same command to resume\n")
        return 130


def resolve(args, console):
    from rich.markup import escape

    from hetsim import strategies
    from hetsim.errors import ConfigError
    from hetsim.execution.runner import Launch
    from hetsim.hardware.cluster import parse_cluster

    from . import checks
    from .options import Options, default_study_name

    # Cheap checks first: nothing below measures anything.
    if args.warmup < 2:
        raise ConfigError(f"--warmup {args.warmup} is below 2: step 0 creates optimizer state and step 1 measures "
                          "memory; use --warmup 2 or more")
    checks.seed(args.seed)
    max_nodes = checks.nnodes(args.nnodes)
    if args.rdzv_endpoint is not None:
        checks.rdzv_endpoint(args.rdzv_endpoint)
    elif max_nodes != 1:
        raise ConfigError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT so the nodes can meet")
    checks.node_rank(args.node_rank, max_nodes)
    if args.study is not None:
        checks.study_name(args.study)
    fault = _parse_fault(args.inject_fault) if args.inject_fault else None
    known = strategies.names()
    names = checks.name_list(args.strategies, "--strategies", known, "strategy") if args.strategies else tuple(known)
    all_precisions = ("fp32", "bf16", "fp16")
    precisions = (checks.name_list(args.precisions, "--precisions", all_precisions, "precision")
                  if args.precisions else ("fp32", "bf16"))
    if args.optimizer is not None and args.optimizer not in ("adamw", "adam", "sgd"):
        raise UnknownNameError("optimizer", args.optimizer, ["adamw", "adam", "sgd"],
                               checks.closest_hint(args.optimizer, ["adamw", "adam", "sgd"]))
    out = checks.output_folder(args.out, "--out")
    cluster = parse_cluster(args.cluster)
    console.print(escape(cluster.describe()))
    for n in cluster.notes:
        console.print(f"[yellow]note:[/] {escape(n)}")
    wl = _workload(args, cluster, console)
    checks.batch_covers_devices(args.global_batch, len(cluster.devices), args.min_local_batch, wl.has_batchnorm,
                                wl.name)
    notes: list[str] = []
    if cluster.emulated:
        precisions = tuple(p for p in precisions if p != "fp16") or ("fp32",)  # fp16 autocast is CUDA-only
    storage = args.storage or f"sqlite:///{(out / 'hetsim.db').resolve()}"
    study = args.study or default_study_name(wl.spec, cluster.spec, args.global_batch, names)
    launch = Launch(nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    return Options(model=args.model, cluster=cluster, workload=wl, global_batch=args.global_batch, strategies=names,
                   trials=args.trials, top_k=args.top_k, steps=args.steps, warmup=args.warmup,
                   timeout_s=args.timeout, storage=storage, study=study, out=out, execute=not args.no_execute,
                   seed=args.seed, reprofile=args.reprofile, precisions=precisions,
                   min_local_batch=args.min_local_batch, checkpointing=not args.no_checkpointing, launch=launch,
                   notes=tuple(notes), fault=fault)


def _workload(args, cluster, console):
    """The workload of --model (a built-in name or module:function) at its image size, checked
    against the cluster's largest device."""
    from hetsim.errors import ConfigError
    from hetsim.workloads.builtin import BUILTIN, IMAGE_MODELS, default_image_size, load_workload

    from . import checks

    model = args.model
    if ":" not in model and model not in BUILTIN:
        raise UnknownNameError("model", model, list(BUILTIN),
                               " ".join(filter(None, [checks.closest_hint(model, list(BUILTIN)),
                                                      "Or pass module:function returning a hetsim Workload."])))
    size = args.image_size
    if size is not None and ":" not in model and model not in IMAGE_MODELS:
        raise ConfigError(f"--image-size {size} does not apply to --model {model} (not an image model; image "
                          f"models: {', '.join(sorted(IMAGE_MODELS))}); drop --image-size")
    if size is None and ":" not in model:
        size = default_image_size(model, cluster.source != "cuda")
        if size:
            console.print(f"image size {size} px (default for this cluster; set --image-size to change)")
    if size:
        checks.image_fits(size, model, max(d.memory_bytes for d in cluster.devices))
    return load_workload(model, size, args.optimizer)


FAULT_KINDS = ("oom", "kill", "hang", "nan", "raise")


def _parse_fault(text: str):
    from hetsim.errors import ConfigError
    from hetsim.execution.worker import Fault

    kind, _, rest = text.partition(":")
    rank_s, _, step_s = rest.partition(":")
    try:
        rank, step = int(rank_s or 0), int(step_s or 0)
    except ValueError:
        rank = step = -1
    if kind not in FAULT_KINDS or rank < 0 or step < 0:
        raise ConfigError(f"--inject-fault {text!r} is not KIND[:RANK[:STEP]] with KIND one of "
                          f"{', '.join(FAULT_KINDS)}; e.g. nan:1:2")
    return Fault(kind=kind, rank=rank, at_step=step)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
