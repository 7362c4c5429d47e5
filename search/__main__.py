"""`python -m hetsim.search`: the only place that reads argv."""

from __future__ import annotations

import argparse
import os
import re
import sys

from hetsim.errors import HetsimError, UnknownNameError, shown
from hetsim.names import CALIB_REPEATS, OPTIMIZERS, PRECISIONS, REPEATS

from .options import DEFAULT_OUT, DEFAULT_PRECISIONS

# Upper bounds of the numeric options, each with its reason (README, "Bad input").  They are
# checked while parsing, before torch is imported or anything is built, measured or allocated.
MAX_GLOBAL_BATCH = 2**20
"""1,048,576 samples: 16x the largest published data-parallel batches (LAMB trained BERT at 65,536)."""
LIMITS: dict[str, tuple[int | float, str]] = {
    "--global-batch": (MAX_GLOBAL_BATCH, "16x the largest published training batch, 65,536"),
    "--min-local-batch": (MAX_GLOBAL_BATCH, "it cannot exceed the largest --global-batch"),
    "--image-size": (2048, "image models train at 224-600 px; a larger input is a typo"),
    "--trials": (100_000, "a trial is a simulated plan stored in the study; 100,000 take hours"),
    "--top-k": (100, "each is a real run of up to --timeout seconds"),
    "--steps": (10_000, "timed steps of each real run; a median settles within tens"),
    "--warmup": (1_000, "untimed steps of each real run"),
    "--repeats": (10, "real runs of each shortlisted plan"),
    "--calib-repeats": (10, "real runs of each calibration plan"),
    "--timeout": (86_400.0, "one day per real run"),
    "--jobs": (64, "search worker processes on this machine"),
}
MAX_VALUE_CHARS = 4096
"""The longest text an option takes (a path, a URL): longer is a pasted file, not a value."""


def _too_large(name: str, text: str) -> argparse.ArgumentTypeError:
    limit, why = LIMITS[name]
    return argparse.ArgumentTypeError(f"{name} {shown(text)} is above the limit of {limit:,.0f} ({why}); "
                                      f"use a value up to {limit:,.0f}")



def positive_int(name: str):
    def conv(text: str) -> int:
        digits = text.strip()
        if not digits:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is empty (an unset shell variable?); give a whole "
                                             "number or leave the option out for its default")
        if not re.fullmatch(r"[+-]?[0-9]+", digits):
            raise argparse.ArgumentTypeError(f"{name} {shown(text)} is not a whole number")
        # A number of more than 30 digits is over every limit; int() of 5,000 digits would itself fail.
        v = int(digits) if len(digits) <= 30 else (-1 if digits.startswith("-") else 10**30)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} {shown(text)} must be > 0")
        if name in LIMITS and v > LIMITS[name][0]:
            raise _too_large(name, text)
        return v

    return conv


def positive_float(name: str):
    def conv(text: str) -> float:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name} {text!r} is empty (an unset shell variable?); give a number "
                                             "or leave the option out for its default")
        try:
            v = float(text) if len(text.strip()) <= 60 else None  # 60 characters hold any sensible number
        except ValueError:
            v = None
        if v is None:
            raise argparse.ArgumentTypeError(f"{name} {shown(text)} is not a number (write e.g. 300)")
        if not v > 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{name} {shown(text)} must be a finite number > 0")
        if name == "--timeout" and v < 1:
            raise argparse.ArgumentTypeError(f"--timeout {shown(text)} is below 1 second: starting torchrun and the "
                                             "workers alone takes seconds; use e.g. 300")
        if name in LIMITS and v > LIMITS[name][0]:
            raise _too_large(name, text)
        return v

    return conv


