"""Plain nn.Modules of kinds hetsim has no built-in for, each returned the way a user would write it
(for `--model user_models:NAME` with this folder on PYTHONPATH, and for the cut-point unit tests)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hetsim.workloads import UserModel


class ListMLP(nn.Module):
    """An MLP whose hidden layers live in a ModuleList, looped over in forward."""

    def __init__(self, d_in: int = 24, width: int = 48, depth: int = 5, classes: int = 7):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.hidden = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x):
        x = F.relu(self.inp(x))
        for layer in self.hidden:
            x = layer(x)
        return self.out(x)


def list_mlp():
    def make(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 24, generator=g), torch.randint(0, 7, (n,), generator=g)

    return UserModel(module=ListMLP(), make_batch=make, loss=nn.CrossEntropyLoss())


class TiedLM(nn.Module):
    """A small pre-norm transformer LM whose output projection is its token embedding (tied)."""

    def __init__(self, vocab: int = 97, d: int = 32, layers: int = 3, seq: int = 12):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, ids):
        h = self.emb(ids) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.norm(h) @ self.emb.weight.t()


def tied_lm():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (16, 13), generator=g)
    return UserModel(module=TiedLM(), example_batch=(ids[:, :-1], ids[:, 1:]),
                     loss=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))


def seq_cnn():
    """A CNN written as one nn.Sequential, returned as a tuple (module, batch maker, loss)."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(16, 5))

    def make(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 5, (n,), generator=g)

    return net, make, nn.CrossEntropyLoss()


class SkipNet(nn.Module):
    """A forward that is not a chain: the input itself jumps over every block to the head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(10, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.head = nn.Linear(42, 3)

    def forward(self, x):
        s = self.stem(x)
        h = s
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(torch.cat([h, x], dim=1))


def skip_net():
    """A plain module with its batch and loss as attributes of the function."""
    return SkipNet()


class SkipAll(SkipNet):
    """The input jumps over every cut, the head's too: nothing to cut at."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 3)
        self.skip = nn.Linear(10, 3)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(h) + self.skip(x)


def skip_all():
    return SkipAll()


skip_net.example_batch = (torch.randn(8, 10, generator=torch.Generator().manual_seed(1)),
                          torch.arange(8) % 3)
skip_net.loss = nn.CrossEntropyLoss()
skip_all.example_batch, skip_all.loss = skip_net.example_batch, skip_net.loss


def bad_shapes():
    return UserModel(module=ListMLP(), make_batch=lambda n, seed: (torch.randn(n + 1, 24), torch.zeros(n, dtype=torch.long)))


def bad_loss():
    return UserModel(module=ListMLP(), make_batch=lambda n, seed: (torch.randn(n, 24), torch.zeros(n, dtype=torch.long)),
                     loss=lambda out, y: F.cross_entropy(out, y, reduction="none"))


def two_inputs():
    """A batch maker that gives two input tensors: refused with the fix (stack them into one)."""
    return UserModel(module=ListMLP(), make_batch=lambda n, seed: ((torch.randn(n, 12), torch.randn(n, 12)),
                                                                    torch.zeros(n, dtype=torch.long)))


def broken():
    raise RuntimeError("this model fails to build")


class ScriptedStem(nn.Module):
    """A stem compiled with torch.jit.script before a list of layers."""

    def __init__(self):
        super().__init__()
        self.stem = torch.jit.script(nn.Sequential(nn.Linear(6, 6), nn.ReLU()))
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def scripted_stem():
    return UserModel(module=ScriptedStem(), make_batch=lambda n, seed: (
        torch.randn(n, 6, generator=torch.Generator().manual_seed(seed)), torch.arange(n) % 2))


def too_large():
    """A 30B-parameter stack: refused from its size counted on the meta device, before it is built.  (Built
    for real it would need 112 GiB: this asset refuses that, so a broken check fails instead of swapping.)"""
    if torch.empty(0).device.type != "meta":
        raise RuntimeError("user_models:too_large is only ever built on the meta device")
    return UserModel(module=nn.Sequential(*[nn.Linear(16384, 16384) for _ in range(112)]),
                     make_batch=lambda n, seed: (torch.randn(n, 16384), torch.zeros(n, dtype=torch.long)))


def sparse_bag():
    """A bag-of-words classifier whose EmbeddingBag makes sparse gradients: refused before anything is measured."""
    module = nn.Sequential(nn.EmbeddingBag(50, 8, sparse=True), nn.Linear(8, 3))
    return UserModel(module=module, make_batch=lambda n, seed: (torch.randint(0, 50, (n, 5)), torch.zeros(n, dtype=torch.long)))


class LSTMLM(nn.Module):
    """A recurrent language model: nn.LSTM returns (output, (h, c)) and, batch first, gives its input a
    non-contiguous gradient."""

    def __init__(self, vocab: int = 64, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.lstm2 = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        h, _ = self.lstm2(h)
        return self.head(h)


def lstm_lm():
    def make(n, seed):
        x = torch.randint(0, 64, (n, 6), generator=torch.Generator().manual_seed(seed))
        return x, torch.roll(x, -1, dims=1)

    return UserModel(module=LSTMLM(), make_batch=make,
                     loss=lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)))


