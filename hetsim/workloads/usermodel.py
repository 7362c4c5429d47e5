"""A user's own model: `--model pkg.mod:fn`, where `fn()` returns one of

- a `hetsim.workloads.Workload` (hand-written blocks: used as it is);
- a `UserModel(module=..., make_batch=... or example_batch=..., loss=...)`;
- a plain `nn.Module` (with `example_batch`/`make_batch`/`loss` as attributes of the function, or
  a dict / tuple `(module, batch_or_maker, loss)` with the same meaning).

`fn` is called again (after `torch.manual_seed(0)`) whenever fresh weights are needed, in every
worker, so it must build the same model each time.  hetsim finds the cut points itself
(`hetsim.workloads.cutpoints`).  Every rule is checked on a batch of two before anything is
measured: the batch maker's shapes, the loss being a finite scalar.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from hetsim.errors import ConfigError
from hetsim.workloads.base import Workload
from hetsim.workloads.cutpoints import per_sample_parts, split_module

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(kw_only=True)
class UserModel:
    """What hetsim needs to train a plain module."""

    module: nn.Module
    make_batch: Callable[[int, int], Batch] | None = None
    """(n, seed) -> (inputs, targets) with n samples, deterministic for the seed."""
    example_batch: Batch | None = None
    """Or an example (inputs, targets): batches are drawn from its rows, deterministically."""
    loss: Callable[[object, torch.Tensor], torch.Tensor] | None = None
    """(output, targets) -> the batch MEAN loss, as torch's losses give by default (cross-entropy if None)."""
    optimizer: str = "adamw"
    lr: float = 1e-3
    tokens_per_sample: int = 0


def from_rows(example: Batch) -> Callable[[int, int], Batch]:
    x, y = example

    def make(n: int, seed: int) -> Batch:
        idx = torch.randint(0, x.shape[0], (n,), generator=torch.Generator().manual_seed(seed))
        return x[idx].clone(), y[idx].clone()

    return make


def as_user_model(obj: object, fn: Callable, spec: str) -> UserModel:
    """Whatever `fn()` returned, as a UserModel (a ConfigError naming the rule when it is none)."""
    if isinstance(obj, UserModel):
        return obj
    if isinstance(obj, dict):
        try:
            return UserModel(**obj)
        except TypeError as e:
            raise ConfigError(f"--model {spec!r}: the dict returned by {fn.__name__}() does not fit "
                              f"UserModel ({e}); use the keys module, make_batch or example_batch, loss") from None
    if isinstance(obj, tuple) and obj and isinstance(obj[0], nn.Module) and len(obj) in (2, 3):
        batch = obj[1]
        loss = obj[2] if len(obj) == 3 else None
        return UserModel(module=obj[0], make_batch=batch if callable(batch) else None,
                         example_batch=None if callable(batch) else batch, loss=loss)
    if isinstance(obj, nn.Module):
        return UserModel(module=obj, make_batch=getattr(fn, "make_batch", None),
                         example_batch=getattr(fn, "example_batch", None), loss=getattr(fn, "loss", None))
    raise ConfigError(f"--model {spec!r}: {fn.__name__}() returned {type(obj).__name__}; return an nn.Module, "
                      "a hetsim.workloads.UserModel(module=..., make_batch=..., loss=...) or a hetsim Workload")


