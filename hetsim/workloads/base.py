"""The workload adapter every model becomes: ordered blocks (the cut points), a batch maker, a loss, an optimizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hetsim.errors import UnknownNameError
from hetsim.names import (  # noqa: F401 (re-exported: the workload names)
    BN_MIN_SAMPLES,
    OPTIMIZER_STATE_PER_PARAM,
    OPTIMIZERS,
    PROFILED_OPTIMIZERS,
    min_samples_per_micro_batch,
)


@dataclass(kw_only=True)
class Workload:
    name: str
    build_blocks: Callable[[], list[tuple[str, nn.Module]]]
    """Fresh blocks, in order, with deterministic initial weights."""
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(n, seed) -> (inputs, targets), deterministic."""
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(
        default=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum")
    )
    """Sum of per-sample losses (the runner divides by the global batch)."""
    optimizer: str = "adamw"
    """'adamw', 'adam' or 'sgd' (with momentum)."""
    lr: float = 1e-3
    has_batchnorm: bool = False
    batch_coupled: bool = False
    """True when the loss couples every sample (InfoNCE): accumulation would change the objective."""
    batch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """Batch-coupled workloads: the mean loss of a whole batch of model outputs (the objective is
    this over the global batch: every rank's outputs gathered).  `loss_sum` is then this times the
    batch size, which is the objective only when it sees the whole global batch."""
    logits_per_sample_sq: int = 0
    """Batch-coupled workloads: the loss builds about this times B**2 logits for a batch of B
    (NT-Xent over 2 views: (2B)**2 = 4 B**2; CLIP: one B x B matrix and its transpose)."""
    image_size: int | None = None
    spec: str = ""
    """How to rebuild this workload in a worker: 'resnet50@64', 'gpt@tiny@64' or 'pkg.mod:fn'."""
    tokens_per_sample: int = 0
    """Tokens in one sample of a sequence model (reports show tokens/s); 0 for other models."""
    about: str = ""
    """One line describing what was built (size, sequence length, parameters), printed before profiling."""
    notes: tuple[str, ...] = ()
    """What a user should know about how the model was split (printed and reported)."""
    params: int = 0
    """Its parameters, where counted when it was made (a user's module); 0: counted by building its
    blocks on the meta device."""

    def model(self) -> nn.Sequential:
        torch.manual_seed(0)
        blocks = self.build_blocks()
        seq = nn.Sequential()
        for name, mod in blocks:
            seq.add_module(name, mod)
        return seq

    def block_names(self) -> list[str]:
        return [n for n, _ in self.build_blocks()]

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer, params, self.lr)

    def full_batch_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The objective of one step given the outputs of the WHOLE global batch: the mean
        per-sample loss, or a batch-coupled workload's `batch_loss`."""
        if self.batch_loss is not None:
            return self.batch_loss(out, y)
        return self.loss_sum(out, y) / out.shape[0]


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    raise UnknownNameError("optimizer", kind, list(OPTIMIZERS))
