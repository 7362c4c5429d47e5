"""Models by name from the ecosystem, built from their configuration with no weights and no hub access.

`hf:NAME[?key=value&...]` builds a Hugging Face transformers model from an offline default
configuration of its type (`GPT2Config()`, `BertConfig()`, `LlamaConfig()` ... constructed
directly: `AutoConfig.from_pretrained` would reach the hub), with overrides (`layers`, `hidden`,
`heads`, `kv_heads`, `intermediate`, `vocab`, `seq`, `tie`), split into embedding, layers and
head.  `timm:NAME[@SIZE]` goes through `timm.create_model(NAME, pretrained=False)` and the cut-point
finder, at SIZE px (`--image-size`; 64 by default on emulated clusters) or the model's own.  Both are
optional extras: `pip install -e ".[hf]"` or `".[timm]"`.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass

import torch
from torch import nn

from hetsim.errors import ConfigError, UnknownNameError
from hetsim.workloads.base import Workload
from hetsim.workloads.cutpoints import merge_tied_blocks, split_module
from hetsim.workloads.transformer import (
    GPTConfig,
    lm_loss_sum,
    masked_batch,
    mlm_loss_sum,
    token_batch,
)

HF_SEQ_LEN = 128
"""Default tokens per sample of an hf: model: modest, so that profiling on a CPU finishes (`?seq=` sets it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HFType:
    config: str
    """transformers class of the configuration."""
    model: str
    """transformers class of the model with its training head."""
    arch: str
    """How its blocks are taken apart: 'gpt2', 'llama' or 'bert'."""
    defaults: tuple[tuple[str, object], ...] = ()
    """Configuration values of the named checkpoint, where they differ from the config class's."""


HF_MODELS: dict[str, HFType] = {
    "gpt2": HFType(config="GPT2Config", model="GPT2LMHeadModel", arch="gpt2"),
    "gpt2-medium": HFType(config="GPT2Config", model="GPT2LMHeadModel", arch="gpt2",
                          defaults=(("n_embd", 1024), ("n_layer", 24), ("n_head", 16))),
    "gpt2-large": HFType(config="GPT2Config", model="GPT2LMHeadModel", arch="gpt2",
                         defaults=(("n_embd", 1280), ("n_layer", 36), ("n_head", 20))),
    "gpt2-xl": HFType(config="GPT2Config", model="GPT2LMHeadModel", arch="gpt2",
                      defaults=(("n_embd", 1600), ("n_layer", 48), ("n_head", 25))),
    "bert-base-uncased": HFType(config="BertConfig", model="BertForMaskedLM", arch="bert"),
    "bert-large-uncased": HFType(config="BertConfig", model="BertForMaskedLM", arch="bert",
                                 defaults=(("hidden_size", 1024), ("num_hidden_layers", 24),
                                           ("num_attention_heads", 16), ("intermediate_size", 4096))),
    "llama": HFType(config="LlamaConfig", model="LlamaForCausalLM", arch="llama"),
    "mistral": HFType(config="MistralConfig", model="MistralForCausalLM", arch="llama"),
    "qwen2": HFType(config="Qwen2Config", model="Qwen2ForCausalLM", arch="llama"),
}
HF_MODELS["bert"] = HF_MODELS["bert-base-uncased"]

# Override keys -> configuration attribute, per architecture.
KEYS = {
    "gpt2": {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "intermediate": "n_inner",
             "vocab": "vocab_size", "seq": "n_positions"},
    "bert": {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
             "intermediate": "intermediate_size", "vocab": "vocab_size", "seq": "max_position_embeddings"},
    "llama": {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
              "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size", "vocab": "vocab_size",
              "seq": "max_position_embeddings"},
}


def _require(package: str, extra: str, spec: str):
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"--model {spec!r} needs the optional package {package!r}, which is not installed: "
                          f'pip install -e ".[{extra}]" (or pip install {package})') from None


