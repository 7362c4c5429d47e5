"""The data `hetsim.search.train` feeds a plan: the user's own Dataset (`--data pkg.mod:fn`) or, by
default, synthetic samples from the workload's batch maker."""

from __future__ import annotations

import importlib

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from hetsim.errors import ConfigError
from hetsim.workloads import Workload

SYNTHETIC_BATCHES = 8
"""Global batches in one epoch of the default synthetic dataset."""


def synthetic_dataset(wl: Workload, global_batch: int, seed: int = 0) -> TensorDataset:
    """SYNTHETIC_BATCHES global batches of the workload's own synthetic samples."""
    x, y = wl.make_batch(global_batch * SYNTHETIC_BATCHES, seed)
    return TensorDataset(x, y)


def load_dataset(spec: str) -> Dataset:
    """`pkg.mod:fn`, where fn() returns a map-style Dataset of (input, target) pairs."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ConfigError(f"--data {spec!r}: write module:function returning a torch Dataset, e.g. mypkg.data:train_set")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except ImportError as e:
        raise ConfigError(f"--data {spec!r}: module {mod_name!r} cannot be imported ({e}); check PYTHONPATH") from None
    except AttributeError:
        raise ConfigError(f"--data {spec!r}: module {mod_name!r} has no {fn_name!r}") from None
    try:
        ds = fn()
    except Exception as e:  # the user's code: say what it raised
        raise ConfigError(f"--data {spec!r}: {fn_name}() raised {type(e).__name__}: {e}") from None
    if not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
        raise ConfigError(f"--data {spec!r}: {fn_name}() returned {type(ds).__name__}, expected a map-style "
                          "torch Dataset (with __len__ and __getitem__) of (input, target) pairs")
    return ds


def check_size(ds: Dataset, global_batch: int, spec: str) -> None:
    n = len(ds)  # type: ignore[arg-type]
    if n < global_batch:
        raise ConfigError(f"--data {spec!r} has {n} samples, fewer than one global batch of the plan "
                          f"({global_batch}); use a larger dataset or a plan with a smaller --global-batch")


def collate(ds: Dataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples at `indices` as one (inputs, targets) batch."""
    if isinstance(ds, TensorDataset):
        idx = torch.tensor(indices, dtype=torch.long)
        return ds.tensors[0][idx], ds.tensors[1][idx]
    x, y = default_collate([ds[i] for i in indices])
    return x, y
