"""Workload adapters: a model as an ordered list of blocks, a synthetic batch, a loss, an optimizer.

The blocks are the pipeline cut points.  A workload also declares what a plan
must respect: BatchNorm (per-rank statistics), and whether its loss couples the
samples of a batch (contrastive losses), in which case plans that change the
objective (plain gradient accumulation, uneven unsynchronised shards) are not offered.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hetsim.errors import ConfigError, UnknownNameError


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
    image_size: int | None = None
    spec: str = ""
    """How to rebuild this workload in a worker: 'resnet50@64' or 'pkg.mod:fn'."""

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


OPTIMIZER_STATE_PER_PARAM = {"adamw": 2, "adam": 2, "sgd": 1}
"""Optimizer state tensors per parameter (exp_avg + exp_avg_sq; momentum buffer)."""
OPTIMIZERS = tuple(OPTIMIZER_STATE_PER_PARAM)
"""The optimizer names a workload accepts."""
PROFILED_OPTIMIZERS = ("adamw", "sgd")
"""The optimizers whose step profiling times (adam steps as adamw does: the cost model falls back to it)."""
BN_MIN_SAMPLES = 2
"""BatchNorm in training mode needs more than one value per channel: every micro-batch of a
BatchNorm model holds at least this many samples (torch raises on one)."""


def min_samples_per_micro_batch(has_batchnorm: bool, min_local: int = 1) -> int:
    """Fewest samples a micro-batch may hold: the user's `--min-local-batch`, and two for BatchNorm."""
    return max(min_local, BN_MIN_SAMPLES if has_batchnorm else 1)


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    raise UnknownNameError("optimizer", kind, list(OPTIMIZERS))


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
    "gpt": lambda size: _gpt(),
}


def _gpt() -> Workload:
    from hetsim.workloads.transformer import gpt_workload  # transformer.py builds on Workload above

    return gpt_workload()
IMAGE_MODELS = {"resnet50", "resnet18", "resnet18_gn", "gn_resnet"}


def default_image_size(model: str, emulated: bool) -> int | None:
    if model not in IMAGE_MODELS:
        return None
    if model == "gn_resnet":
        return 32
    if not emulated:
        return 224  # ImageNet's size
    # On emulated (CPU) clusters: small enough that a step of the default batch takes about a
    # second on one core, large enough that compute, not the fixed optimizer step and gradient
    # synchronisation, dominates it (resnet18 at 64 px spends ~40% of a step in the optimizer and gradient synchronisation).
    return EMULATED_IMAGE_SIZE.get(model, 64)


EMULATED_IMAGE_SIZE = {"resnet18": 128, "resnet18_gn": 128, "resnet50": 64}


def load_workload(model: str, image_size: int | None = None, optimizer: str | None = None) -> Workload:
    """A built-in name, or `module:function` returning a Workload."""
    if ":" in model:
        wl = _load_user(model)
    else:
        if model not in BUILTIN:
            raise UnknownNameError("model", model, list(BUILTIN), "or pass module:function returning a hetsim Workload")
        size = image_size if image_size is not None else (default_image_size(model, True) or 0)
        wl = BUILTIN[model](size)
    if optimizer is not None:
        make_optimizer(optimizer, [nn.Parameter(torch.zeros(1))], 1e-3)  # validates the name
        wl.optimizer = optimizer
    return wl


def _load_user(spec: str) -> Workload:
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ConfigError(f"--model {spec!r}: write module:function, e.g. mypkg.models:my_workload")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"--model {spec!r}: module {mod_name!r} cannot be imported ({e}); check PYTHONPATH") from None
    except Exception as e:  # the module itself fails while importing (syntax error, its own exception)
        raise ConfigError(
            f"--model {spec!r}: importing module {mod_name!r} raised {type(e).__name__}: {e}; fix the module"
        ) from None
    fn = getattr(mod, fn_name, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"--model {spec!r}: module {mod_name!r} has no callable {fn_name!r}")
    try:
        wl = fn()
    except Exception as e:  # user code: report what it raised
        raise ConfigError(f"--model {spec!r}: {fn_name}() raised {type(e).__name__}: {e}") from None
    if not isinstance(wl, Workload):
        raise ConfigError(
            f"--model {spec!r}: {fn_name}() returned {type(wl).__name__}, expected hetsim.workloads.builtin.Workload"
        )
    wl.spec = spec
    return wl


def workload_from_spec(spec: str, optimizer: str = "adamw") -> Workload:
    """Rebuild a workload in a worker process from its `spec` string."""
    if spec.startswith("gpt@"):  # gpt@PRESET[@SEQ_LEN]
        from hetsim.workloads.transformer import gpt_workload

        preset, _, seq = spec[4:].partition("@")
        wl = gpt_workload(preset, int(seq) if seq else None)
    elif "@" in spec and ":" not in spec:
        name, size = spec.split("@")
        wl = load_workload(name, int(size))
    else:
        wl = load_workload(spec)
    wl.optimizer = optimizer
    return wl
