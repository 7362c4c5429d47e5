"""Workloads of any model: gpt/bert/vit presets, a user's plain modules split at their cut points,
and the rules a user's model must follow (no live runs: forward and backward in this process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetsim.errors import ConfigError, UnknownNameError
from hetsim.workloads import load_workload, workload_from_spec
from hetsim.workloads.cutpoints import merge_tied_blocks, split_module
from hetsim.workloads.transformer import IGNORE, gpt_workload

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@pytest.fixture(autouse=True)
def _assets_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))
    yield
    sys.modules.pop("user_models", None)


def _full_vs_blocks(wl, n=4):
    """The chain of blocks computes the same loss and gradient as a freshly built model."""
    x, y = wl.make_batch(n, 3)
    a, b = wl.model(), wl.model()
    la = wl.loss_sum(a(x), y)
    h = x
    for blk in b.children():
        h = blk(h)
    lb = wl.loss_sum(h, y)
    la.backward()
    lb.backward()
    assert torch.allclose(la, lb)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), na
    return float(la)


@pytest.mark.parametrize("spec", ["gpt@tiny@16", "bert@tiny@16", "vit@tiny@32"])
def test_builtin_transformers_roundtrip_their_spec(spec):
    wl = workload_from_spec(spec)
    assert wl.spec == spec
    assert workload_from_spec(wl.spec).block_names() == wl.block_names()
    assert wl.block_names()[0] == "embed" and wl.block_names()[-1] == "head"
    assert _full_vs_blocks(wl) > 0


def test_sequence_length_is_part_of_the_spec_and_batches():
    wl = load_workload("gpt", size="tiny", seq_len=24)
    assert wl.spec == "gpt@tiny@24" and wl.tokens_per_sample == 24
    x, y = wl.make_batch(3, 0)
    assert x.shape == y.shape == (3, 24)
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets
    assert load_workload("gpt").spec == "gpt@tiny@64"  # the preset's own length


def test_gpt_keeps_the_module_names_tensor_parallelism_shards():
    names = {n for n, _ in gpt_workload("tiny", 8).model().named_modules()}
    assert {"layer0.attn.qkv", "layer0.attn.proj", "layer0.mlp.fc", "layer0.mlp.proj"} <= names


def test_bert_masks_deterministically_and_only_masked_positions_count():
    wl = load_workload("bert", size="tiny", seq_len=32)
    x1, y1 = wl.make_batch(5, 7)
    x2, y2 = wl.make_batch(5, 7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    masked = y1 != IGNORE
    assert masked.any(dim=1).all()  # every sample has a masked position
    assert (x1[masked] == 2047).all() and (x1[~masked] != 2047).all()
    logits = torch.randn(5, 32, 2048)
    changed = logits.clone()
    changed[~masked] = 0.0  # logits at unmasked positions do not change the loss
    assert torch.allclose(wl.loss_sum(logits, y1), wl.loss_sum(changed, y1))


def test_bad_sizes_fail_with_the_rule():
    with pytest.raises(UnknownNameError, match="huge"):
        load_workload("gpt", size="huge")
    with pytest.raises(ConfigError, match="--seq-len 1"):
        load_workload("gpt", seq_len=1)
    with pytest.raises(ConfigError, match="patch size"):
        load_workload("vit", image_size=30)


@pytest.mark.parametrize("fn, blocks", [("list_mlp", 7), ("seq_cnn", None), ("tied_lm", 1), ("skip_net", 2),
                                        ("skip_all", 1)])
def test_user_models_are_split_and_compute_what_they_did(fn, blocks):
    """skip_net's input jumps over every cut between its layers, but not over the one before its head:
    it is cut between its top-level children; skip_all's jumps over that one too."""
    wl = load_workload(f"user_models:{fn}")
    if blocks is not None:
        assert len(wl.block_names()) == blocks
    else:
        assert len(wl.block_names()) > 2
    if blocks == 1:
        assert wl.notes and "one block" in wl.notes[0]
    if fn == "skip_net":
        assert len(wl.notes) == 1 and "top-level children only" in wl.notes[0] and "more than one value" in wl.notes[0]
    _full_vs_blocks(wl)


def test_parts_without_parameters_join_a_neighbouring_block():
    """user_models:tagger flips its input before its first layer and transposes its output after its head:
    cut alone, either would be a block with nothing to train, and a pipeline stage of it alone failed in
    torch's optimizer ('optimizer got an empty parameter list')."""
    wl = load_workload("user_models:tagger")
    assert wl.block_names() == ["0_inp", "1_mid", "2_head"]
    assert all(any(p.requires_grad for p in b.parameters()) for b in wl.model())
    assert len(wl.notes) == 1 and "(flip)" in wl.notes[0] and "(transpose)" in wl.notes[0]
    _full_vs_blocks(wl)


