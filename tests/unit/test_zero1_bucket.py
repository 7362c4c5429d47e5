"""ZeRO-1 (`hetsim.strategies.zero.zero1_optimizer`): each owner broadcasts its parameters as one bucket,
and a step updates the parameters as the plain optimizer does (frozen ones untouched)."""

import pytest
import torch
import torch.distributed as dist
from hetsim.strategies.zero import zero1_optimizer


@pytest.fixture
def one_rank(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    m[2].requires_grad_(False)
    return m


def test_parameters_are_one_bucket_and_the_step_is_the_optimizers(one_rank):
    model, ref = _model(), _model()
    opt = zero1_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    assert opt.parameters_as_bucket_view
    plain = torch.optim.AdamW(ref.parameters(), lr=0.1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for m in (model, ref):
        m(x).square().sum().backward()
    opt.step()
    plain.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    assert not torch.equal(model[0].weight, _model()[0].weight)  # the step moved what trains
