"""Transformer workloads: a GPT-2 style decoder and a BERT-style encoder with a masked-LM head.

The model is an ordered list of blocks, the pipeline cut points: `embed` (token + position
embeddings), `layer0..layerN-1` (pre-norm transformer blocks: causal self-attention and an MLP),
`head` (final LayerNorm and the LM head).  BERT is the same chain with bidirectional attention
(`causal=False`), trained on masked positions only.  Module names inside a block are the ones tensor
parallelism shards (Megatron's split): `attn.qkv` and `mlp.fc` column-wise, `attn.proj` and
`mlp.proj` row-wise; `attn.n_head` heads of `d_model // n_head` units each.

The built-in `gpt` does not tie the LM head to the token embedding, so that any contiguous range
of blocks is a valid pipeline stage; GPT-2 itself ties them (a user's own model with tied weights
goes through the cut-point finder, which keeps tied parameters on one stage).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from hetsim.errors import ConfigError, UnknownNameError
from hetsim.workloads.base import Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Sizes of a GPT-style model."""

    vocab_size: int = 50304
    """GPT-2's 50257 tokens, padded up to a multiple of 64."""
    seq_len: int = 1024
    """Tokens per sample (and the number of learned positions)."""
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    mlp_ratio: int = 4
    """MLP hidden units per model unit."""
    causal: bool = True
    """False for an encoder (BERT)."""


GPT_PRESETS: dict[str, GPTConfig] = {
    # Small enough that one step of the emulated default batch takes about a second on one core.
    "tiny": GPTConfig(vocab_size=2048, seq_len=64, d_model=128, n_layer=4, n_head=4),
    "mini": GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_layer=6, n_head=8),
    "small": GPTConfig(),  # GPT-2 small: 124M parameters (with a tied head)
    "medium": GPTConfig(d_model=1024, n_layer=24, n_head=16),
    "large": GPTConfig(d_model=1280, n_layer=36, n_head=20),
    "xl": GPTConfig(d_model=1600, n_layer=48, n_head=25),
}


class SelfAttention(nn.Module):
    """Multi-head self-attention; `qkv` and `proj` are the layers tensor parallelism splits."""

    def __init__(self, d_model: int, n_head: int, causal: bool = True):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not a multiple of n_head {n_head}")
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        # The local head count follows the (possibly sharded) qkv output: 3 * heads * head_dim.
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg.d_model, cfg.n_head, cfg.causal)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio * cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token + learned position embeddings: (batch, seq) token ids -> (batch, seq, d_model)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class LMHead(nn.Module):
    """Final LayerNorm and the projection to the vocabulary: (batch, seq, d) -> logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt_blocks(cfg: GPTConfig) -> list[tuple[str, nn.Module]]:
    """Fresh blocks in order, deterministic for a seed set by the caller."""
    return [("embed", Embedding(cfg))] + [(f"layer{i}", Block(cfg)) for i in range(cfg.n_layer)] + [
        ("head", LMHead(cfg))
    ]


def token_batch(cfg: GPTConfig):
    """(n, seed) -> (tokens, next tokens): synthetic, deterministic for the seed."""

    def make(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        seq = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return make


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over samples of each sample's mean next-token cross-entropy (the runner divides by
    the global batch, so the step optimises the usual token-mean LM loss)."""
    per_token = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return per_token.view(targets.shape).mean(dim=1).sum()


def param_count(cfg: GPTConfig) -> int:
    """Parameters of `gpt_blocks(cfg)` (untied head), without building the model."""
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    return cfg.vocab_size * d + cfg.seq_len * d + cfg.n_layer * block + 2 * d + d * cfg.vocab_size


