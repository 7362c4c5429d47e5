"""The cut-point finder (`hetsim.workloads.cutpoints`): where a plain module is split into blocks, what
crosses each cut, and when it falls back to fewer blocks with a note (no live runs: forward passes in
this process, each split checked against the module's own output)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetsim.workloads.cutpoints import merge_tied_blocks, split_module

pytestmark = pytest.mark.usefixtures("user_assets")  # tests/assets importable as user_models


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


def _trainable(blocks) -> set[int]:
    return {id(p) for _, b in blocks for p in b.parameters() if p.requires_grad}


def test_a_torchscript_child_is_kept_whole_with_its_parameters():
    """fx traced into a ScriptModule's forward as one opaque call that holds none of its parameters: its
    block would have computed with them and never trained them (found by a sweep of user modules)."""
    from user_models import ScriptedStem

    net = ScriptedStem()
    split = split_module(net, torch.randn(2, 6), "net")
    assert [n for n, _ in split.blocks][:2] == ["0_stem", "1_layers_0"] and len(split.blocks) == 5
    assert _trainable(split.blocks) == {id(p) for p in net.parameters()}


def test_a_split_whose_blocks_would_not_train_a_parameter_is_refused(monkeypatch):
    """Whatever keeps a parameter out of every block (here: a ScriptModule traced into, as before the fix
    above), the split is not taken: the next candidate that holds every parameter is."""
    from torch import fx

    from hetsim.workloads import cutpoints

    def traced_into(self, m, qualname):
        return qualname in self.leaves or (not isinstance(m, torch.jit.ScriptModule) and
                                          fx.Tracer.is_leaf_module(self, m, qualname))
    monkeypatch.setattr(cutpoints._Tracer, "is_leaf_module", traced_into)
    from user_models import ScriptedStem

    net = ScriptedStem()
    split = split_module(net, torch.randn(2, 6), "net")
    assert _trainable(split.blocks) == {id(p) for p in net.parameters()}
    assert any("would not train 2 of its parameters (stem.0.weight" in n for n in split.notes)
