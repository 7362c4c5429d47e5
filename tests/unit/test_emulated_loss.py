"""An emulated slow device computes its loss slowly too: forward and backward spin like a block's."""

from __future__ import annotations

import torch
from torch import nn

from hetsim.execution.emulation import Emulator


def _run(emulator: Emulator | None, events: list):
    torch.manual_seed(0)
    block = nn.Linear(8, 50)
    block.register_full_backward_pre_hook(lambda m, g: events.append("block backward"))
    x, y = torch.randn(16, 8), torch.randint(0, 50, (16,))
    out = block(x)

    def fn(o):
        events.append("loss forward")
        return nn.functional.cross_entropy(o, y, reduction="sum")

    loss = fn(out) if emulator is None else emulator.loss(fn, out)
    loss.backward()
    return float(loss.detach()), block.weight.grad.clone()


def test_the_loss_is_throttled_before_the_last_block_sees_its_gradient(monkeypatch):
    em = Emulator(0.5, 1 << 30)
    events: list = []
    monkeypatch.setattr(em, "_sleep_for", lambda dt: events.append(("spin", dt)))
    value, grad = _run(em, events)
    assert [e if isinstance(e, str) else e[0] for e in events] == ["loss forward", "spin", "spin", "block backward"]
    assert all(e[1] >= 0.0 for e in events if isinstance(e, tuple))
    plain_events: list = []
    plain_value, plain_grad = _run(None, plain_events)
    assert value == plain_value and torch.equal(grad, plain_grad)  # the spin changes time only


def test_the_loss_can_be_detached_in_place():
    # Zero-bubble schedules detach the stage's loss in place after its input gradients; a view could not be.
    out = torch.randn(4, 3, requires_grad=True)
    loss = Emulator(0.5, 1 << 30).loss(lambda o: o.square().sum(), out)
    torch.autograd.grad(loss, out, retain_graph=True)
    loss.detach_()
    assert not loss.requires_grad


def test_a_full_speed_device_and_an_output_without_gradient_are_left_alone(monkeypatch):
    events: list = []
    for em, out in ((Emulator(1.0, 1 << 30), torch.randn(4, 3, requires_grad=True)),
                    (Emulator(0.5, 1 << 30), torch.randn(4, 3))):
        monkeypatch.setattr(em, "_sleep_for", lambda dt: events.append(dt))
        loss = em.loss(lambda o: o.sum(), out)
        if out.requires_grad:
            loss.backward()
    assert events == []