def user_workload(spec: str, fn: Callable[[], object], first: UserModel) -> Workload:
    """The workload of a user's module: checked batch maker and loss, blocks from its cut points."""
    name = spec
    if first.make_batch is None and first.example_batch is None:
        raise ConfigError(f"--model {spec!r}: hetsim needs inputs for the module: give make_batch(n, seed) -> "
                          "(inputs, targets) or example_batch=(inputs, targets)")
    make = first.make_batch or from_rows(first.example_batch)
    mean_loss = first.loss or nn.functional.cross_entropy
    _check(spec, first.module, make, mean_loss)
    x, y = make(2, 0)
    split = split_module(first.module, x, name)
    with torch.no_grad():
        out = first.module(x)
        packing = _Packing.of(spec, out)
        if packing is not None and packing.dropped:
            _check_dropped(spec, packing, out, y, mean_loss)

    def loss_sum(out, y: torch.Tensor) -> torch.Tensor:
        if packing is not None:
            out = packing.unpack(out)
        return mean_loss(out, y) * y.shape[0]  # the runner divides by the global batch

    def build() -> list[tuple[str, nn.Module]]:
        blocks = list(split_module(as_user_model(fn(), fn, spec).module, x, name).blocks)
        if packing is not None:
            last, block = blocks[-1]
            blocks[-1] = (last, nn.Sequential(block, packing))
        return blocks

    params = sum(p.numel() for p in first.module.parameters())
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in first.module.modules())
    return Workload(name=spec.rpartition(":")[2], build_blocks=build, make_batch=make, loss_sum=loss_sum,
                    optimizer=first.optimizer, lr=first.lr, has_batchnorm=has_bn, spec=spec,
                    tokens_per_sample=first.tokens_per_sample, notes=split.notes, params=params,
                    about=f"{spec}: {type(first.module).__name__}, {params / 1e6:.2f}M parameters, "
                          f"{len(split.blocks)} blocks ({', '.join(n for n, _ in split.blocks[:6])}"
                          f"{', ...' if len(split.blocks) > 6 else ''})")


class _Packing(nn.Module):
    """A module's output that is not one tensor (a dict of logits, a tuple with an auxiliary output), as
    one: every executor, profile and pipeline stage hands on one tensor, so the last block ends by
    packing the output's tensors, each flattened per sample, side by side (`forward`), and the loss
    unpacks them into the user's structure (`unpack`) before the user's loss sees it.  Entries that are
    not tensors (None, a Hugging Face model's key-value cache) are dropped: the loss sees None there."""

    def __init__(self, spec: Any, shapes: list[torch.Size | None], dtypes: list[torch.dtype | None]):
        super().__init__()
        self.spec, self.shapes, self.dtypes = spec, shapes, dtypes

    @property
    def dropped(self) -> list[int]:
        """Positions of the output's leaves that are not tensors."""
        return [i for i, s in enumerate(self.shapes) if s is None]

    @staticmethod
    def of(model_spec: str, out: object) -> _Packing | None:
        """None when `out` is one tensor; a ConfigError when a tensor in it has no batch dimension."""
        if isinstance(out, torch.Tensor):
            return None
        leaves, spec = tree_flatten(out)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        n = next((t.shape[0] for t in tensors if t.dim() > 0), None)
        bad = [t for t in tensors if t.dim() == 0 or t.shape[0] != n]
        if bad or not tensors:
            what = f"a tensor of shape {tuple(bad[0].shape)}" if bad else "no tensor"
            raise ConfigError(f"--model {model_spec!r}: the module's output holds {what}, not a tensor per "
                              "sample; return tensors with the batch along dimension 0 (compute scalars in the loss)")
        return _Packing(spec, [t.shape[1:] if isinstance(t, torch.Tensor) else None for t in leaves],
                        [t.dtype if isinstance(t, torch.Tensor) else None for t in leaves])

    def forward(self, out: object) -> torch.Tensor:
        leaves = tree_flatten(out)[0]
        return torch.cat([t.reshape(t.shape[0], -1).float() for t in leaves if isinstance(t, torch.Tensor)], dim=1)

    def unpack(self, packed: torch.Tensor) -> object:
        parts = iter(per_sample_parts(packed, [s for s in self.shapes if s is not None]))
        leaves = []
        for s, d in zip(self.shapes, self.dtypes, strict=True):
            p = None if s is None else next(parts)
            leaves.append(p if p is None or d.is_floating_point else p.to(d))
        return tree_unflatten(leaves, self.spec)


def _check_dropped(spec: str, packing: _Packing, out: object, y: torch.Tensor, mean_loss) -> None:
    """The loss gives the same value on the output with its non-tensor entries dropped, or a ConfigError."""
    leaves = tree_flatten(out)[0]
    what = ", ".join(sorted({type(leaves[i]).__name__ for i in packing.dropped}))
    try:
        same = torch.allclose(mean_loss(packing.unpack(packing(out)), y), mean_loss(out, y), rtol=1e-4, atol=1e-6)
    except Exception:
        same = False
    if not same:
        raise ConfigError(f"--model {spec!r}: the loss reads the module output's {what}, which hetsim drops (only "
                          "tensors with the batch along dimension 0 pass between pipeline stages); return tensors "
                          "per sample and compute the rest in the loss")