def test_user_model_loss_is_the_batch_mean_times_the_batch():
    wl = load_workload("user_models:list_mlp")
    model = wl.model()
    x, y = wl.make_batch(6, 1)
    assert torch.allclose(wl.loss_sum(model(x), y), nn.functional.cross_entropy(model(x), y) * 6)


def test_split_keeps_tied_parameters_on_one_block():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    blocks = [("a", emb), ("b", nn.Linear(4, 4)), ("c", nn.Linear(4, 4)), ("d", head), ("e", nn.Identity())]
    merged, notes = merge_tied_blocks(blocks, "m")
    assert [n for n, _ in merged] == ["a-d", "e"] and notes


def test_split_refuses_cuts_a_residual_jumps_over():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(4, 4)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            s = self.stem(x)
            h = s
            for i, layer in enumerate(self.layers):
                h = layer(h) + (s if i == 1 else 0)  # s is live until layer 1: no cut before layers 0, 1
            return h

    split = split_module(Net(), torch.randn(2, 4), "net")
    calls = [[n.target for n in b.graph.nodes if n.op == "call_module"] for _, b in split.blocks]
    assert ["layers.0", "layers.1"] in calls  # s crosses the cut between them: none there
    assert ["stem"] in calls and ["layers.3"] in calls


def test_non_traceable_forward_runs_as_one_block():
    class Dynamic(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                if x.sum() > 0:  # data-dependent control flow: fx cannot follow it
                    x = layer(x)
            return x

    split = split_module(Dynamic(), torch.randn(2, 4), "dyn")
    assert len(split.blocks) == 1 and "torch.fx cannot trace" in split.notes[0]


def _chain(split, x):
    for _, b in split.blocks:
        x = b(x)
    return x


def test_a_cut_hands_on_the_value_that_crosses_it_not_the_last_one_computed():
    """An LSTM returns (output, (h, c)); the forward keeps the output only.  The block ending at the
    LSTM hands on that output, not the unused state (before: 'block 1 returns tuple', one block)."""
    class RNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.lstm = nn.LSTM(8, 8, batch_first=True)
            self.head = nn.Linear(8, 50)

        def forward(self, x):
            h, _ = self.lstm(self.emb(x))
            return self.head(h)

    net, x = RNN(), torch.randint(0, 50, (2, 5))
    split = split_module(net, x, "rnn")
    assert [n for n, _ in split.blocks] == ["0_emb", "1_lstm", "2_head"] and not split.notes
    assert torch.equal(_chain(split, x), net(x))


def test_layers_that_are_module_dicts_are_cut_before_their_first_call():
    """A ModuleList of ModuleDicts: a layer is never called itself, only its members; the cut goes
    before the first call inside each layer (before: no anchor found, one block), and after the last
    layer's residual add, so the head is a block of its own."""
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(6, 8)
            self.mix = nn.ModuleList(nn.ModuleDict({"n": nn.LayerNorm(8), "f": nn.Linear(8, 8)}) for _ in range(3))
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            x = self.embed(x)
            for blk in self.mix:
                x = x + blk["f"](blk["n"](x))
            return self.head(x)

    net, x = Mixer(), torch.randn(2, 6)
    split = split_module(net, x, "mixer")
    calls = [[n.target for n in b.graph.nodes if n.op == "call_module"] for _, b in split.blocks]
    assert calls[0] == ["embed"] and ["mix.1.n", "mix.1.f"] in calls and calls[-1] == ["head"]
    assert len(split.blocks) == 5
    assert torch.allclose(_chain(split, x), net(x))


def test_a_run_between_other_children_of_its_container_is_found_and_they_are_cut_too():
    """torchvision's MobileNetV3 shape: a stem, a run of blocks whose insides are one-class Sequentials
    too, and a last convolution in one `features` Sequential, pooling (no parameters) between blocks.
    The container with the longest run wins and all its children with parameters are cut before
    (before: only the three convolutions inside one block were, most of the model in the first block)."""
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(*(nn.Conv2d(4, 4, 1) for _ in range(3)))

        def forward(self, x):
            return x + self.block(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Inner(), Inner(), nn.MaxPool2d(1),
                                          Inner(), Inner(), nn.Conv2d(4, 8, 1))
            self.head = nn.Linear(8, 5)

        def forward(self, x):
            return self.head(self.features(x).mean((2, 3)))

    net, x = Net(), torch.randn(2, 3, 8, 8)
    split = split_module(net, x, "mbv3")
    calls = [[n.target for n in b.graph.nodes if n.op == "call_module"] for _, b in split.blocks]
    assert calls[0] == ["features.0"] and calls[1][0] == "features.1" and ["features.6"] in calls
    assert sum(c[0] in {"features.1", "features.2", "features.4", "features.5"} for c in calls) == 4
    assert len(split.blocks) == 7 and not split.notes
    with torch.no_grad():
        assert torch.allclose(_chain(split, x), net(x), atol=1e-6)


def test_layers_kept_in_a_module_dict_are_cut_between():
    """Layers in a ModuleDict (looped over by name) are a run like a ModuleList's (before: the
    dict was not a container, and the four layers one block).  The cut after the last layer goes
    after its residual add (before: the last layer and the head were one block)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(30, 8)
            self.layers = nn.ModuleDict({f"l{i}": nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU())
                                         for i in range(4)})
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.emb(x)
            for name in self.layers:
                h = h + self.layers[name](h)
            return self.head(h.mean(1))

    net, x = Net(), torch.randint(0, 30, (2, 5))
    split = split_module(net, x, "dict")
    assert [n for n, _ in split.blocks] == ["0_emb", "1_layers_l0", "2_layers_l1", "3_layers_l2", "4_layers_l3",
                                            "5_head"]
    with torch.no_grad():
        assert torch.allclose(_chain(split, x), net(x), atol=1e-6)


def test_a_run_none_of_whose_layers_can_be_cut_apart_gives_way_to_the_next_container():
    """DenseNet's shape: each dense block's layers read the list of all earlier outputs, so no cut
    inside a block holds, only those before and after it (three blocks, none between its layers).  The
    next container, the Sequential holding the dense blocks and transitions, is cut instead, and a note
    says so."""
    class Dense(nn.ModuleDict):
        def __init__(self, c, n):
            super().__init__({f"l{i}": nn.Conv2d(c + 2 * i, 2, 1) for i in range(n)})

        def forward(self, x):
            feats = [x]
            for layer in self.values():
                feats.append(layer(torch.cat(feats, 1)))
            return torch.cat(feats, 1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 4, 1), Dense(4, 3), nn.Conv2d(10, 4, 1), Dense(4, 4),
                                          nn.Conv2d(12, 4, 1))
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.features(x).mean((2, 3)))

    net, x = Net(), torch.randn(2, 3, 6, 6)
    split = split_module(net, x, "dense")
    assert len(split.blocks) == 6 and "cut between the children of features" in split.notes[-1]
    assert "features.3" in split.notes[-1]
    with torch.no_grad():
        assert torch.allclose(_chain(split, x), net(x), atol=1e-6)


def test_a_run_inside_an_untraceable_torch_module_leaves_the_top_level_children():
    """nn.TransformerEncoder's layers are the longest run, but its forward branches on its input (fx
    cannot trace it): the model is cut between its top-level children, and the note says why."""
    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16)
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.enc(self.emb(x)).mean(1))

    net, x = Enc(), torch.randint(0, 40, (2, 7))
    split = split_module(net, x, "enc")
    assert [n for n, _ in split.blocks][0] == "0_emb" and len(split.blocks) == 3
    assert len(split.notes) == 1 and "top-level children only" in split.notes[0] and "enc.layers" in split.notes[0]
    assert "cannot trace" in split.notes[0]
    with torch.no_grad():
        assert torch.allclose(_chain(split, x), net(x), atol=1e-6)


@pytest.mark.parametrize("fn, rule", [
    ("bad_shapes", "need 2 samples"),
    ("bad_loss", "one number"),
    ("broken", "fails to build"),
    ("two_inputs", r"returned tuple\(tuple\(Tensor, Tensor\), Tensor\).*stack several inputs into one"),
])
def test_bad_user_models_fail_naming_model_and_rule(fn, rule):
    with pytest.raises(ConfigError, match=rule) as e:
        load_workload(f"user_models:{fn}")
    assert f"user_models:{fn}" in str(e.value)


def test_missing_extra_or_unknown_name_says_how_to_fix():
    with pytest.raises(UnknownNameError, match="hf:NAME"):
        load_workload("hf:gpt7")
    with pytest.raises(ConfigError, match="KEY=N"):
        load_workload("hf:gpt2?layers=two")


def test_an_output_that_is_not_one_tensor_is_packed_for_the_executors_and_unpacked_for_the_loss():
    """two_heads returns a dict: its last block ends by packing the dict's tensors into one (what every
    executor and pipeline stage hands on), and the loss unpacks it, so the chain's loss equals the
    module's own."""
    wl, h, same_loss = _chain_and_loss("two_heads")
    assert isinstance(h, torch.Tensor) and h.shape == (5, 4 + 2) and same_loss


def _chain_and_loss(fn: str):
    """user_models' `fn` as a workload, its blocks' chain run on a batch of 5, and whether the
    workload's loss on it equals the user's loss on the module's own output."""
    import user_models

    wl = load_workload(f"user_models:{fn}")
    x, y = wl.make_batch(5, 3)
    torch.manual_seed(0)
    own = getattr(user_models, fn)()
    h = x
    for _, block in wl.model().named_children():
        h = block(h)
    return wl, h, bool(torch.allclose(wl.loss_sum(h, y), own.loss(own.module(x), y) * 5))


def test_entries_of_an_output_that_are_not_tensors_are_dropped_and_a_loss_reading_them_is_refused():
    """Before: a None or a cache object in the output (a Hugging Face causal LM's) stopped the model with
    'the output holds NoneType'.  Now the last block packs the tensors only, the loss sees None in their
    place and gives what it gives on the module's own output; a loss that reads a dropped entry is one
    ConfigError naming it."""
    wl, h, same_loss = _chain_and_loss("with_cache")
    assert isinstance(h, torch.Tensor) and h.shape == (5, 4) and len(wl.block_names()) == 4 and same_loss
    with pytest.raises(ConfigError, match=r"user_models:cache_read.*reads the module output's NoneType, int"):
        load_workload("user_models:cache_read")


