"""Public helpers that strategy families share: batch splits, search choices, warnings, and the torch side of a real run.

A third-party family imports these rather than copying them, so that every family splits a batch,
names its search parameters and builds its model by the same rules:

- search parameters: `name(name)` gives the Optuna name `"<family>.<name>"`;
  `choose_devices`, `choose_common`, `choose_accum` suggest the knobs most families have;
- batch splits: `split_evenly` (a local batch into accumulation micro-batches, a global batch
  into equal shares; hetsim.model.batchsplit's), `min_max_split` (the exact min-max split of
  samples over workers of different speeds, also hetsim.model.batchsplit's), `uneven_split` (an example uneven split), `balance_batch` (the exact
  min-max split of a data-parallel step over mismatched devices);
- search memo: `memo_solve` (an exact inner solver once per outer choice);
- rules: `min_micro_batch` (BatchNorm needs two samples per micro-batch), `batchnorm_warning`,
  `precision_ok`;
- labels: `knobs_label` (a plan's precision and checkpointing, as every label ends);
- real runs: `apply_checkpointing`, `autocast` (hetsim.workloads.precision's, re-exported),
  `full_grads`, `clean_name`, and an executor's `step` and `compute_grads` around its own forward
  and backward: `train_step`, `grads_of_one_pass`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetsim.errors import InfeasiblePlanError
from hetsim.hardware.cluster import interchangeable_groups
from hetsim.model.batchsplit import min_max_split, split_evenly
from hetsim.model.memory import data_parallel_memory
from hetsim.names import BN_MIN_SAMPLES, min_samples_per_micro_batch
from hetsim.types import MemoryBreakdown
from hetsim.workloads.precision import autocast

from ._coupled import no_graph_forward_s
from .base import param

if TYPE_CHECKING:
    import optuna

    from hetsim.model.costmodel import CostModel

    from .base import Plan, SearchContext

__all__ = [
    "BN_MIN_MICRO_BATCH",
    "BN_MIN_SAMPLES",
    "apply_checkpointing",
    "autocast",
    "balance_batch",
    "batchnorm_warning",
    "choose_accum",
    "choose_common",
    "choose_devices",
    "clean_name",
    "full_grads",
    "grads_of_one_pass",
    "knobs_label",
    "local_floor",
    "memo_solve",
    "min_max_split",
    "min_micro_batch",
    "ParamName",
    "param",
    "precision_ok",
    "trains_in",
    "split_evenly",
    "train_step",
    "uneven_split",
]

BN_MIN_MICRO_BATCH = 8
"""BatchNorm's batch statistics get noisy below about 8 samples per device and hurt accuracy
(the Group Normalization paper, Wu and He 2018, measured it); hetsim warns there, it does not refuse."""


# ----------------------------------------------------------------------------- search parameters


ParamName = Callable[[str], str]
"""How a family names a knob for Optuna: `Strategy.param` (`"accum_steps"` -> `"ddp.accum_steps"`)."""


def choose_devices(trial: optuna.Trial, ctx: SearchContext, name: ParamName) -> tuple[int, ...]:
    """Which devices take part, in index order: one suggestion per group of interchangeable devices.

    A device like no other is a yes/no, `use_dev{i}`; a group of k identical devices is a count
    0..k, `count_dev{first}`, and takes the group's first devices: which ones cannot change a
    prediction.  On 64 devices of 4 kinds that is 4 counts instead of 64 coins, which TPE handles
    far faster and which reaches any subset size with fair odds (64 coins almost always pick ~32).
    """
    cost = ctx.cost
    if cost.n_devices == 1:
        return (0,)
    groups = cost.memo(("interchangeable_groups",), lambda: interchangeable_groups(cost.cluster))
    used: list[int] = []
    for g in groups:
        if len(g) == 1:
            if trial.suggest_categorical(name(f"use_dev{g[0]}"), [True, False]):
                used.append(g[0])
        else:
            used.extend(g[: trial.suggest_int(name(f"count_dev{g[0]}"), 0, len(g))])
    if not used:
        raise InfeasiblePlanError(
            "the trial chose no device (every use_dev* is False and every count_dev* is 0); "
            "a plan needs at least one device"
        )
    return tuple(sorted(used))


def choose_common(trial: optuna.Trial, ctx: SearchContext, devices: tuple[int, ...], name: ParamName) -> tuple[str, int]:
    """(precision, checkpointed blocks): the knobs every family has (`precision`, `checkpoint_blocks`)."""
    cost = ctx.cost
    precs = [p for p in ctx.precisions if all(precision_ok(cost, d, p) for d in devices)] or ["fp32"]
    precision = trial.suggest_categorical(name("precision"), list(ctx.precisions))
    if precision not in precs:
        raise InfeasiblePlanError(f"precision {precision} is not supported by every chosen device")
    n = cost.facts.n_blocks
    ckpt = trial.suggest_categorical(name("checkpoint_blocks"), [0, n // 2, n]) if ctx.checkpointing else 0
    return precision, ckpt


def choose_accum(trial: optuna.Trial, ctx: SearchContext, name: ParamName) -> int:
    """Gradient-accumulation steps, `accum_steps` (always 1 where the loss couples the samples of a batch)."""
    if ctx.cost.facts.batch_coupled:
        return 1
    return trial.suggest_categorical(name("accum_steps"), [a for a in (1, 2, 4) if a <= ctx.max_accum])


def precision_ok(cost: CostModel, dev: int, precision: str) -> bool:
    """Whether cluster device `dev` can train in `precision` at all."""
    return trains_in(cost.device(dev), precision)


def trains_in(d, precision: str) -> bool:
    """Whether device `d` (a `hetsim.hardware.cluster.Device`) can train in `precision` at all."""
    if precision == "bf16":
        return d.supports_bf16
    if precision == "fp16":
        return d.backend != "emulated"  # fp16 autocast with loss scaling is CUDA-only
    return True


def knobs_label(plan: Plan) -> str:
    """The end of a plan's label: its precision unless fp32, its checkpointed blocks unless none."""
    s = ""
    if plan.precision != "fp32":
        s += f" {plan.precision}"
    if plan.checkpoint_blocks:
        s += f" ckpt {plan.checkpoint_blocks}"
    return s


