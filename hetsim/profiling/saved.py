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


def saved_ends(blocks: Iterable[torch.nn.Module], x: torch.Tensor,
               exclude: set[int] | frozenset[int] = frozenset()) -> list[tuple[bool, bool]]:
    """Per block, chained on `x` as in training (with autograd, under the caller's autocast): whether
    the block's own graph saves its input, and whether it saves its output.  Where one block saves its
    output and the next saves it as its input, the two profiled blocks count one storage twice; where
    either does not (a block that ends in a concatenation or a residual add; one that casts its input
    first, under autocast), nothing is shared.  `exclude`: the parameters' `storage_ids`."""
    ends = []
    h = x
    with torch.enable_grad():
        for blk in blocks:
            with saved_storages(exclude) as seen:
                out = blk(h)
            ends.append((isinstance(h, torch.Tensor) and storage_id(h) in seen,
                         isinstance(out, torch.Tensor) and storage_id(out) in seen))
            h = out
    return ends
