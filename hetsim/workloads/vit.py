"""The built-in `vit` workload: torchvision's VisionTransformer, split into pipeline blocks.

Blocks: `embed` (patch projection, class token, position embedding), `layer0..N-1` (torchvision's
encoder blocks, unchanged), `head` (final LayerNorm, the class token's features, the classifier).
Presets keep torchvision's architecture (vit_b_16 is `b16`); the small ones fit emulated clusters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hetsim.errors import ConfigError, UnknownNameError
from hetsim.workloads.base import Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class ViTConfig:
    """Arguments of torchvision.models.VisionTransformer."""

    image_size: int
    patch_size: int
    num_layers: int
    num_heads: int
    hidden_dim: int
    mlp_dim: int
    num_classes: int = 1000


VIT_PRESETS: dict[str, ViTConfig] = {
    # 32 px in 4 px patches: 64 patches + the class token, a sequence like gpt tiny's.
    "tiny": ViTConfig(image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512,
                      num_classes=10),
    "mini": ViTConfig(image_size=64, patch_size=8, num_layers=6, num_heads=8, hidden_dim=256, mlp_dim=1024,
                      num_classes=100),
    "b16": ViTConfig(image_size=224, patch_size=16, num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072),
    "l16": ViTConfig(image_size=224, patch_size=16, num_layers=24, num_heads=16, hidden_dim=1024, mlp_dim=4096),
}


class PatchEmbed(nn.Module):
    """torchvision's input processing as a block: (n, 3, H, W) -> (n, 1 + patches, hidden) with the
    class token prepended and the position embedding added (the parameters are the model's own)."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.conv_proj = vit.conv_proj
        self.class_token = vit.class_token
        self.pos_embedding = vit.encoder.pos_embedding
        self.dropout = vit.encoder.dropout
        self.hidden_dim = vit.hidden_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class ClassHead(nn.Module):
    """Final LayerNorm, the class token's features, the classifier."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.ln = vit.encoder.ln
        self.heads = vit.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads(self.ln(x)[:, 0])


def vit_blocks(cfg: ViTConfig) -> list[tuple[str, nn.Module]]:
    from torchvision.models import VisionTransformer

    vit = VisionTransformer(image_size=cfg.image_size, patch_size=cfg.patch_size, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, hidden_dim=cfg.hidden_dim, mlp_dim=cfg.mlp_dim,
                            num_classes=cfg.num_classes)
    layers = list(vit.encoder.layers.children())
    return [("embed", PatchEmbed(vit))] + [(f"layer{i}", b) for i, b in enumerate(layers)] + [("head", ClassHead(vit))]


def vit_workload(preset: str = "tiny", image_size: int | None = None) -> Workload:
    """`vit@PRESET@IMAGE_SIZE`: synthetic images and labels, cross-entropy."""
    if preset not in VIT_PRESETS:
        raise UnknownNameError("--model-size for vit", preset, list(VIT_PRESETS))
    cfg = VIT_PRESETS[preset]
    if image_size is not None:
        if image_size % cfg.patch_size:
            raise ConfigError(f"--image-size {image_size} is not a multiple of vit {preset}'s patch size "
                              f"{cfg.patch_size}; use e.g. {max(1, image_size // cfg.patch_size) * cfg.patch_size}")
        cfg = ViTConfig(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "image_size": image_size})

    def build() -> list[tuple[str, nn.Module]]:
        torch.manual_seed(0)
        return vit_blocks(cfg)

    def make(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 3, cfg.image_size, cfg.image_size, generator=g)
        return x, torch.randint(0, cfg.num_classes, (n,), generator=g)

    patches = (cfg.image_size // cfg.patch_size) ** 2
    with torch.device("meta"):  # counted without allocating weights
        params = sum(p.numel() for _, b in vit_blocks(cfg) for p in b.parameters())
    return Workload(name="vit", build_blocks=build, make_batch=make, image_size=cfg.image_size,
                    spec=f"vit@{preset}@{cfg.image_size}",
                    about=f"vit {preset}: {params / 1e6:.1f}M parameters, {cfg.num_layers} layers, hidden "
                          f"{cfg.hidden_dim}, {cfg.image_size} px in {patches} patches of {cfg.patch_size} px")