def gpt_workload(preset: str = "tiny", seq_len: int | None = None) -> Workload:
    """The built-in `gpt` workload: a GPT preset on synthetic token batches (spec `gpt@PRESET@SEQ_LEN`)."""
    cfg = sized(GPT_PRESETS, "gpt", preset, seq_len)

    def build() -> list[tuple[str, nn.Module]]:
        torch.manual_seed(0)
        return gpt_blocks(cfg)

    return Workload(name="gpt", build_blocks=build, make_batch=token_batch(cfg), loss_sum=lm_loss_sum,
                    spec=f"gpt@{preset}@{cfg.seq_len}", tokens_per_sample=cfg.seq_len,
                    about=describe("gpt", preset, cfg, param_count(cfg)))


def sized(presets: dict[str, GPTConfig], model: str, preset: str, seq_len: int | None) -> GPTConfig:
    """A preset, with its sequence length replaced; unknown names and bad lengths fail with the rule."""
    if preset not in presets:
        raise UnknownNameError(f"--model-size for {model}", preset, list(presets))
    cfg = presets[preset]
    if seq_len is not None:
        if seq_len < 2:
            raise ConfigError(f"--seq-len {seq_len} is too short for {model}: use at least 2 tokens")
        cfg = dataclasses.replace(cfg, seq_len=seq_len)
    return cfg


def describe(model: str, preset: str, cfg: GPTConfig, params: int) -> str:
    return (f"{model} {preset}: {params / 1e6:.1f}M parameters, {cfg.n_layer} layers, d_model {cfg.d_model}, "
            f"{cfg.n_head} heads, vocabulary {cfg.vocab_size}, {cfg.seq_len} tokens per sample")


# ----------------------------------------------------------------------------- BERT (masked LM)

BERT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=2048, seq_len=64, d_model=128, n_layer=4, n_head=4, causal=False),
    "mini": GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_layer=6, n_head=8, causal=False),
    # BERT-base: 30522 tokens padded up to a multiple of 64, 512 positions.
    "base": GPTConfig(vocab_size=30528, seq_len=512, d_model=768, n_layer=12, n_head=12, causal=False),
    "large": GPTConfig(vocab_size=30528, seq_len=512, d_model=1024, n_layer=24, n_head=16, causal=False),
}
MASK_FRACTION = 0.15
"""BERT's masking rate; every sample masks at least one position, so its loss is defined."""
IGNORE = -100
"""Target of an unmasked position (cross_entropy's ignore_index)."""


def masked_batch(cfg: GPTConfig):
    """(n, seed) -> (tokens with masked positions set to the [MASK] id, targets at masked positions,
    IGNORE elsewhere): synthetic, deterministic for the seed."""
    mask_id = cfg.vocab_size - 1

    def make(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab_size - 1, (n, cfg.seq_len), generator=g)
        masked = torch.rand(n, cfg.seq_len, generator=g) < MASK_FRACTION
        masked[torch.arange(n), torch.randint(0, cfg.seq_len, (n,), generator=g)] = True
        return tokens.masked_fill(masked, mask_id), tokens.masked_fill(~masked, IGNORE)

    return make


def mlm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over samples of each sample's mean cross-entropy over its masked positions only."""
    per_token = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none",
                                ignore_index=IGNORE).view(targets.shape)
    counts = (targets != IGNORE).sum(dim=1).clamp(min=1)
    return (per_token.sum(dim=1) / counts).sum()


def bert_workload(preset: str = "tiny", seq_len: int | None = None) -> Workload:
    """The built-in `bert` workload: an encoder (bidirectional blocks) with a masked-LM head."""
    cfg = sized(BERT_PRESETS, "bert", preset, seq_len)

    def build() -> list[tuple[str, nn.Module]]:
        torch.manual_seed(0)
        return gpt_blocks(cfg)

    return Workload(name="bert", build_blocks=build, make_batch=masked_batch(cfg), loss_sum=mlm_loss_sum,
                    spec=f"bert@{preset}@{cfg.seq_len}", tokens_per_sample=cfg.seq_len,
                    about=describe("bert", preset, cfg, param_count(cfg)))