def parse_hf(spec: str) -> tuple[str, dict[str, int]]:
    name, _, query = spec[3:].partition("?")
    if name not in HF_MODELS:
        raise UnknownNameError("Hugging Face model", name, list(HF_MODELS),
                               "Write hf:NAME?layers=N&hidden=N&heads=N&seq=N to change its size")
    allowed = set(KEYS[HF_MODELS[name].arch]) | {"tie"}
    over: dict[str, int] = {}
    for part in filter(None, query.split("&")):
        key, eq, val = part.partition("=")
        if key not in allowed or not eq or not val.isdigit() or (int(val) <= 0 and key != "tie"):
            raise ConfigError(f"--model {spec!r}: {part!r} is not KEY=N with N a positive whole number and KEY one "
                              f"of {', '.join(sorted(allowed))}")
        over[key] = int(val)
    return name, over


def hf_spec(name: str, over: dict[str, int]) -> str:
    """The canonical spec (sorted overrides, the sequence length always stated): also the profiles' key."""
    return f"hf:{name}?" + "&".join(f"{k}={v}" for k, v in sorted(over.items()))


def hf_workload(spec: str, seq_len: int | None = None) -> Workload:
    name, over = parse_hf(spec)  # an unknown name or a bad override is said first, with or without the extra
    transformers = _require("transformers", "hf", spec)
    t = HF_MODELS[name]
    over.setdefault("seq", seq_len or HF_SEQ_LEN)
    cfg = getattr(transformers, t.config)(**dict(t.defaults))
    for key, val in over.items():
        if key != "tie":
            setattr(cfg, KEYS[t.arch][key], val)
    if "tie" in over:
        cfg.tie_word_embeddings = bool(over["tie"])
    cfg._attn_implementation = "sdpa"
    seq = over["seq"]
    model_cls = getattr(transformers, t.model)

    def build() -> list[tuple[str, nn.Module]]:
        torch.manual_seed(0)
        return _hf_blocks(model_cls(cfg), t.arch)

    with torch.device("meta"):  # sizes and ties without allocating weights (the model may be huge)
        blocks = build()
    merged, notes = merge_tied_blocks(blocks, spec)
    params = sum(p.numel() for p in {id(p): p for _, b in blocks for p in b.parameters()}.values())
    batch_cfg = GPTConfig(vocab_size=cfg.vocab_size, seq_len=seq)
    bert = t.arch == "bert"
    canonical = hf_spec(name, over)
    return Workload(name=f"hf-{name}", build_blocks=lambda: merge_tied_blocks(build(), spec)[0],
                    make_batch=masked_batch(batch_cfg) if bert else token_batch(batch_cfg),
                    loss_sum=mlm_loss_sum if bert else lm_loss_sum, spec=canonical, tokens_per_sample=seq,
                    notes=tuple(notes),
                    about=f"{canonical}: {t.model} from an offline {t.config} (no weights), {params / 1e6:.1f}M "
                          f"parameters, {len(merged)} blocks, {seq} tokens per sample")


class _Embed(nn.Module):
    """Token (+ learned position) embeddings of a Hugging Face decoder: ids -> hidden states."""

    def __init__(self, tok: nn.Module, pos: nn.Module | None = None, drop: nn.Module | None = None):
        super().__init__()
        self.tok, self.pos, self.drop = tok, pos, drop or nn.Identity()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        if self.pos is not None:
            h = h + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.drop(h)


class _RotaryLayer(nn.Module):
    """A Llama-style decoder layer with its rotary position embedding computed from the input."""

    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        return self.layer(h, position_embeddings=self.rotary(h, pos), position_ids=pos)


def _hf_blocks(m: nn.Module, arch: str) -> list[tuple[str, nn.Module]]:
    if arch == "gpt2":
        tr = m.transformer
        return ([("embed", _Embed(tr.wte, tr.wpe, tr.drop))] + [(f"layer{i}", b) for i, b in enumerate(tr.h)]
                + [("head", nn.Sequential(tr.ln_f, m.lm_head))])
    if arch == "bert":
        enc = m.bert
        return ([("embed", enc.embeddings)] + [(f"layer{i}", b) for i, b in enumerate(enc.encoder.layer)]
                + [("head", m.cls)])
    core = m.model  # llama, mistral, qwen2
    return ([("embed", _Embed(core.embed_tokens))]
            + [(f"layer{i}", _RotaryLayer(b, core.rotary_emb)) for i, b in enumerate(core.layers)]
            + [("head", nn.Sequential(core.norm, m.lm_head))])


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
    timm = _require("timm", "timm", spec)
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
