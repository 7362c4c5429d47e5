"""`hf:NAME[?key=value&...]`: a Hugging Face transformers model built from an offline configuration,
with no weights and no hub access.

NAME is a checkpoint preset (`gpt2`, `gpt2-medium`, `bert-base-uncased`, `bert-large-uncased` ...: the
configuration values of that checkpoint) or any model type transformers knows (`llama`, `mistral`,
`qwen3`, `opt`, `gpt_neox`, `roberta`, `t5` ...: its configuration class's defaults, which is how
`AutoConfig.for_model` builds one without the hub).  Overrides (`layers`, `hidden`, `heads`,
`kv_heads`, `intermediate`, `vocab`, `seq`, `tie`) go through the configuration's standard names, so
they mean the same on every type.  The training head is the type's masked-LM head for encoders, its
causal-LM head for decoders, and the whole encoder-decoder for sequence-to-sequence types (decoder fed
the input: next-token loss).

Blocks: where the model has one of three layouts, it is split into embedding, one block per layer and
head — Llama-style decoders (`model.embed_tokens`, `model.layers`, a final norm, `model.rotary_emb`,
`lm_head`), GPT-2-style ones (`transformer.wte`, `transformer.h`, `transformer.ln_f`) and BERT-style
encoders (`embeddings`, `encoder.layer`, a head).  Before anything is measured, a two-layer model of the
configuration is built for real and run on a batch (`_layout_of`): a configuration transformers cannot
run is one error, and a layout is only used once its split computes exactly the model's own logits.
Any other model (torch.fx cannot trace Hugging Face forwards) runs as one block, data parallel and
ZeRO plans only, with a note saying so.  New attention heads without kv_heads= keep multi-head
attention where the type's default ratio no longer divides them.
"""

from __future__ import annotations

import copy
import difflib
import importlib
from dataclasses import dataclass

import torch
from torch import nn

from hetsim.errors import ConfigError, UnknownNameError
from hetsim.workloads.base import Workload
from hetsim.workloads.cutpoints import merge_tied_blocks
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
class HFPreset:
    model_type: str
    """transformers' model type whose configuration class builds it."""
    defaults: tuple[tuple[str, object], ...] = ()
    """Configuration values of the named checkpoint, where they differ from the config class's."""


PRESETS: dict[str, HFPreset] = {
    "gpt2": HFPreset(model_type="gpt2"),
    "gpt2-medium": HFPreset(model_type="gpt2", defaults=(("n_embd", 1024), ("n_layer", 24), ("n_head", 16))),
    "gpt2-large": HFPreset(model_type="gpt2", defaults=(("n_embd", 1280), ("n_layer", 36), ("n_head", 20))),
    "gpt2-xl": HFPreset(model_type="gpt2", defaults=(("n_embd", 1600), ("n_layer", 48), ("n_head", 25))),
    "bert-base-uncased": HFPreset(model_type="bert"),
    "bert-large-uncased": HFPreset(model_type="bert", defaults=(
        ("hidden_size", 1024), ("num_hidden_layers", 24), ("num_attention_heads", 16), ("intermediate_size", 4096))),
}
"""Checkpoint names whose configuration is not their type's default; any other NAME is a model type."""

KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers",),
    "hidden": ("hidden_size",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim", "hidden_dim",
                     "ffn_hidden_size"),
    "vocab": ("vocab_size",),
    "seq": ("max_position_embeddings",),
}
"""Override key -> the configuration attributes it may set (standard names: each configuration's
`attribute_map` turns them into its own, such as GPT-2's n_layer); the first one the type has is set."""
ALSO: dict[str, tuple[str, ...]] = {"layers": ("num_decoder_layers", "decoder_layers"),
                                    "heads": ("decoder_attention_heads",), "intermediate": ("decoder_ffn_dim",)}
"""Set beside an override where a type has them (an encoder-decoder's decoder)."""
EXAMPLES = "gpt2, bert-base-uncased, llama, mistral, qwen3, opt, gpt_neox, roberta, t5"


def require_extra(package: str, extra: str, spec: str):
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"--model {spec!r} needs the optional package {package!r}, which is not installed: "
                          f'pip install -e ".[{extra}]" (or pip install {package})') from None