def whole_number(name: str):
    """Any whole number (--seed, --node-rank: their ranges are checked with the other options)."""
    def conv(text: str) -> int:
        digits = text.strip()
        if not re.fullmatch(r"[+-]?[0-9]{1,30}", digits):
            what = "is empty (an unset shell variable?)" if not digits else "is not a whole number"
            raise argparse.ArgumentTypeError(f"{name} {shown(text)} {what}; give e.g. 0")
        return int(digits)

    return conv


def delay_seconds(text: str) -> float:
    """The hidden --trial-delay (tests): 0 to 60 seconds."""
    try:
        v = float(text) if len(text) <= 60 else -1.0
    except ValueError:
        v = -1.0
    if not 0 <= v <= 60:
        raise argparse.ArgumentTypeError(f"--trial-delay {shown(text)} is not a number of seconds from 0 to 60")
    return v


def text_value(name: str):
    """A text option given explicitly must say something: `--cluster ""` (an unset shell variable)
    is an error, not the default, which is what leaving the option out gives."""
    def conv(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name} {text!r} is empty (an unset shell variable?); give a value "
                                             "or leave the option out for its default")
        if "\0" in text:
            raise argparse.ArgumentTypeError(f"{name} {shown(text)} contains a NUL character")
        if len(text) > MAX_VALUE_CHARS:
            raise argparse.ArgumentTypeError(f"{name} {shown(text)} is longer than {MAX_VALUE_CHARS:,} characters; "
                                             "give a name, spec, path or URL")
        return text

    return conv


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        # "argument --cluster: --cluster '' is empty": the option is named once.
        message = re.sub(r"^argument (\S+): (?=\1 )", "", message)
        sys.stderr.write(f"hetsim: error: {one_line(message)} (see --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m hetsim.search",
               description="Search training plans for a (heterogeneous) cluster, run the best for real, report.")
    p.add_argument("--model", type=text_value("--model"), default="resnet50",
                   help="resnet50, resnet18, resnet18_gn, mlp, gn_resnet, gpt, bert, vit, hf:NAME[?layers=N&...], "
                        "timm:NAME or module:function (returning an nn.Module, a UserModel or a Workload)")
    p.add_argument("--model-size", type=text_value("--model-size"), default=None,
                   help="size preset of gpt (tiny, mini, small = GPT-2 small, medium, large, xl), bert (tiny, mini, "
                        "base, large) or vit (tiny, mini, b16, l16); default: tiny on emulated clusters, "
                        "small/base/b16 on GPUs")
    p.add_argument("--seq-len", type=positive_int("--seq-len"), default=None,
                   help="tokens per sample of gpt, bert and hf: models (default: the preset's; 128 for hf:)")
    p.add_argument("--cluster", type=text_value("--cluster"), default=None, help="emu:SPEED@MEM,... | catalog:KEY[*N],... | cuda | FILE.toml "
                                                   "(default: cuda if GPUs are present, else emu:1.0@4G,0.5@2G)")
    p.add_argument("--global-batch", type=positive_int("--global-batch"), default=32)
    p.add_argument("--image-size", type=positive_int("--image-size"), default=None,
                   help="default: 224 on GPUs, 64 on emulated clusters")
    p.add_argument("--strategies", type=text_value("--strategies"), default=None, help="comma-separated families (default: all registered)")
    p.add_argument("--trials", type=positive_int("--trials"), default=100,
                   help="trials the study should hold in total: a resumed study runs only the missing ones, "
                        "its trial numbers continuing from the stored trials (rerun the same command to finish "
                        "an interrupted search)")
    p.add_argument("--top-k", type=positive_int("--top-k"), default=3)
    p.add_argument("--steps", type=positive_int("--steps"), default=8,
                   help="timed steps per real run (the median is reported; shared CPUs drift by ~10%%)")
    p.add_argument("--warmup", type=positive_int("--warmup"), default=3, help="untimed steps (at least 2: step 1 measures memory)")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=REPEATS,
                   help="real runs of each shortlisted plan, and up to 3 more while no two agree within the noise "
                        "floor; their median is reported, every run is kept (default %(default)s; 1: one run)")
    p.add_argument("--calib-repeats", type=positive_int("--calib-repeats"), default=CALIB_REPEATS,
                   help="real runs of each calibration plan, and up to 3 more while no two agree; each term is "
                        "solved on their median (default %(default)s; 1: one run, about a quarter of the "
                        "calibration time; terms already recorded are reused)")
    p.add_argument("--timeout", type=positive_float("--timeout"), default=300.0, help="seconds per real run")
    p.add_argument("--storage", type=text_value("--storage"), default=None,
                   help="where the study is kept: journal:PATH (Optuna's journal file, several writers) or an "
                        "Optuna storage URL such as sqlite:///PATH.db (default: journal:OUT/hetsim.journal)")
    p.add_argument("--jobs", type=positive_int("--jobs"), default=1,
                   help="search worker processes on the one study (a journal storage: SQLite breaks under "
                        "parallel writers)")
    p.add_argument("--study", type=text_value("--study"), default=None, help="study name (also the report folder's name); an existing "
                                                 "study resumes, keeping its trials and real-run measurements")
    p.add_argument("--out", type=text_value("--out"), default=str(DEFAULT_OUT),
                   help="output folder: the profiles cache, the study database, real-run logs and reports "
                        "(default: %(default)s, ignored by git; never results/, whose recordings runs only read)")
    p.add_argument("--no-execute", action="store_true",
                   help="profile, simulate and search only: no calibration runs (terms already recorded under "
                        "--out are used) and no real runs of plans")
    p.add_argument("--seed", type=whole_number("--seed"), default=0)
    p.add_argument("--reprofile", action="store_true", help="measure profiles again even if recorded ones match")
    p.add_argument("--precisions", type=text_value("--precisions"), default=None, help="comma-separated from fp32,bf16,fp16 (default: fp32,bf16)")
    p.add_argument("--optimizer", type=text_value("--optimizer"), default=None, help="adamw (default), adam or sgd")
    p.add_argument("--min-local-batch", type=positive_int("--min-local-batch"), default=1)
    p.add_argument("--no-checkpointing", action="store_true", help="do not search activation checkpointing")
    g = p.add_argument_group("torchrun (multi-node)")
    g.add_argument("--nnodes", type=text_value("--nnodes"), default="1")
    g.add_argument("--node-rank", type=whole_number("--node-rank"), default=None)
    g.add_argument("--rdzv-endpoint", type=text_value("--rdzv-endpoint"), default=None,
                   help="HOST:PORT; default: a one-node rendezvous that listens on 127.0.0.1 only")
    # For tests: inject a fault into the first real run, e.g. nan:1:2 (kind:rank:step).
    p.add_argument("--inject-fault", type=text_value("--inject-fault"), default=None, help=argparse.SUPPRESS)
    # For tests: seconds each trial waits, so that a test can kill a search half-way.
    p.add_argument("--trial-delay", type=delay_seconds, default=0.0, help=argparse.SUPPRESS)
    return p


