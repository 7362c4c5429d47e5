"""Contrastive workloads (`simclr`, `clip`): InfoNCE losses that couple every sample of the batch.

Both are ordered lists of single-tensor blocks, like every hetsim workload, so that profiling,
pipelines and the memory model treat them as any other model; each block's output is one tensor:

- `simclr`: a GroupNorm ResNet encoder and a projection head over two augmented views of each
  synthetic image.  The input is (n, 2, 3, S, S); the stem folds the views into the batch
  (2n images), the head unfolds them: the model's output is (n, 2, d), view embeddings side by
  side.  The loss is NT-Xent (Chen et al., 2020): InfoNCE with temperature over the 2n views,
  each view's positive its sibling, every other view of the batch a negative.
- `clip`: an image tower (GroupNorm ResNet) and a small causal text transformer (the GPT blocks
  of hetsim.workloads.transformer), symmetric InfoNCE over image-text pairs (Radford et al.,
  2021).  The two towers run one after the other: the input packs each image with its tokens
  (as floats, exact below 2**24) and every block carries the other tower's tensor along unchanged
  (`_Carry`), so that the model stays a chain of one-tensor blocks; the output is (n, 2, d):
  image and text embeddings.  The temperature is fixed (CLIP learns it).

GroupNorm, not BatchNorm: the gradient of a data-parallel run then equals the single-process
full-batch gradient (BatchNorm keeps per-rank statistics), which the contract suite checks.

The objective is `Workload.batch_loss`: the mean InfoNCE of whatever batch of embeddings it is
given, which must be the whole global batch (hetsim.strategies gathers every rank's embeddings).
`loss_sum` is that mean times the batch size, so a runner that divides by the global batch gets
the objective back when the whole batch is present (one process, or one pipeline micro-batch).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hetsim.workloads.base import Workload
from hetsim.workloads.transformer import Block, Embedding, GPTConfig

TEMPERATURE = 0.2
"""InfoNCE temperature (SimCLR used 0.1-1.0, 0.5 on CIFAR; CLIP starts at 0.07 and learns it)."""


def _gn(c: int) -> nn.Module:
    return nn.GroupNorm(4, c)


def _encoder_blocks(width: int, depth: int) -> list[tuple[str, nn.Module]]:
    """A GroupNorm ResNet body: stem, then `depth` BasicBlocks doubling the width every second one."""
    from torchvision.models.resnet import BasicBlock

    blocks: list[tuple[str, nn.Module]] = [
        ("stem", nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), _gn(width), nn.ReLU()))
    ]
    w = width
    for i in range(depth):
        if i % 2 == 1:
            down = nn.Sequential(nn.Conv2d(w, 2 * w, 1, stride=2, bias=False), _gn(2 * w))
            blocks.append((f"block{i + 1}", BasicBlock(w, 2 * w, stride=2, downsample=down, norm_layer=_gn)))
            w *= 2
        else:
            blocks.append((f"block{i + 1}", BasicBlock(w, w, norm_layer=_gn)))
    return blocks


def encoder_width(width: int, depth: int) -> int:
    """Channels at the end of `_encoder_blocks(width, depth)`."""
    return width * 2 ** (depth // 2)


# ----------------------------------------------------------------------------- losses


def nt_xent(out: torch.Tensor, y: torch.Tensor | None = None, temperature: float = TEMPERATURE) -> torch.Tensor:
    """Mean NT-Xent over the 2n views of out (n, 2, d): view 2i's positive is view 2i+1."""
    z = F.normalize(out.float().reshape(-1, out.shape[-1]), dim=1)
    logits = z @ z.T / temperature
    self_mask = torch.eye(len(z), dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_mask, float("-inf"))
    target = torch.arange(len(z), device=z.device) ^ 1  # the sibling view
    return F.cross_entropy(logits, target)


