"""Each rank's uneven share of every global batch: a deterministic sampler for a found plan.

An epoch is one permutation of the dataset (seeded by `seed + epoch`), cut into global batches of
`sum(shares)` samples; rank r takes the slice of each global batch that its share gives it, so
every sample is seen exactly once per epoch by exactly one rank.  The last global batch of an
epoch may be short: its samples are split in proportion to the shares (largest remainders), so
nothing is dropped.  The shares may change between steps (rebalancing); the permutation does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def proportional_split(total: int, shares: tuple[int, ...]) -> tuple[int, ...]:
    """`total` samples in proportion to `shares` (largest remainders; ties to the lower rank)."""
    whole = sum(shares)
    if total >= whole:
        return tuple(shares)
    exact = [total * s / whole for s in shares]
    out = [int(e) for e in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return tuple(out)


@dataclass
class PlanSampler:
    """Indices of this rank's samples, one global batch at a time; position kept for resume."""

    n_samples: int
    shares: tuple[int, ...]
    """Samples per global batch on each rank (the plan's local batches)."""
    rank: int
    seed: int = 0
    epoch: int = 0
    offset: int = 0
    """Samples of this epoch's permutation already handed out (all ranks together)."""
    drop_last: bool = False
    """Skip an epoch's last, short global batch (pipelines: their micro-batches need a fixed size)."""

    def __post_init__(self) -> None:
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1

    @property
    def global_batch(self) -> int:
        return sum(self.shares)

    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.n_samples // self.global_batch
        return -(-self.n_samples // self.global_batch)

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = torch.randperm(self.n_samples, generator=g)
            self._perm_epoch = self.epoch
        return self._perm  # type: ignore[return-value]

    def next_batch(self) -> tuple[list[int], int]:
        """(this rank's indices, the size of this global batch); advances by one global batch."""
        if self.offset >= self.n_samples or (self.drop_last and self.n_samples - self.offset < self.global_batch):
            self.epoch += 1
            self.offset = 0
        perm = self._permutation()
        size = min(self.global_batch, self.n_samples - self.offset)
        split = proportional_split(size, self.shares)
        lo = self.offset + sum(split[: self.rank])
        mine = perm[lo : lo + split[self.rank]].tolist()
        self.offset += size
        return mine, size

    def state(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "shares": list(self.shares), "seed": self.seed}

    def load_state(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.shares = tuple(int(s) for s in state["shares"])