def one_line(message: str) -> str:
    """An error message as one line: a multi-line cause (TOML, import errors) is joined with ' | '."""
    return " | ".join(ln.strip() for ln in str(message).splitlines() if ln.strip())


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    # A wide console when writing to a file or CI log, so the results table does not wrap.
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
    try:
        opts = prepare(argv, console)
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


def prepare(argv: list[str] | None, console):
    """Every check of the command line that needs no measurement, in order: the options, the
    cluster, the model, the batch against the cluster's memory.  Returns the run's Options, or
    raises HetsimError (SystemExit(2) for what argparse itself rejects).  The main job then opens
    the storage first, before it profiles anything."""
    return resolve(build_parser().parse_args(argv), console)


def resolve(args, console):
    from hetsim import strategies

    from . import checks
    from .options import Options, default_study_name

    # Cheap checks first: nothing below measures anything.
    precisions = _check_options(args)
    out = checks.output_folder(args.out, "--out")
    cluster = _cluster(args.cluster, console)
    # Below, torch is imported (the workload, the runner); nothing is measured yet.
    from hetsim.execution.runner import Launch

    fault = _parse_fault(args.inject_fault) if args.inject_fault else None
    known = strategies.names()  # imports the strategy modules, and torch
    names = checks.name_list(args.strategies, "--strategies", known, "strategy") if args.strategies else tuple(known)
    wl = _workload(args, cluster, console)
    _check_batch(args.global_batch, args.min_local_batch, cluster, wl)
    notes: list[str] = list(wl.notes)
    if cluster.emulated:
        precisions = tuple(p for p in precisions if p != "fp16") or ("fp32",)  # fp16 autocast is CUDA-only
    storage = _storage(args, out)
    study = args.study or default_study_name(wl.spec, cluster.spec, args.global_batch, names, precisions,
                                             not args.no_checkpointing, args.min_local_batch)
    launch = Launch(nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    return Options(model=args.model, cluster=cluster, workload=wl, global_batch=args.global_batch, strategies=names,
                   trials=args.trials, top_k=args.top_k, steps=args.steps, warmup=args.warmup,
                   repeats=args.repeats, calib_repeats=args.calib_repeats,
                   timeout_s=args.timeout, storage=storage, jobs=args.jobs, study=study, out=out, execute=not args.no_execute,
                   seed=args.seed, reprofile=args.reprofile, precisions=precisions,
                   min_local_batch=args.min_local_batch, checkpointing=not args.no_checkpointing, launch=launch,
                   notes=tuple(notes), fault=fault, trial_delay_s=args.trial_delay)


def _check_options(args) -> tuple[str, ...]:
    """The checks of options that need nothing loaded, in order; returns the asked precisions."""
    from hetsim.errors import ConfigError

    from . import checks

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
    if args.storage is not None:
        checks.storage_url(args.storage)
    if args.study is not None:
        checks.study_name(args.study)
    all_precisions = PRECISIONS
    precisions = (checks.name_list(args.precisions, "--precisions", all_precisions, "precision")
                  if args.precisions else DEFAULT_PRECISIONS)
    if args.optimizer is not None and args.optimizer not in OPTIMIZERS:
        raise UnknownNameError("optimizer", args.optimizer, list(OPTIMIZERS),
                               checks.closest_hint(args.optimizer, list(OPTIMIZERS)))
    return precisions


def _cluster(text: str, console):
    """The cluster of --cluster, described with its notes."""
    from rich.markup import escape

    from hetsim.hardware.cluster import parse_cluster

    cluster = parse_cluster(text)
    console.print(escape(cluster.describe()))
    for n in cluster.notes:
        console.print(f"[yellow]note:[/] {escape(n)}")
    return cluster


def _check_batch(global_batch: int, min_local_batch: int, cluster, wl) -> None:
    """The batch checks before anything is measured: every device gets its least local batch
    (checks.batch_covers_devices), and the batch's inputs and the profiler's micro-batches fit in
    memory (checks.batch_fits_memory; a catalog cluster has no profiler)."""
    from hetsim.workloads.footprint import sample_footprint

    from . import checks

    checks.batch_covers_devices(global_batch, len(cluster.devices), min_local_batch, wl.has_batchnorm, wl.name)
    on_gpu = cluster.source == "cuda"
    # A catalog cluster is never profiled (its block times come from the roofline of a meta-device trace).
    profiler_bytes = (0 if cluster.source == "catalog" else
                      max(d.memory_bytes for d in cluster.devices) if on_gpu else cluster.host_memory_bytes)
    checks.batch_fits_memory(global_batch, sample_footprint(wl), wl.name, [d.memory_bytes for d in cluster.devices],
                             profiler_bytes, "the GPU" if on_gpu else "this machine's CPU")


def _storage(args, out) -> str:
    """The study's storage URL (a journal in --out by default); several --jobs need a journal."""
    from hetsim.errors import ConfigError

    from . import checks

    storage = args.storage if args.storage is not None else f"journal:{(out / 'hetsim.journal').resolve()}"
    if args.jobs > 1 and not (storage.startswith("journal:") or storage.endswith(".journal")):
        raise ConfigError(f"--jobs {args.jobs} with --storage {shown(checks.masked_url(storage))}: several search workers "
                          "need a journal storage (SQLite breaks under parallel writers); use --storage "
                          "journal:PATH or --jobs 1")
    return storage


def _workload(args, cluster, console):
    """The workload of --model with its size options, printed; every misuse is a ConfigError."""
    from rich.markup import escape

    from hetsim.errors import ConfigError
    from hetsim.workloads.builtin import (
        BUILTIN,
        IMAGE_MODELS,
        SEQUENCE_MODELS,
        SIZED_MODELS,
        default_image_size,
        default_size,
        load_workload,
    )

    from . import checks


    model = args.model
    external = ":" in model
    if not external and model not in BUILTIN:
        raise UnknownNameError("model", model, list(BUILTIN),
                               " ".join(filter(None, [checks.closest_hint(model, list(BUILTIN)),
                                                      "Or pass module:function returning an nn.Module, hf:NAME or "
                                                      "timm:NAME."])))
    if args.model_size is not None and model not in SIZED_MODELS:
        raise ConfigError(f"--model-size {args.model_size} does not apply to --model {model} (models with size "
                          f"presets: {', '.join(sorted(SIZED_MODELS))}); drop --model-size")
    if args.seq_len is not None and model not in SEQUENCE_MODELS and not model.startswith("hf:"):
        raise ConfigError(f"--seq-len {args.seq_len} does not apply to --model {model} (sequence models: "
                          f"{', '.join(sorted(SEQUENCE_MODELS))}, hf:NAME); drop --seq-len")
    size = args.image_size
    timm = model.startswith("timm:")
    if size is not None and not timm and (external or model not in IMAGE_MODELS):
        why = ("a Hugging Face language model" if model.startswith("hf:") else "its inputs come from its own batch "
               "maker") if external else "not an image model"
        raise ConfigError(f"--image-size {size} does not apply to --model {model} ({why}; image models: "
                          f"{', '.join(sorted(IMAGE_MODELS))}, timm:NAME); drop --image-size")
    if size is None and (timm or not external):
        size = default_image_size(model, cluster.source != "cuda")
        if size:
            console.print(f"image size {size} px (default for this cluster; set --image-size to change)")
    if size:
        checks.image_fits(size, model, max(d.memory_bytes for d in cluster.devices))
    preset, seq = default_size(model, cluster.source)
    if external and not model.startswith(("hf:", "timm:")):
        checks.user_model_fits_somewhere(model, args.optimizer, [d.memory_bytes for d in cluster.devices])
    wl = load_workload(model, size, args.optimizer, size=args.model_size or preset, seq_len=args.seq_len or seq)
    if wl.about:
        defaults = ("" if external or model not in SIZED_MODELS or (args.model_size and (args.seq_len or
                    model == "vit")) else " (default for this cluster; set --model-size"
                    + ("" if model == "vit" else " and --seq-len") + " to change)")
        console.print(escape(wl.about + defaults))
    for n in wl.notes:
        console.print(f"[yellow]note:[/] {escape(n)}")
    checks.model_fits_somewhere(wl, [d.memory_bytes for d in cluster.devices])
    return wl


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
        raise ConfigError(f"--inject-fault {shown(text)} is not KIND[:RANK[:STEP]] with KIND one of "
                          f"{', '.join(FAULT_KINDS)}; e.g. nan:1:2")
    return Fault(kind=kind, rank=rank, at_step=step)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