class TwoHeads(nn.Module):
    """Returns a dict (logits scaled by a learnable scalar temperature, and an auxiliary regression
    output): not one tensor, and a parameter with no dimension."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(12, 12) for _ in range(3))
        self.cls = nn.Linear(12, 4)
        self.aux = nn.Linear(12, 2)
        self.temp = nn.Parameter(torch.ones(()))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return {"logits": self.cls(x) * self.temp, "aux": self.aux(x)}


def two_heads():
    def make(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g)

    return UserModel(module=TwoHeads(), make_batch=make,
                     loss=lambda out, y: F.cross_entropy(out["logits"], y) + out["aux"].pow(2).mean())


def scalar_out():
    """A module whose output holds a scalar (a regulariser computed in forward): refused, loss's job."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(12, 4)

        def forward(self, x):
            y = self.lin(x)
            return y, y.pow(2).mean()

    def make(n, seed):
        return torch.randn(n, 12), torch.zeros(n, dtype=torch.long)

    return UserModel(module=Net(), make_batch=make, loss=lambda out, y: F.cross_entropy(out[0], y) + out[1])


class Tagger(nn.Module):
    """A per-position tagger whose forward starts and ends with parts that hold no parameters (a flip of
    its input, the class dimension moved second for cross_entropy): each joins its neighbour."""

    def __init__(self, d: int = 4, tags: int = 5):
        super().__init__()
        self.inp = nn.Linear(d, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, tags)

    def forward(self, x):
        h = torch.relu(self.inp(x.flip(1)))
        return self.head(torch.relu(self.mid(h))).transpose(1, 2)


def tagger():
    def make(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 6, 4, generator=g), torch.randint(0, 5, (n, 6), generator=g)

    return UserModel(module=Tagger(), make_batch=make, loss=nn.CrossEntropyLoss())


class FrozenStem(nn.Module):
    """Fine-tuning on a fixed stem: its parameters do not require gradients (a part with nothing to train,
    joined to the block after it), the blocks after it train."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.stem.requires_grad_(False)
        self.body = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.stem(x)
        for layer in self.body:
            h = layer(h)
        return self.head(h)


def frozen_stem():
    g = torch.Generator().manual_seed(0)
    return FrozenStem(), (torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)), F.cross_entropy


class AutoEncoder(nn.Module):
    """An encoder list and a decoder list of equal length, each layer an nn.Sequential of three Linear
    (a run as long as the lists, nested inside them): cut before every encoder and decoder layer."""

    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList([nn.Sequential(nn.Linear(d, 6), nn.Linear(6, 6), nn.Linear(6, d - 2))
                                  for d in (16, 14, 12)])
        self.dec = nn.ModuleList([nn.Sequential(nn.Linear(d, 6), nn.Linear(6, 6), nn.Linear(6, d + 2))
                                  for d in (10, 12, 14)])

    def forward(self, x):
        for layer in self.enc:
            x = torch.tanh(layer(x))
        for layer in self.dec:
            x = layer(x)
        return x


def autoencoder():
    def make(n, seed):
        x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
        return x, x.clone()

    return UserModel(module=AutoEncoder(), make_batch=make, loss=nn.MSELoss())


class PreNormLM(nn.Module):
    """A decoder written as many users write one: the norm applied functionally in the model's own loop
    before each layer call, a rotary-style table held as one buffer on the model, causal attention
    through scaled_dot_product_attention and a residual add after the call."""

    def __init__(self, vocab=40, d=16, t=6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.register_buffer("rot", torch.outer(torch.arange(t).float(), torch.ones(d)).cos(), persistent=False)
        self.layers = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(3))
        self.out = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.tok(ids)
        for layer in self.layers:
            b, t, d = h.shape
            q, k, v = layer(F.rms_norm(h, (d,)) * self.rot).view(b, t, 3, 2, d // 2).transpose(1, 3).unbind(2)
            h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return self.out(F.rms_norm(h, (h.shape[-1],)))


def prenorm_lm():
    def make(n, seed):
        ids = torch.randint(0, 40, (n, 7), generator=torch.Generator().manual_seed(seed))
        return ids[:, :-1], ids[:, 1:]

    return UserModel(module=PreNormLM(), make_batch=make,
                     loss=lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)))


def with_cache(reads_cache: bool = False):
    """A module returning a dict with its logits, None for a loss it was not asked for, and a count (as a
    Hugging Face causal LM returns a key-value cache object beside its logits): the entries that are not
    tensors are dropped between stages; a loss that reads them is refused."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(12, 12) for _ in range(3))
            self.head = nn.Linear(12, 4)

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return {"logits": self.head(x), "loss": None, "past": len(self.layers)}

    def make(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g)

    def loss(out, y):
        return F.cross_entropy(out["logits"], y) + (0.0 if not reads_cache else out["past"])

    return UserModel(module=Net(), make_batch=make, loss=loss)


def cache_read():
    return with_cache(reads_cache=True)


class MaskedEncoder(nn.Module):
    """An encoder that builds a padding mask from its token ids and hands it to every layer with the
    hidden state (how many users write one): two values cross every cut between its layers."""

    def __init__(self, vocab=30, d=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.head = nn.Linear(d, 2)

    def forward(self, ids):
        keep = (ids != 0).unsqueeze(-1)
        h = self.tok(ids)
        for layer in self.layers:
            h = h + torch.where(keep, torch.tanh(layer(h)), 0.0)
        return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1))


def masked_encoder():
    def make(n, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 30, (n, 6), generator=g)
        ids[:, -2:] = 0  # padding
        return ids, torch.randint(0, 2, (n,), generator=g)

    return UserModel(module=MaskedEncoder(), make_batch=make, loss=nn.CrossEntropyLoss())