def test_an_output_holding_a_scalar_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"user_models:scalar_out.*shape \(\).*batch along dimension 0"):
        load_workload("user_models:scalar_out")


def test_zero_stages_that_use_fully_shard_refuse_a_parameter_with_no_dimension():
    """torch's fully_shard raises on a 0-dim parameter (two_heads' temperature): ZeRO-2/3 plans are
    infeasible with the fix in the message; ZeRO-1 (ZeroRedundancyOptimizer) is not."""
    import strategies
    from hetsim.errors import InfeasiblePlanError
    from hetsim.testing.contract import structural_cost
    from strategies.zero import ZeROPlan

    cost = structural_cost("user_models:two_heads")
    assert sum(b.scalar_params for b in cost.base_profile.blocks) == 1
    zero = strategies.get("zero")
    for stage in (2, 3):
        with pytest.raises(InfeasiblePlanError, match="no dimension.*torch.ones\\(1\\)"):
            zero.validate(ZeROPlan(devices=(0, 1), local_batch=(4, 4), zero_stage=stage), cost)
    zero.validate(ZeROPlan(devices=(0, 1), local_batch=(4, 4), zero_stage=1), cost)
    from hetsim.search.calib_dataparallel import uniform_plan

    # calibration skips those stages instead of stopping the search
    assert uniform_plan(zero, cost, 8, 3) is None and uniform_plan(zero, cost, 8, 2) is None
    assert uniform_plan(zero, cost, 8, 1) is not None


@pytest.mark.parametrize("name, own_size", [("vit_tiny_patch16_224", False), ("resnet18", True)])
def test_timm_models_take_the_image_size_and_workers_rebuild_them_from_the_spec(name, own_size):
    """`timm:NAME` at --image-size: a ViT is built for it (`img_size=`), a ResNet (no such argument)
    just takes it.  The spec states the size, so a worker's rebuild from it has the same blocks and
    weights, and the blocks in a chain compute the model."""
    pytest.importorskip("timm")
    wl = load_workload(f"timm:{name}", image_size=32)
    assert wl.spec == f"timm:{name}@32" and wl.image_size == 32 and "32x32 px" in wl.about
    x, y = wl.make_batch(3, 1)
    assert x.shape == (3, 3, 32, 32) and y.shape == (3,)
    again = workload_from_spec(wl.spec)
    a, b = wl.model(), again.model()
    assert [n for n, _ in a.named_children()] == [n for n, _ in b.named_children()]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert len(list(a.named_children())) > 2
    assert wl.has_batchnorm == own_size  # the ResNet has BatchNorm, the ViT LayerNorm
    import timm

    torch.manual_seed(0)
    kw = {} if own_size else {"img_size": 32}
    ref = timm.create_model(name, pretrained=False, **kw).eval()
    with torch.no_grad():
        assert torch.allclose(a.eval()(x), ref(x), atol=1e-5)