def parse_hf(spec: str) -> tuple[str, dict[str, int]]:
    """`hf:NAME?k=v&...` -> (NAME, overrides); a bad override or a hub path is one error."""
    name, _, query = spec[3:].partition("?")
    name = name.lower()  # presets and model types are lower case
    if "/" in name:
        raise ConfigError(f"--model {spec!r}: hetsim reaches no model hub, so it cannot read that checkpoint's "
                          "configuration; name its model type and sizes instead, e.g. "
                          "hf:llama?layers=32&hidden=4096&heads=32&intermediate=11008")
    allowed = set(KEYS) | {"tie"}
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


def _task(transformers, name: str, spec: str) -> tuple[str, str, str]:
    """(model type, task, model class name) of NAME: a preset's type, or NAME itself as a type."""
    from transformers.models.auto import modeling_auto as auto

    mtype = PRESETS[name].model_type if name in PRESETS else name
    for task, table in (("seq2seq", auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                        ("masked", auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
                        ("causal", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)):
        cls = table.get(mtype)
        cls = cls[0] if isinstance(cls, (tuple, list)) else cls
        if cls and hasattr(transformers, cls):
            return mtype, task, cls
    types = (set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
             | set(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES))
    near = difflib.get_close_matches(name.lower(), sorted(types | set(PRESETS)), n=3, cutoff=0.6)
    raise UnknownNameError("Hugging Face model", name, sorted(PRESETS),
                           (f"did you mean {', '.join(repr(n) for n in near)}? " if near else "")
                           + f"NAME is one of those checkpoints or any of the {len(types)} model types with a "
                           f"language-model head in transformers {transformers.__version__} (e.g. {EXAMPLES}); "
                           "write hf:NAME?layers=N&hidden=N&heads=N&seq=N to change its size")


def _config(transformers, name: str, mtype: str, over: dict[str, int], spec: str):
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[mtype](**dict(PRESETS[name].defaults if name in PRESETS else ()))
    heads0 = getattr(cfg, "num_attention_heads", None)
    for key, val in over.items():
        if key == "tie":
            cfg.tie_word_embeddings = bool(val)
            continue
        attrs = [a for a in KEYS[key] if hasattr(cfg, a)]
        if not attrs and key == "seq":
            continue  # no learned positions to size (relative or rotary positions take any length)
        if not attrs:
            raise ConfigError(f"--model {spec!r}: a {mtype} configuration ({type(cfg).__name__}) has no {key!r} to "
                              f"set; leave {key}= out")
        setattr(cfg, attrs[0], val)
        for also in ALSO.get(key, ()):
            if getattr(cfg, also, None):
                setattr(cfg, also, val)
    kv, heads = getattr(cfg, "num_key_value_heads", None), getattr(cfg, "num_attention_heads", None)
    if kv and heads and "heads" in over and "kv_heads" not in over and (kv == heads0 or kv > heads or heads % kv):
        cfg.num_key_value_heads = kv = heads  # new heads, no kv_heads: multi-head attention (one kv head per head)
    if kv and heads and heads % kv:
        raise ConfigError(f"--model {spec!r}: {kv} key/value heads do not divide {heads} attention heads; set "
                          f"kv_heads= to a divisor of {heads}")
    if "vocab" in over:
        _tokens_within(cfg, over["vocab"])
    if "hidden" in over or "heads" in over:
        hidden, heads = getattr(cfg, "hidden_size", 0), getattr(cfg, "num_attention_heads", 0)
        if hidden and heads and hidden % heads:
            raise ConfigError(f"--model {spec!r}: {heads} heads do not divide a hidden size of {hidden}; set "
                              f"heads= to a divisor of {hidden} or hidden= to a multiple of {heads}")
        if getattr(cfg, "head_dim", None) and not isinstance(getattr(type(cfg), "head_dim", None), property):
            cfg.head_dim = hidden // heads  # a stated head size follows the new shape
    cfg.use_cache = False  # training: no key/value cache
    cfg._attn_implementation = "sdpa"
    return cfg


def hf_workload(spec: str, seq_len: int | None = None) -> Workload:
    name, over = parse_hf(spec)  # a bad override is said first, with or without the extra
    if not name:
        raise UnknownNameError("Hugging Face model", name, sorted(PRESETS), f"e.g. {EXAMPLES}")
    transformers = require_extra("transformers", "hf", spec)
    mtype, task, model_name = _task(transformers, name, spec)
    over.setdefault("seq", seq_len or HF_SEQ_LEN)
    cfg = _config(transformers, name, mtype, over, spec)
    seq = over["seq"]
    model_cls = getattr(transformers, model_name)
    layout, why = "whole", ""

    def build() -> list[tuple[str, nn.Module]]:
        torch.manual_seed(0)
        return _blocks(model_cls(cfg), layout, task)

    try:
        try:
            with torch.device("meta"):
                meta = model_cls(cfg)
        except ValueError as e:  # a type with no SDPA kernel (gpt_oss): PyTorch's plain attention ops
            if "attention implementation" not in str(e):
                raise
            cfg._attn_implementation = "eager"
            with torch.device("meta"):
                meta = model_cls(cfg)
        layout, why = _layout_of(model_cls, cfg, meta, task, spec)
        with torch.device("meta"):  # sizes and ties without allocating weights (the model may be huge)
            blocks = build()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own checks of a configuration
        raise ConfigError(f"--model {spec!r}: transformers cannot build {model_name} with these sizes "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else 'no message'}); "
                          "change the overrides (heads must divide hidden, kv_heads divide heads)") from None
    merged, notes = merge_tied_blocks(blocks, spec)
    if layout == "whole":
        notes = [f"{spec} runs as one block (data parallel and ZeRO plans only, no pipeline): {why}", *notes]
    params = sum(p.numel() for p in {id(p): p for _, b in blocks for p in b.parameters()}.values())
    batch_cfg = GPTConfig(vocab_size=cfg.vocab_size, seq_len=seq)
    masked = task == "masked"
    canonical = hf_spec(name, over)
    return Workload(name=f"hf-{name}", build_blocks=lambda: merge_tied_blocks(build(), spec)[0],
                    make_batch=masked_batch(batch_cfg) if masked else token_batch(batch_cfg),
                    loss_sum=mlm_loss_sum if masked else lm_loss_sum, spec=canonical, tokens_per_sample=seq,
                    notes=tuple(notes),
                    about=f"{canonical}: {model_name} from an offline {type(cfg).__name__} (no weights), "
                          f"{params / 1e6:.1f}M parameters, {len(merged)} blocks, {seq} tokens per sample")


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


