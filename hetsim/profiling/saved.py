"""Counting what autograd saves for backward: the one saved-tensor hook behind every saved-bytes
figure (block and whole-model profiles, the meta-device shape trace, a workload's footprint)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


def storage_id(t: torch.Tensor) -> int:
    """A tensor's storage, known by its implementation: views share it, and meta tensors (which have
    no data pointer) have one too."""
    return t.untyped_storage()._cdata


def storage_ids(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {storage_id(t) for t in tensors}


@contextmanager
def saved_storages(exclude: set[int] | frozenset[int] = frozenset()) -> Iterator[dict[int, int]]:
    """Inside the block, every distinct storage autograd saves for backward, except those in `exclude`
    (`storage_ids` of the parameters, say), is recorded as storage id -> bytes in the yielded dict.

    The hook packs a detached tensor, not the tensor itself: a saved output would otherwise hold its
    own graph in a cycle through C++ that gc cannot collect, and every counted forward dropped without
    a backward leaked (simclr's profiling grew to 24 GB).  Gradients are the same either way."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            if st._cdata not in exclude:
                seen.setdefault(st._cdata, st.nbytes())
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            pass
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen
