"""Checkpoints of a training run with `torch.distributed.checkpoint`: atomic, resumable, tied to
their plan.

Each checkpoint is a folder `step-NNNNNNNN/` written by every rank through DCP (model and
optimizer state dicts from `get_state_dict`, so DDP, FSDP2 and pipeline stages all work), plus
`meta.json` (the step, the sampler's position, the plan's fingerprint, the loss so far).  It is
written as `step-NNNNNNNN.tmp/` and renamed when every rank has finished, and `latest` names the
newest complete one, so a run killed mid-write (even with SIGKILL) resumes from the one before.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hetsim.errors import ConfigError


def plan_fingerprint(plan: dict, workload: str) -> str:
    """What a checkpoint must match to be resumed: the plan (minus its shares, which rebalancing
    changes) and the workload."""
    stable = {k: v for k, v in plan.items() if k not in ("local_batch",)}
    text = json.dumps({"plan": stable, "workload": workload}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def latest(root: Path) -> Path | None:
    f = root / "latest"
    if not f.is_file():
        return None
    path = root / f.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def check_resumable(root: Path, fingerprint: str) -> dict | None:
    """The newest checkpoint's meta, None when there is none; another plan's checkpoint is an error
    (nothing is overwritten)."""
    path = latest(root)
    if path is None:
        return None
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("fingerprint") != fingerprint:
        raise ConfigError(f"--checkpoint-dir {str(root)!r} holds a checkpoint of another plan or model "
                          f"({meta.get('label', '?')}); pass another --checkpoint-dir or the plan it was made with")
    return meta


def save(root: Path, step: int, model: nn.Module, opt, meta: dict) -> Path:
    """Write checkpoint `step` (collective: every rank calls it)."""
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        nxt = root / "latest.tmp"
        nxt.write_text(final.name)
        os.replace(nxt, root / "latest")
    dist.barrier()
    return final


def load(path: Path, model: nn.Module, opt) -> None:
    """Load checkpoint `path` into model and optimizer (collective)."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