def _first(out) -> torch.Tensor:
    """A layer's hidden states: transformers 4.x layers return a tuple, 5.x ones the tensor."""
    return out[0] if isinstance(out, tuple) else out


class _Layer(nn.Module):
    """A decoder or encoder layer called on hidden states alone (no mask: every sample is full length)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _first(self.layer(h))


class _RotaryLayer(nn.Module):
    """A Llama-style decoder layer with its rotary position embedding computed from the input."""

    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        return _first(self.layer(h, position_embeddings=self.rotary(h, pos), position_ids=pos))


class _Whole(nn.Module):
    """The whole model as one block: ids -> logits (an encoder-decoder's decoder is fed the input)."""

    def __init__(self, model: nn.Module, seq2seq: bool):
        super().__init__()
        self.model, self.seq2seq = model, seq2seq

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.seq2seq:
            return self.model(input_ids=ids, decoder_input_ids=ids).logits
        return self.model(input_ids=ids).logits


def _final_norm(core: nn.Module) -> nn.Module | None:
    return next((getattr(core, n) for n in ("norm", "final_layernorm", "final_layer_norm", "ln_f")
                 if isinstance(getattr(core, n, None), nn.Module)), None)


def _layout(m: nn.Module, task: str) -> str:
    """Which split fits `m`'s attributes ('llama', 'gpt2', 'bert'), or 'whole'."""
    if task == "causal" and isinstance(getattr(m, "lm_head", None), nn.Module):
        core = getattr(m, "model", None)
        if all(isinstance(getattr(core, a, None), nn.Module) for a in ("embed_tokens", "layers", "rotary_emb")) \
                and _final_norm(core) is not None:
            return "llama"
        tr = getattr(m, "transformer", None)
        if all(isinstance(getattr(tr, a, None), nn.Module) for a in ("wte", "h", "ln_f")):
            return "gpt2"
    if task == "masked":
        base = getattr(m, getattr(m, "base_model_prefix", ""), None)
        enc = getattr(base, "encoder", None)
        head = getattr(m, "cls", None) or getattr(m, "lm_head", None)
        if isinstance(getattr(base, "embeddings", None), nn.Module) and isinstance(getattr(enc, "layer", None),
                                                                                   nn.ModuleList) and head is not None:
            return "bert"
    return "whole"


def _blocks(m: nn.Module, layout: str, task: str) -> list[tuple[str, nn.Module]]:
    if layout == "gpt2":
        tr = m.transformer
        return ([("embed", _Embed(tr.wte, getattr(tr, "wpe", None), getattr(tr, "drop", None)))]
                + [(f"layer{i}", _Layer(b)) for i, b in enumerate(tr.h)]
                + [("head", nn.Sequential(tr.ln_f, m.lm_head))])
    if layout == "bert":
        base = getattr(m, m.base_model_prefix)
        return ([("embed", base.embeddings)] + [(f"layer{i}", _Layer(b)) for i, b in enumerate(base.encoder.layer)]
                + [("head", getattr(m, "cls", None) or m.lm_head)])
    if layout == "llama":
        core = m.model
        return ([("embed", _Embed(core.embed_tokens))]
                + [(f"layer{i}", _RotaryLayer(b, core.rotary_emb)) for i, b in enumerate(core.layers)]
                + [("head", nn.Sequential(_final_norm(core), m.lm_head))])
    return [("model", _Whole(m, task == "seq2seq"))]


CHECK_PARAMS = 150_000_000
"""The most parameters of the two-layer model built for real to check a configuration; a larger one is
checked at a small width with the same heads (`_narrow`)."""


def _two_layers(cfg):
    two = copy.deepcopy(cfg)
    for attr in ("num_hidden_layers", *ALSO["layers"]):
        if getattr(two, attr, None):
            setattr(two, attr, 2)
    return two


def _narrow(cfg):
    """`cfg` at two layers, 8 values per head and a vocabulary of 512: the same heads, kv heads and layout."""
    small = _two_layers(cfg)
    heads = getattr(small, "num_attention_heads", None) or 4
    for attr, val in (("hidden_size", 8 * heads), ("head_dim", 8), ("intermediate_size", 16 * heads),
                      ("vocab_size", 512)):
        if getattr(small, attr, None) and not isinstance(getattr(type(small), attr, None), property):
            setattr(small, attr, val)
    _tokens_within(small, 512)
    return small


def _tokens_within(cfg, vocab: int) -> None:
    """Special tokens past a vocabulary of `vocab` (which would index outside the embedding) become its last id."""
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(getattr(cfg, attr, None), int) and getattr(cfg, attr) >= vocab:
            setattr(cfg, attr, vocab - 1)


def _meta_params(model_cls, cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in model_cls(cfg).parameters())


def _layout_of(model_cls, cfg, meta: nn.Module, task: str, spec: str) -> tuple[str, str]:
    """(layout, note): a two-layer model of this configuration (or, past `CHECK_PARAMS`, of its `_narrow`
    form) is built for real and run on a batch, and the layout is kept once its split computes that
    model's own logits; 'whole' otherwise.  A configuration whose own two-layer model fails to run is one
    error naming what transformers said."""
    layout = _layout(meta, task)  # `meta`: the whole model of `cfg` on the meta device
    two = _two_layers(cfg)
    own = _meta_params(model_cls, two) <= CHECK_PARAMS
    check = two if own else _narrow(cfg)
    try:
        holds = _layout_holds(model_cls, check, layout, task)
    except Exception as e:  # noqa: BLE001 - the model itself fails on a batch
        if own:
            raise ConfigError(f"--model {spec!r}: {model_cls.__name__} fails on a batch with these sizes "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else 'no message'}); "
                              "change the overrides") from None
        return "whole", "its layout could not be checked at a small width"
    if layout == "whole":
        return layout, f"its {model_cls.__name__} is not laid out as hetsim's Llama-, GPT-2- or BERT-style split expects"
    if not holds:
        return "whole", (f"its {model_cls.__name__} split Llama-, GPT-2- or BERT-style does not compute what the "
                         "model computes (checked on a two-layer model)")
    return layout, ""


def _layout_holds(model_cls, cfg, layout: str, task: str) -> bool:
    """Whether the `layout` split of a model of `cfg` computes its own logits (the model's forward runs
    either way, so a configuration that cannot run raises here)."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        m = model_cls(cfg).eval()
        ids = torch.randint(0, min(cfg.vocab_size, 100) - 1, (2, 8))
        with torch.no_grad():
            want = _Whole(m, task == "seq2seq")(ids)
            if layout == "whole":
                return False
            h = ids
            for _, blk in _blocks(m, layout, task):
                h = blk(h)
        return h.shape == want.shape and torch.allclose(h, want, atol=1e-4, rtol=1e-4)
    finally:
        torch.random.set_rng_state(state)
