"""Workload adapters: a model as an ordered list of blocks, a synthetic batch, a loss, an optimizer.

The blocks are the pipeline cut points.  A workload also declares what a plan
must respect: BatchNorm (per-rank statistics), and whether its loss couples the
samples of a batch (contrastive losses), in which case plans that change the
objective (plain gradient accumulation, uneven unsynchronised shards) are not offered.
"""

from __future__ import annotations

import torch
from torch import nn

from hetsim.errors import ConfigError, UnknownNameError
from hetsim.workloads.base import (  # noqa: F401 (re-exported)
    BN_MIN_SAMPLES,
    OPTIMIZER_STATE_PER_PARAM,
    OPTIMIZERS,
    PROFILED_OPTIMIZERS,
    Workload,
    make_optimizer,
    min_samples_per_micro_batch,
)
from hetsim.workloads.contrastive import clip, simclr
from hetsim.workloads.ecosystem import TIMM_EMULATED_IMAGE_SIZE, ecosystem_workload
from hetsim.workloads.transformer import BERT_PRESETS, GPT_PRESETS, bert_workload, gpt_workload
from hetsim.workloads.usermodel import load_user
from hetsim.workloads.vit import VIT_PRESETS, vit_workload

# ----------------------------------------------------------------------------- vision


def _image_batch(image_size: int, num_classes: int):
    def make(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 3, image_size, image_size, generator=g)
        y = torch.randint(0, num_classes, (n,), generator=g)
        return x, y

    return make


def _resnet_blocks(net: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks: list[tuple[str, nn.Module]] = [("stem", nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool))]
    for li in range(1, 5):
        layer = getattr(net, f"layer{li}")
        for bi, blk in enumerate(layer):
            blocks.append((f"layer{li}_{bi}", blk))
    blocks.append(("head", nn.Sequential(net.avgpool, nn.Flatten(1), net.fc)))
    return blocks


MIN_IMAGE_SIZE = 32  # five stride-2 stages: below 32 px the last stage sees < 1 pixel


def torchvision_resnet(arch: str, image_size: int, num_classes: int = 1000, groupnorm: bool = False) -> Workload:
    import torchvision

    if image_size < MIN_IMAGE_SIZE:
        raise ConfigError(
            f"--image-size {image_size} is too small for {arch}: it downsamples 32x, "
            f"so use at least {MIN_IMAGE_SIZE}"
        )
    norm = (lambda c: nn.GroupNorm(min(32, c // 4), c)) if groupnorm else None

    def build():
        torch.manual_seed(0)
        kw = {"num_classes": num_classes}
        if norm is not None:
            kw["norm_layer"] = norm
        return _resnet_blocks(getattr(torchvision.models, arch)(**kw))

    return Workload(
        name=arch + ("_gn" if groupnorm else ""),
        build_blocks=build,
        make_batch=_image_batch(image_size, num_classes),
        has_batchnorm=not groupnorm,
        image_size=image_size,
        spec=f"{arch}{'_gn' if groupnorm else ''}@{image_size}",
    )


# ----------------------------------------------------------------------------- small test models


def mlp(width: int = 256, depth: int = 4, in_dim: int = 64, num_classes: int = 10) -> Workload:
    def build():
        torch.manual_seed(0)
        blocks = [("in", nn.Sequential(nn.Linear(in_dim, width), nn.ReLU()))]
        blocks += [(f"hidden{i}", nn.Sequential(nn.Linear(width, width), nn.ReLU())) for i in range(depth - 2)]
        blocks.append(("out", nn.Linear(width, num_classes)))
        return blocks

    def make(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, in_dim, generator=g), torch.randint(0, num_classes, (n,), generator=g)

    return Workload(name="mlp", build_blocks=build, make_batch=make, spec="mlp")


def gn_resnet(image_size: int = 32, width: int = 16, num_classes: int = 10) -> Workload:
    """A tiny GroupNorm ResNet from torchvision's BasicBlock: exact-gradient tests need no BatchNorm."""
    from torchvision.models.resnet import BasicBlock

    def gn(c: int) -> nn.Module:
        return nn.GroupNorm(4, c)

    def build():
        torch.manual_seed(0)
        w = width
        down = nn.Sequential(nn.Conv2d(w, 2 * w, 1, stride=2, bias=False), gn(2 * w))
        return [
            ("stem", nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), gn(w), nn.ReLU())),
            ("block1", BasicBlock(w, w, norm_layer=gn)),
            ("block2", BasicBlock(w, 2 * w, stride=2, downsample=down, norm_layer=gn)),
            ("block3", BasicBlock(2 * w, 2 * w, norm_layer=gn)),
            ("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(2 * w, num_classes))),
        ]

    return Workload(
        name="gn_resnet",
        build_blocks=build,
        make_batch=_image_batch(image_size, num_classes),
        image_size=image_size,
        spec=f"gn_resnet@{image_size}",
    )


BUILTIN = {
    "resnet50": lambda size: torchvision_resnet("resnet50", size),
    "resnet18": lambda size: torchvision_resnet("resnet18", size),
    "resnet18_gn": lambda size: torchvision_resnet("resnet18", size, groupnorm=True),
    "mlp": lambda size: mlp(),
    "gn_resnet": lambda size: gn_resnet(size),
    "gpt": lambda size: gpt_workload(),
    "bert": lambda size: bert_workload(),
    "vit": lambda size: vit_workload(image_size=size or None),
    "simclr": lambda size: simclr(size) if size else simclr(),
    "clip": lambda size: clip(size) if size else clip(),
}
IMAGE_MODELS = {"resnet50", "resnet18", "resnet18_gn", "gn_resnet", "vit", "simclr", "clip"}
SEQUENCE_MODELS = {"gpt", "bert"}
SIZED_MODELS = {"gpt": GPT_PRESETS, "bert": BERT_PRESETS, "vit": VIT_PRESETS}
"""Built-in models with size presets (--model-size)."""
DEFAULT_SIZE = {
    # Emulated clusters: one step of the default batch (32) takes about a second on one core.
    "emulated": {"gpt": "tiny", "bert": "tiny", "vit": "tiny"},
    # GPUs (real or catalog): GPT-2 small, BERT-base, ViT-B/16.
    "gpu": {"gpt": "small", "bert": "base", "vit": "b16"},
}


def default_size(model: str, cluster_source: str) -> tuple[str | None, int | None]:
    """(preset, sequence length) a sized built-in model gets on this kind of cluster; (None, None)
    for other models.  The sequence length is None where the preset's own applies."""
    if model not in SIZED_MODELS:
        return None, None
    kind = "emulated" if cluster_source == "emulated" else "gpu"
    return DEFAULT_SIZE[kind][model], None


def default_image_size(model: str, emulated: bool) -> int | None:
    if model.startswith("timm:"):  # the model's own size on GPUs; `timm:NAME@SIZE` states its own
        return TIMM_EMULATED_IMAGE_SIZE if emulated and "@" not in model else None
    if model not in IMAGE_MODELS:
        return None
    if model == "gn_resnet":
        return 32
    if model == "vit":
        return None  # the preset's own (--model-size)
    if model in CONTRASTIVE_IMAGE_SIZE:  # sized for emulated clusters (hetsim.workloads.contrastive)
        return CONTRASTIVE_IMAGE_SIZE[model]
    if not emulated:
        return 224  # ImageNet's size
    # On emulated (CPU) clusters: small enough that a step of the default batch takes about a
    # second on one core, large enough that compute, not the fixed optimizer step and gradient
    # synchronisation, dominates it (resnet18 at 64 px spends ~40% of a step in the optimizer and gradient synchronisation).
    return EMULATED_IMAGE_SIZE.get(model, 64)


CONTRASTIVE_IMAGE_SIZE = {"simclr": 96, "clip": 32}
EMULATED_IMAGE_SIZE = {"resnet18": 128, "resnet18_gn": 128, "resnet50": 64}


def load_workload(model: str, image_size: int | None = None, optimizer: str | None = None, *,
                  size: str | None = None, seq_len: int | None = None) -> Workload:
    """A built-in name (with `size` preset and `seq_len` for gpt/bert/vit), `hf:NAME`, `timm:NAME`,
    or `module:function` returning a Workload, a UserModel or an nn.Module."""
    if model.startswith(("hf:", "timm:")):
        wl = ecosystem_workload(model, seq_len=seq_len, image_size=image_size)
    elif ":" in model:
        wl = load_user(model)
    elif model in SIZED_MODELS:
        preset = size or DEFAULT_SIZE["emulated"][model]
        wl = vit_workload(preset, image_size) if model == "vit" else SIZED_BUILDERS[model](preset, seq_len)
    else:
        if model not in BUILTIN:
            raise UnknownNameError("model", model, list(BUILTIN), "or pass module:function returning an nn.Module")
        sz = image_size if image_size is not None else (default_image_size(model, True) or 0)
        wl = BUILTIN[model](sz)
    if optimizer is not None:
        make_optimizer(optimizer, [nn.Parameter(torch.zeros(1))], 1e-3)  # validates the name
        wl.optimizer = optimizer
    return wl


SIZED_BUILDERS = {"gpt": gpt_workload, "bert": bert_workload}


def workload_from_spec(spec: str, optimizer: str = "adamw") -> Workload:
    """Rebuild a workload in a worker process from its `spec` string."""
    head, _, rest = spec.partition("@")
    if head in SIZED_MODELS and ":" not in spec:  # gpt@PRESET[@SEQ_LEN], vit@PRESET[@IMAGE_SIZE]
        preset, _, num = rest.partition("@")
        n = int(num) if num else None
        wl = vit_workload(preset, n) if head == "vit" else SIZED_BUILDERS[head](preset, n)
    elif spec.startswith(("hf:", "timm:")):
        wl = ecosystem_workload(spec)
    elif "@" in spec and ":" not in spec:
        name, size = spec.split("@")
        wl = load_workload(name, int(size))
    else:
        wl = load_workload(spec)
    wl.optimizer = optimizer
    return wl
