"""The saved-tensor counters of profiling free what they counted.

Each counts the storages autograd saves through one `saved_tensors_hooks` context
(`hetsim.profiling.saved.saved_storages`).  An identity pack hook keeps
a saved output together with its own graph (output -> grad_fn -> saved output), a cycle through
C++ that Python's collector cannot see: every counted forward whose graph was dropped without a
backward stayed in memory.  Profiling simclr@96 (global batch 256) grew to 24 GB that way and was
killed by the kernel; the hooks now pack a detached tensor.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hetsim.profiling import measure, memcal
from hetsim.profiling.saved import saved_storages, storage_ids


def _graph_with_saved_output(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x * 2.0)  # exp saves its own output for backward


def test_block_counter_frees_the_counted_graph():
    x = torch.randn(64, 64, requires_grad=True)
    out, nbytes = measure._saved_bytes(lambda: _graph_with_saved_output(x), exclude=set())
    assert nbytes == 64 * 64 * 4  # exp's output (the product is not saved: a scalar factor)
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None


def test_whole_model_counter_frees_the_counted_graph(monkeypatch):
    kept = []
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Sigmoid())  # sigmoid saves its output
    real_forward = model.forward

    def forward(x):
        out = real_forward(x)
        kept.append(weakref.ref(out))
        return out

    monkeypatch.setattr(model, "forward", forward)
    nbytes = memcal._saved_bytes(model, torch.randn(16, 32), torch.device("cpu"), "fp32")
    assert nbytes >= 16 * 32 * 4
    gc.collect()
    assert kept and kept[0]() is None


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_shared_counter_frees_the_counted_graph(device):
    """The counter of the meta shape tracer and the workload footprint too (meta tensors have no
    data pointer: storages are known by their implementation)."""
    x = torch.randn(8, 8, device=device, requires_grad=True)
    with saved_storages() as seen:
        out = _graph_with_saved_output(x)
    assert list(seen.values()) == [8 * 8 * 4]
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None


def test_identity_pack_hook_would_keep_it():
    """The cause, shown with torch alone, so this file fails loudly if torch ever breaks the cycle
    itself (then the detach is no longer needed)."""
    x = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = _graph_with_saved_output(x)
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is not None


def test_shared_counter_counts_a_storage_once_and_skips_excluded_ones():
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)
    with saved_storages(storage_ids([w])) as seen:
        h = x @ w  # saves x and w (w excluded)
        y = torch.sin(h[:2]).sum() + torch.sin(h[2:]).sum()  # sin saves two views of h's one storage
    assert seen == {next(iter(storage_ids([x]))): 4 * 16 * 4, next(iter(storage_ids([h]))): 4 * 16 * 4}
    y.backward()
    assert w.grad is not None and x.grad is not None