def test_timm_size_that_the_model_cannot_take_is_one_error_with_the_fix():
    pytest.importorskip("timm")
    with pytest.raises(ConfigError, match=r"timm:vit_tiny_patch16_224@8.*8x8 input.*--image-size 224"):
        load_workload("timm:vit_tiny_patch16_224@8")
    with pytest.raises(ConfigError, match=r"'x64' after '@' is not an image size.*--image-size 64"):
        load_workload("timm:resnet18@x64")
    with pytest.raises(ConfigError, match="timm has no model 'resnet19'.*similar"):
        load_workload("timm:resnet19")


def test_runs_as_long_as_the_longest_are_cut_too_and_nested_ones_are_not():
    """user_models:autoencoder: the decoder list is as long as the encoder list, so both are cut (the
    rule had kept the first run only: the three decoder layers were one block); the three-Linear
    Sequentials inside them are as long, but nested, so nothing cuts inside a layer."""
    wl = load_workload("user_models:autoencoder")
    names = [n for n, _ in wl.model().named_children()]
    assert names == ["0_enc_0", "1_enc_1", "2_enc_2", "3_dec_0", "4_dec_1", "5_dec_2"]
    from user_models import autoencoder

    x, y = wl.make_batch(4, 2)
    torch.manual_seed(0)
    own = autoencoder().module
    with torch.no_grad():
        assert torch.allclose(wl.model()(x), own(x), atol=1e-6)
    assert torch.allclose(wl.loss_sum(wl.model()(x), y), nn.MSELoss()(own(x), y) * 4, atol=1e-5)


class _Rotary(nn.Module):
    """A user's transformer written as many are: a functional norm before each layer call, a rotary
    table kept as one buffer on the model and sliced for every layer, a causal mask built from a
    literal length, a residual add after the call."""

    def __init__(self, d=8, t=5):
        super().__init__()
        self.emb = nn.Embedding(30, d)
        ang = torch.outer(torch.arange(t).float(), torch.ones(d))
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        h = self.emb(ids)
        mask = torch.tril(torch.ones(5, 5))
        for layer in self.layers:
            r = F.layer_norm(h, h.shape[-1:]) * self.cos[:5]
            h = h + torch.tanh(layer(mask @ r))
        return self.head(h.mean(1))


def test_functional_work_before_a_layer_and_tables_built_from_buffers_do_not_forbid_its_cuts():
    """Before: the cut before each layer call was crossed by the residual and the normed input, so the
    model ran as two blocks (the layers and the head).  Now each cut goes at the last point before the
    call where one value is live; fx records the sliced buffer and the mask as constants, which every
    block that reads them holds.  The chain computes what the module does."""
    net, x = _Rotary(), torch.randint(0, 30, (2, 5))
    split = split_module(net, x, "rotary")
    assert [n for n, _ in split.blocks] == ["0_emb", "1_layers_0", "2_layers_1", "3_layers_2", "4_layers_3", "5_head"]
    assert split.between_layers == 3 and not split.notes
    assert all(any(n.op == "get_attr" for n in b.graph.nodes) for _, b in split.blocks[1:5])
    with torch.no_grad():
        assert torch.allclose(_chain(split, x), net(x), atol=1e-6)


def test_a_mask_beside_the_hidden_state_is_packed_across_the_cuts_and_an_integer_one_is_not():
    """A padding mask built from the ids crosses every cut between the layers with the hidden state.
    Before: no cut held and the model was cut between its top-level children (two blocks).  Now the
    two values cross each cut packed into one tensor (the bool mask as 0/1) and unpacked by the next
    block; an integer value crossing (positions) is not packed (a float carries large integers
    inexactly), so that model keeps the old split, with its note."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))
    from user_models import masked_encoder

    um = masked_encoder()
    x, _ = um.make_batch(3, 0)
    split = split_module(um.module, x, "masked")
    assert [n for n, _ in split.blocks] == ["0_tok", "1_layers_0", "2_layers_1", "3_layers_2", "4_head"]
    assert "packed into one tensor" in split.notes[-1]
    assert split.blocks[1][1](split.blocks[0][1](x)).shape == (3, 6 * 8 + 6)
    with torch.no_grad():
        assert torch.allclose(_chain(split, x), um.module(x), atol=1e-6)

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(30, 8)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 2)

        def forward(self, ids):
            pos = ids % 5
            h = self.tok(ids)
            for layer in self.layers:
                h = h + layer(h) * pos.unsqueeze(-1)
            return self.head(h.mean(1))

    split = split_module(Positions(), x, "positions")
    assert len(split.blocks) <= 2 and "more than one value" in split.notes[-1]