def _check(spec: str, module: nn.Module, make: Callable[[int, int], Batch], mean_loss) -> None:
    """The batch maker gives (inputs, targets) of n samples; the loss is a finite scalar."""
    try:
        batch = make(2, 0)
    except Exception as e:
        raise ConfigError(f"--model {spec!r}: make_batch(2, 0) raised {type(e).__name__}: {e}; fix the batch maker") from None
    if not (isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ConfigError(f"--model {spec!r}: make_batch(n, seed) must return (inputs, targets), two tensors; it "
                          f"returned {_shape_of(batch)}" + (
                              "; hetsim feeds a model one input tensor: stack several inputs into one along "
                              "dimension 1 and split them in forward (targets likewise)"
                              if isinstance(batch, tuple | list) and len(batch) == 2 else ""))
    sparse = [n for n, m in module.named_modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse]
    if sparse:
        raise ConfigError(f"--model {spec!r}: module {sparse[0]!r} ({type(module.get_submodule(sparse[0])).__name__}) "
                          "was built with sparse=True, whose sparse gradients AdamW, Adam and ZeRO's sharded "
                          "parameters refuse; build it with sparse=False")
    x, y = batch
    if x.shape[:1] != (2,) or y.shape[:1] != (2,):
        raise ConfigError(f"--model {spec!r}: make_batch(2, 0) returned inputs {tuple(x.shape)} and targets "
                          f"{tuple(y.shape)}; both need 2 samples along dimension 0 (n, ...)")
    try:
        loss = mean_loss(module(x), y)
    except Exception as e:
        raise ConfigError(f"--model {spec!r}: the module or its loss fails on make_batch(2, 0) "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); fix the shapes or the loss") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"--model {spec!r}: the loss must return one number (a scalar tensor, the batch mean); "
                          f"it returned {shape}: reduce it with .mean()")
    if not torch.isfinite(loss):
        raise ConfigError(f"--model {spec!r}: the loss on make_batch(2, 0) is {float(loss)}; it must be finite")


def load_user(spec: str) -> Workload:
    """`module:function` -> its Workload (see the module docstring)."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ConfigError(f"--model {spec!r}: write module:function, e.g. mypkg.models:my_model")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"--model {spec!r}: module {mod_name!r} cannot be imported ({e}); check PYTHONPATH") from None
    except Exception as e:  # the module itself fails while importing (syntax error, its own exception)
        raise ConfigError(
            f"--model {spec!r}: importing module {mod_name!r} raised {type(e).__name__}: {e}; fix the module"
        ) from None
    fn = getattr(mod, fn_name, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"--model {spec!r}: module {mod_name!r} has no callable {fn_name!r}")

    def call() -> object:
        torch.manual_seed(0)
        try:
            return fn()
        except Exception as e:  # user code: report what it raised
            raise ConfigError(f"--model {spec!r}: {fn_name}() raised {type(e).__name__}: {e}; fix the function "
                              "that builds the model") from None

    got = call()
    if isinstance(got, Workload):
        got.spec = spec
        return got
    return user_workload(spec, call, as_user_model(got, fn, spec))


def meta_params(spec: str) -> tuple[int, str] | None:
    """(parameters, optimizer) of the module that `module:function` builds, counted on the meta device
    without allocating its weights: a model too large to train anywhere is refused before it is built
    for real.  None when it cannot be built there (its own errors come when it is built for real)."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
        with torch.device("meta"):
            got = fn()
        if isinstance(got, Workload):
            return None
        user = as_user_model(got, fn, spec)
        return sum(p.numel() for p in user.module.parameters()), user.optimizer
    except Exception:
        return None


def _shape_of(obj: object) -> str:
    """What a batch maker returned, one level deep: 'tuple(tuple(Tensor, Tensor), Tensor)'."""
    if isinstance(obj, tuple | list):
        return f"{type(obj).__name__}({', '.join(_shape_of(o) if isinstance(o, tuple | list) else type(o).__name__ for o in obj)})"
    return type(obj).__name__