# ----------------------------------------------------------------------------- batch splits


def uneven_split(global_batch: int, n: int) -> tuple[int, ...]:
    """An example uneven split: device 0 takes what the others, at gb // (n + 1) each, leave."""
    if n == 1:
        return (global_batch,)
    rest = global_batch // (n + 1)
    return tuple([global_batch - rest * (n - 1)] + [rest] * (n - 1))


def settled(trial, name: str, value):
    """`value`, recorded as what knob `name` took where the trial can record it (hetsim's search
    loop: `LiteTrial.settle`; an Optuna trial keeps what it drew).  For a knob drawn from a fixed set
    and then moved to the nearest value the plan allows: the stored trial says what ran, so a
    search that mutates it starts from there, not from a drawn value nobody ran.  `value` must be
    one of the knob's choices."""
    settle = getattr(trial, "settle", None)
    if settle is not None:
        settle(name, value)
    return value


def min_micro_batch(ctx: SearchContext) -> int:
    """Fewest samples a micro-batch may hold: the user's `--min-local-batch`, and two for BatchNorm."""
    return min_samples_per_micro_batch(ctx.cost.facts.has_batchnorm, ctx.min_local_batch)


def local_floor(ctx: SearchContext, accum: int) -> int:
    """Fewest samples a device's local batch may have: BatchNorm needs two in every micro-batch,
    not just in every local batch."""
    return max(min_micro_batch(ctx), accum * (BN_MIN_SAMPLES if ctx.cost.facts.has_batchnorm else 1))


