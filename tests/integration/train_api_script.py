"""Run under torchrun by test_train.py: one step of `hetsim.search.train.prepare` on a plan, gradients
written to OUT/grads{rank}.pt (full tensors, by parameter name)."""

import sys

import torch
import torch.distributed as dist
from hetsim.search.train import prepare
from hetsim.search.train.data import synthetic_dataset

from hetsim.workloads import load_workload

plan_path, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
wl = load_workload("mlp")
ds = synthetic_dataset(wl, 32)
run = prepare(plan_path, wl.model(), lambda ps: torch.optim.SGD(ps, lr=0.0), ds)
for x, y in run.batches(steps=1):
    for xm, ym in run.micro_batches(x, y):
        run.backward(wl.loss_sum(run.model(xm), ym))
grads = {}
for name, p in run.model.named_parameters():
    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    grads[name.removeprefix("module.")] = g.detach().clone()
torch.save(grads, f"{out}/grads{dist.get_rank()}.pt")
dist.barrier()
dist.destroy_process_group()
