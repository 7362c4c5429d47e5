"""Models by name from the ecosystem, built with no weights and no hub access: `hf:NAME` (Hugging Face
transformers, `hetsim.workloads.hf`) and `timm:NAME[@SIZE]`, which goes through
`timm.create_model(NAME, pretrained=False)` and the cut-point finder, at SIZE px (`--image-size`; 64 by
default on emulated clusters) or the model's own.  Both are optional extras: `pip install -e ".[hf]"`
or `".[timm]"`.
"""

from __future__ import annotations

import difflib

import torch
from torch import nn

from hetsim.errors import ConfigError
from hetsim.workloads.base import Workload
from hetsim.workloads.cutpoints import split_module
from hetsim.workloads.hf import hf_workload, require_extra

TIMM_EMULATED_IMAGE_SIZE = 64
"""A `timm:` image model's default input side on emulated (CPU) clusters: a step of the default batch
(32) of timm's ViT-S/16, ResNet-50 or ConvNeXt-T takes about a second on one core there (0.9, 1.0 and
1.2 s measured), as the built-in models' defaults do.  GPU clusters keep the model's own size."""


def parse_timm(spec: str) -> tuple[str, int | None]:
    """`timm:NAME[@SIZE]` -> (NAME, SIZE or None for the model's own input size)."""
    name, at, size = spec[5:].partition("@")
    if at and not (size.isdigit() and int(size) > 0):
        raise ConfigError(f"--model {spec!r}: {size!r} after '@' is not an image size in pixels; write "
                          f"timm:{name}@64 or pass --image-size 64")
    return name, int(size) if at else None


def timm_workload(spec: str, image_size: int | None = None) -> Workload:
    """`timm:NAME[@SIZE]`; `image_size` (--image-size) overrides SIZE.  Models that take an input size
    (ViT, Swin ...) are built for it (`img_size=`); the others (convolutional) just take the input."""
    timm = require_extra("timm", "timm", spec)
    name, at = parse_timm(spec)
    size = image_size or at
    if not name or name not in timm.list_models():
        near = difflib.get_close_matches(name, timm.list_models(), n=6, cutoff=0.7) if name else []
        raise ConfigError(f"--model {spec!r}: timm has no model {name!r}"
                          + (f"; similar: {', '.join(near)}" if near else "; see timm.list_models()"))

    def create() -> nn.Module:
        torch.manual_seed(0)
        if size is not None:
            try:
                return timm.create_model(name, pretrained=False, img_size=size)
            except TypeError:  # no img_size argument: a convolutional model takes any size
                pass
        return timm.create_model(name, pretrained=False)

    first = create()
    _, own, _ = first.pretrained_cfg.get("input_size", (3, 224, 224))
    side = size or own
    classes = first.num_classes

    def make(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 3, side, side, generator=g), torch.randint(0, classes, (n,), generator=g)

    x, _ = make(2, 0)
    try:
        with torch.no_grad():
            first.eval()(x)
    except Exception as e:
        raise ConfigError(f"--model {spec!r}: timm's {name} does not run on a {side}x{side} input "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); set --image-size {own} "
                          f"(its own size) or another size it accepts") from None
    first.train()
    canonical = f"timm:{name}@{side}"
    split = split_module(first, x, canonical)
    params = sum(p.numel() for p in first.parameters())
    return Workload(name=f"timm-{name}", build_blocks=lambda: list(split_module(create(), x, canonical).blocks),
                    make_batch=make, image_size=side, spec=canonical, notes=split.notes,
                    has_batchnorm=any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in first.modules()),
                    about=f"{canonical}: timm {type(first).__name__} (no weights), {params / 1e6:.1f}M parameters, "
                          f"{len(split.blocks)} blocks, {side}x{side} px"
                          + ("" if side == own else f" (its own size: {own} px)"))


def ecosystem_workload(spec: str, seq_len: int | None = None, image_size: int | None = None) -> Workload:
    if spec.startswith("hf:"):
        return hf_workload(spec, seq_len)
    return timm_workload(spec, image_size)