def balance_batch(cost: CostModel, devices: tuple[int, ...], global_batch: int, accum: int,
                  precision: str, ckpt: int, min_local: int, *,
                  memory_fn: Callable[[int, int], MemoryBreakdown] | None = None,
                  grad_cache: bool = False) -> tuple[int, ...]:
    """The exact min-max split (`min_max_split`) of a data-parallel step over mismatched devices:
    each next sample goes to the device that finishes it soonest.  Memory caps bound each
    device's share when they can; `memory_fn(device, micro_batch)` gives a family's own memory
    model (default: plain DDP's).  `grad_cache`: `accum` counts gradient-cache chunks, each
    forwarded twice."""
    floor = max(min_local, accum)
    if floor * len(devices) > global_batch:
        raise InfeasiblePlanError(
            f"global batch {global_batch} cannot give each of {len(devices)} devices at least {floor} samples "
            f"(min local batch {min_local}, {accum} accumulation steps); raise --global-batch or use fewer devices"
        )
    step_time = _data_parallel_step_time(cost, devices, accum, precision, ckpt, grad_cache)
    fit_memo: dict[tuple[int, int], bool] = {}

    def fits(i: int, b: int) -> bool:
        d = devices[i]
        micro = -(-b // accum)
        key = (d, micro)
        if key not in fit_memo:
            m = memory_fn(d, micro) if memory_fn else data_parallel_memory(cost, d, micro, precision, ckpt)
            fit_memo[key] = m.total_bytes <= cost.device(d).memory_bytes
        return fit_memo[key]

    monotone = all(cost.monotone_in_batch(d, precision) for d in devices)
    return min_max_split(len(devices), global_batch, floor, step_time, fits, monotone=monotone)


def _data_parallel_step_time(cost: CostModel, devices: tuple[int, ...], accum: int, precision: str,
                             ckpt: int, grad_cache: bool) -> Callable[[int, int], float]:
    """(position in `devices`, local batch) -> that device's compute and optimizer time, memoised."""
    n = cost.facts.n_blocks
    opt_params = cost.trainable_count()

    def compute_time(d: int, b: int) -> float:
        t = sum(cost.fwd_s(d, 0, n, m, precision) + cost.bwd_s(d, 0, n, m, precision)
                + cost.recompute_s(d, 0, n, m, precision, ckpt) + cost.overhead_s(d, m, grad_cache, precision)
                + (no_graph_forward_s(cost, d, m, precision) if grad_cache else 0.0)
                for m in split_evenly(b, accum))
        return t + cost.opt_s(d, opt_params)

    def step_time(i: int, b: int) -> float:
        d = devices[i]
        return cost.memo(("ddp_step", d, b, accum, precision, ckpt, grad_cache), lambda: compute_time(d, b))

    return step_time


def batchnorm_warning(cost: CostModel, devices: tuple[int, ...], micro_batches: tuple[int, ...]) -> str | None:
    """A warning when a BatchNorm model gets per-device micro-batches too small for its statistics."""
    if not cost.facts.has_batchnorm:
        return None
    small = [(d, b) for d, b in zip(devices, micro_batches) if b < BN_MIN_MICRO_BATCH]
    if not small:
        return None
    which = ", ".join(f"device {d}: {b}" for d, b in small)
    return (
        f"BatchNorm model with per-device micro-batches below {BN_MIN_MICRO_BATCH} ({which}): each device "
        "normalises with its own small-batch statistics, which can hurt accuracy; raise the global batch or "
        "--min-local-batch, use fewer accumulation steps, or a GroupNorm model"
    )


# ----------------------------------------------------------------------------- real runs (torch)

CKPT_PREFIX = "_checkpoint_wrapped_module."


def own_micro_batches(x: torch.Tensor, y: torch.Tensor, lo: int, hi: int, sizes: Sequence[int],
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Samples [lo, hi) of a global batch, split into micro-batches of `sizes` samples, each its own
    tensor on `device`, as `.to("cuda")` makes it: on a CPU a view would keep (and MemTracker would
    count) the storage of the whole global batch."""
    return [(a.to(device, copy=True), b.to(device, copy=True))
            for a, b in zip(torch.split(x[lo:hi], list(sizes)), torch.split(y[lo:hi], list(sizes)))]


def apply_checkpointing(model: nn.Sequential, k: int) -> None:
    """Wrap the first k blocks in non-reentrant activation checkpointing (torch's own wrapper)."""
    if k <= 0:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    names = [n for n, _ in model.named_children()][:k]
    for n in names:
        setattr(model, n, checkpoint_wrapper(getattr(model, n), checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def scaled_loss(ctx, out: torch.Tensor, y, scale: float) -> torch.Tensor:
    """The workload's summed loss of `out` (in fp32) times `scale`, throttled like a block where `ctx`, the
    rank's context, has an emulator (`Emulator.loss`)."""
    def fn(o: torch.Tensor) -> torch.Tensor:
        return ctx.workload.loss_sum(o.float(), y) * scale

    return fn(out) if ctx.emulator is None else ctx.emulator.loss(fn, out)


def clean_name(name: str) -> str:
    """Parameter name in the unwrapped model (drops DDP, FSDP, checkpoint and compile prefixes)."""
    for prefix in ("module.", "_orig_mod."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name.replace(CKPT_PREFIX, "")


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient this rank holds, whole (a DTensor shard is gathered), by clean name."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "full_tensor"):  # DTensor (FSDP2)
            g = g.full_tensor()
        out[clean_name(name)] = g.detach().clone()
    return out


def train_step(opt, forward_backward: Callable[[], float | None], scaler=None) -> float | None:
    """An executor's `step`: `forward_backward()`, the optimizer step (through `scaler`, a GradScaler,
    when given), then the gradients zeroed but kept allocated, so that a step's measured peak holds
    them throughout.  Returns forward_backward's loss."""
    loss = forward_backward()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=False)
    return loss


def grads_of_one_pass(opt, forward_backward: Callable[[], object],
                      modules: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """An executor's `compute_grads`: gradients dropped, one `forward_backward()`, no optimizer step;
    the `full_grads` of every module in `modules`, merged."""
    opt.zero_grad(set_to_none=True)
    forward_backward()
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        out.update(full_grads(module))
    return out


def memo_solve(cost: CostModel, key: tuple, solve: Callable[[], Plan]) -> Plan:
    """`solve()` once per key, its InfeasiblePlanError too: a search meets the same outer choices
    (the same ordered devices, schedule, micro-batches...) many times, and an exact inner solver
    (a pipeline's stage boundaries) is deterministic in them."""
    table = cost.memo_table("solve")
    found = table.get(key)
    if found is None:
        try:
            found = table[key] = solve()
        except InfeasiblePlanError as e:
            found = table[key] = e
    if isinstance(found, InfeasiblePlanError):
        raise InfeasiblePlanError(str(found))
    return found