def clip_loss(out: torch.Tensor, y: torch.Tensor | None = None, temperature: float = TEMPERATURE) -> torch.Tensor:
    """Symmetric InfoNCE of out (n, 2, d): image i's positive is text i, and text i's image i."""
    img = F.normalize(out[:, 0].float(), dim=1)
    txt = F.normalize(out[:, 1].float(), dim=1)
    logits = img @ txt.T / temperature
    target = torch.arange(len(img), device=img.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def _sum_of(mean_loss):
    """The batch's mean loss times its size (what a runner dividing by the global batch expects)."""

    def loss_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mean_loss(out, y) * out.shape[0]

    return loss_sum


# ----------------------------------------------------------------------------- simclr


class _FoldViews(nn.Module):
    """(n, 2, C, H, W) -> (2n, C, H, W), then the stem."""

    def __init__(self, stem: nn.Module):
        super().__init__()
        self.stem = stem

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x.flatten(0, 1))


class _ProjectionHead(nn.Module):
    """Pool, then SimCLR's projection MLP; (2n, d) -> (n, 2, d)."""

    def __init__(self, c: int, hidden: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(c, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.adaptive_avg_pool2d(x, 1).flatten(1)
        z = self.fc2(F.relu(self.fc1(h)))
        return z.reshape(-1, 2, z.shape[-1])


def augmented_views(image_size: int):
    """(n, seed) -> ((n, 2, 3, S, S) two views per image, sample ids): synthetic images with
    low-frequency structure, each view a random crop, a random horizontal flip and noise, all
    drawn from the seed (deterministic)."""
    pad = image_size // 4

    def make(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        big = image_size + pad
        coarse = torch.randn(n, 3, big // 4, big // 4, generator=g)
        base = F.interpolate(coarse, size=(big, big), mode="bilinear", align_corners=False)
        views = torch.empty(n, 2, 3, image_size, image_size)
        offsets = torch.randint(0, pad + 1, (n, 2, 2), generator=g)
        flips = torch.rand(n, 2, generator=g) < 0.5
        for i in range(n):
            for v in range(2):
                r, c = offsets[i, v].tolist()
                crop = base[i, :, r:r + image_size, c:c + image_size]
                views[i, v] = crop.flip(-1) if flips[i, v] else crop
        views += 0.1 * torch.randn(views.shape, generator=g)
        return views, torch.arange(n)

    return make


def simclr(image_size: int = 96, width: int = 8, depth: int = 2, proj_dim: int = 64) -> Workload:
    """SimCLR on synthetic images.  Sized for emulated clusters: a step of the default batch (32
    images, 64 views) takes about a second on one core, and its activations are large for its
    compute (8 channels at full resolution: about 5 MiB saved per sample, 27 ms of forward and
    backward), so that a large batch is what fills a small device: 128 samples (256 views) need
    more than 0.5 GiB, which is what `--global-batch 256 --cluster emu:1.0@1G,0.5@0.5G` shows.
    Shallower nets save more activation bytes per FLOP (measured here: depth 2 at 0.18 MiB per
    ms of compute, depth 4 at 0.12)."""

    def build() -> list[tuple[str, nn.Module]]:
        torch.manual_seed(0)
        blocks = _encoder_blocks(width, depth)
        blocks[0] = ("stem", _FoldViews(blocks[0][1]))
        c = encoder_width(width, depth)
        return blocks + [("head", _ProjectionHead(c, c, proj_dim))]

    return Workload(name="simclr", build_blocks=build, make_batch=augmented_views(image_size),
                    loss_sum=_sum_of(nt_xent), batch_loss=nt_xent, batch_coupled=True, image_size=image_size,
                    logits_per_sample_sq=4, spec=f"simclr@{image_size}")


# ----------------------------------------------------------------------------- clip


class _Carry(nn.Module):
    """Runs `inner` on the leading part of a packed (n, F) tensor, of per-sample shape `shape`,
    and carries the trailing `carry` columns along: output (n, inner's size + carry)."""

    def __init__(self, inner: nn.Module, shape: tuple[int, ...], carry: int):
        super().__init__()
        self.inner = inner
        self.shape = tuple(shape)
        self.carry = carry

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main = x[:, : x.shape[1] - self.carry].unflatten(1, self.shape)
        out = self.inner(main)
        carried = x[:, x.shape[1] - self.carry:]
        # Never narrow the carried columns (token ids in bf16 would lose their integer values).
        dtype = torch.promote_types(out.dtype, carried.dtype)
        return torch.cat([out.flatten(1).to(dtype), carried.to(dtype)], dim=1)


class _ImageHead(nn.Module):
    def __init__(self, c: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(c, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.adaptive_avg_pool2d(x, 1).flatten(1))


class _TextEmbed(nn.Module):
    """(n, d + T) image embedding and token ids -> (n, T * d_text + d): token + position
    embeddings, image embedding carried at the end."""

    def __init__(self, cfg: GPTConfig, dim: int):
        super().__init__()
        self.embed = Embedding(cfg)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        img, tok = x[:, : self.dim], x[:, self.dim:]
        h = self.embed(tok.detach().round().long().clamp(0, self.embed.tok.num_embeddings - 1))
        return torch.cat([h.flatten(1), img.to(h.dtype)], dim=1)


class _TextHead(nn.Module):
    """Final LayerNorm, the last token's features (CLIP pools at the end-of-text token) projected
    to the joint space; output (n, 2, d): [image, text]."""

    def __init__(self, cfg: GPTConfig, dim: int):
        super().__init__()
        self.seq, self.d_model, self.dim = cfg.seq_len, cfg.d_model, dim
        self.ln = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x[:, : self.seq * self.d_model].unflatten(1, (self.seq, self.d_model))
        txt = self.proj(self.ln(h[:, -1]))
        img = x[:, self.seq * self.d_model:]
        return torch.stack([img.float(), txt.float()], dim=1)


def image_text_pairs(image_size: int, cfg: GPTConfig):
    """(n, seed) -> ((n, 3*S*S + T) images with their token ids packed, sample ids): synthetic,
    deterministic; each caption's tokens depend on its image (so the pairs carry signal)."""

    def make(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        img = torch.randn(n, 3, image_size, image_size, generator=g)
        topic = (img.mean(dim=(1, 2, 3)) * 1000).long().abs() % cfg.vocab_size
        tok = (torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=g) + topic[:, None]) % cfg.vocab_size
        return torch.cat([img.flatten(1), tok.float()], dim=1), torch.arange(n)

    return make


CLIP_TEXT = GPTConfig(vocab_size=1024, seq_len=32, d_model=128, n_layer=2, n_head=4)
"""The text tower: 2 causal transformer blocks of 128 units over 32 tokens."""


def clip(image_size: int = 32, width: int = 16, depth: int = 4, dim: int = 64,
         text: GPTConfig = CLIP_TEXT) -> Workload:
    """CLIP on synthetic image-text pairs, sized so that a step of the default batch (32 pairs)
    takes about a second on one core."""
    T = text.seq_len

    def build() -> list[tuple[str, nn.Module]]:
        torch.manual_seed(0)
        enc = _encoder_blocks(width, depth)
        blocks: list[tuple[str, nn.Module]] = []
        shape, side, c = (3, image_size, image_size), image_size, 3
        for name, mod in enc:
            blocks.append((f"img_{name}", _Carry(mod, shape, T)))
            stride = 2 if name != "stem" and mod.downsample is not None else 1
            side //= stride
            c = mod[0].out_channels if name == "stem" else mod.conv2.out_channels
            shape = (c, side, side)
        blocks.append(("img_head", _Carry(_ImageHead(c, dim), shape, T)))
        blocks.append(("txt_embed", _TextEmbed(text, dim)))
        blocks += [(f"txt_layer{i}", _Carry(Block(text), (T, text.d_model), dim)) for i in range(text.n_layer)]
        return blocks + [("txt_head", _TextHead(text, dim))]

    return Workload(name="clip", build_blocks=build, make_batch=image_text_pairs(image_size, text),
                    loss_sum=_sum_of(clip_loss), batch_loss=clip_loss, batch_coupled=True, image_size=image_size,
                    logits_per_sample_sq=2, spec=f"clip@{image_size}")


__all__ = ["CLIP_TEXT", "TEMPERATURE", "augmented_views", "clip", "clip_loss", "image_text_pairs", "nt_xent", "simclr"]
