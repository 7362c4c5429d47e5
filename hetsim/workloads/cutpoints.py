"""Cut points of a plain nn.Module: split it into a chain of blocks that each take one tensor.

The rule: trace the module's forward with torch.fx, keeping as single calls the children (those that
hold parameters) of the container whose children repeat one class most often (a ModuleList,
nn.Sequential or ModuleDict of layers; any other container as repeated, such as a decoder beside its
encoder; the next container when none of the cuts between that one's layers holds; else the
top-level children).  A cut goes between each such block and the next, at the last point before the
next one's call (the first call inside it for a ModuleDict layer) where exactly one value flows
across (a residual or a second input that jumps over every such point forbids it; functional work
before the call, such as a norm, does not), and after the last one at the first such point; where no
cut between two layers holds so, up to four float or bool values with the batch first cross a cut
packed into one tensor (a padding mask beside the hidden state).  Blocks that share a parameter (tied
weights) are merged, with everything between them, so tied parameters stay on one stage.  A block
with no trainable parameters joins its neighbour (a stage of it alone would have nothing to train).
The chain is checked against the module's own output on an example batch.  A run that cannot be cut
so (inside a torch.nn module whose forward fx cannot trace, such as nn.TransformerEncoder) leaves the
top-level children to cut between; whatever cannot be split either way runs as one block (data
parallel and ZeRO only), with a note saying which module and why.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    blocks: tuple[tuple[str, nn.Module], ...]
    notes: tuple[str, ...] = ()
    why_whole: str = ""
    """Why it runs as one block (empty when it was split)."""
    between_layers: int = 0
    """Cuts between two of the kept calls (the layers of the run), not before the first or after the last."""


MOST_CANDIDATES = 8
"""Containers tried, most repeated first, before the top-level children."""
MOST_PACKED = 4
"""Most values a cut hands on packed into one tensor."""
CROSSED = ("every cut between its child blocks is crossed by more than one value (a skip connection or a second "
           "input jumps over it)")


def repeated_runs(module: nn.Module) -> list[tuple[str, list[str]]]:
    """Candidate cut sets, best first: (container path, child paths) of the containers whose children
    repeat one class most often, or [] when no container holds two modules of one class.  Containers
    as repeated as the best, not inside it (an autoencoder's encoder and decoder lists), add their
    children to it: the path is the first one's.

    A container is a ModuleList, an nn.Sequential or a ModuleDict (layers by name).  Its score is how
    many of its children that hold parameters share the commonest class; the child paths are all of its
    children that hold parameters (a stem, a last convolution, the batch norms between a VGG's
    convolutions).  torchvision's MobileNetV3 keeps its eleven inverted residual blocks between a stem
    and a last convolution in one `features` Sequential, SqueezeNet its eight Fire modules between
    max-pools: with only containers whose children were all of one class, MobileNetV3's best was the
    three convolutions inside one block (5 blocks, most of the model in the first), SqueezeNet's
    `features` and a VGG's were one block."""
    scored: list[tuple[int, str, list[str]]] = []
    for path, mod in module.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        members = [(n, kid) for n, kid in mod.named_children() if next(kid.parameters(), None) is not None]
        score = max(Counter(type(kid) for _, kid in members).values(), default=0)
        if score >= 2:
            scored.append((score, path, [f"{path}.{n}" if path else n for n, _ in members]))
    out: list[tuple[str, list[str]]] = []
    for score in sorted({sc for sc, _, _ in scored}, reverse=True):
        tied = [(p, kids) for sc, p, kids in scored if sc == score]
        keep = [(p, kids) for p, kids in tied if not any(q != p and (not q or p.startswith(q + ".")) for q, _ in tied)]
        out.append((keep[0][0], [c for _, kids in keep for c in kids]))
    return out


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaves:
            return True
        if any(leaf.startswith(qualname + ".") for leaf in self.leaves):
            return False  # a torch.nn module holding the run (nn.TransformerEncoder's layers): traced into
        if isinstance(m, torch.jit.ScriptModule):
            return True  # traced into, its forward would be one opaque call that drops its parameters
        return super().is_leaf_module(m, qualname)


def _valid_cuts(root: nn.Module, graph: fx.Graph, anchors: set[str], batched: Callable[[], set[fx.Node]]
                ) -> tuple[list[fx.Node], bool, list[int], range, dict[int, tuple[fx.Node, ...]]]:
    """The graph's compute nodes, whether any anchor is called, the valid cuts, the positions between
    the anchors' first and last call, and the values packed across each cut that hands on more than one.  A cut may go where one value (not a parameter
    or constant read) is live, or, when no cut between two layers holds so, up to `MOST_PACKED` values
    that `batched()` says are float or bool tensors with the batch first (a padding mask beside the
    hidden state), fewest first.  In the stretch between one anchor's calls and the next anchor's first
    call it goes at the last such position, so that functional work before a layer call
    (`x + layer(F.layer_norm(x, ...))`) does not forbid the cut; after the last anchor at the first one
    (after its residual add), up to the next module call."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    pos = {n: i for i, n in enumerate(nodes)}
    spans = sorted((min(idx), max(idx)) for a in anchors if (idx := [i for i, n in enumerate(nodes) if _within(n, a)]))
    if not spans:
        return nodes, False, [], range(0), {}
    last_use = {}
    for n in graph.nodes:
        for user in n.users:
            last_use[n] = max(last_use.get(n, -1), pos.get(user, len(nodes)))
    # live[c]: compute nodes before position c used at or after it (each live over i+1..last use)
    starts = [0] * (len(nodes) + 2)
    for i, n in enumerate(nodes):
        if last_use.get(n, -1) > i:
            starts[i + 1] += 1
            starts[last_use[n] + 1] -= 1
    live = list(itertools.accumulate(starts))
    input_live = max((last_use.get(n, -1) for n in graph.nodes if n.op == "placeholder"), default=-1)

    def crossing(c: int, most: int) -> tuple[fx.Node, ...] | None:
        """What a cut at c hands on (() for the one live value), or None where no cut may go.  A stage may
        not start with an in-place op (autograd refuses to modify its input leaf in place)."""
        if not (0 < c < len(nodes) and 1 <= live[c] <= most and input_live < c) or _inplace(root, nodes[c]):
            return None
        if live[c] == 1:
            return ()
        vals = tuple(n for n in nodes[:c] if last_use.get(n, -1) >= c)
        return vals if set(vals) <= batched() else None

    def cuts(most: int) -> list[int]:
        def pick(positions: Iterable[int], later_first: bool) -> list[int]:
            ok = [c for c in positions if crossing(c, most) is not None]
            return [min(ok, key=lambda c: (live[c], -c if later_first else c))] if ok else []

        out = []
        for k, (start, _) in enumerate(spans):
            out += pick(range(spans[k - 1][1] + 1 if k else 1, start + 1), later_first=True)
        end = spans[-1][1] + 1  # after the last: up to the next module call (a head) at the latest
        stop = next((i for i in range(end, len(nodes)) if nodes[i].op == "call_module"), len(nodes) - 1)
        return sorted(set(out + pick(range(end, stop + 1), later_first=False)))

    inner = range(spans[0][0] + 1, spans[-1][0] + 1)
    valid = cuts(1)
    if not any(c in inner for c in valid):  # packed values only where no layer can be cut from the next otherwise
        valid = cuts(MOST_PACKED)
    return nodes, True, valid, inner, {c: vals for c in valid if (vals := crossing(c, MOST_PACKED))}


def _batched_values(module: nn.Module, graph: fx.Graph, example: torch.Tensor) -> set[fx.Node]:
    """Nodes whose value, run on `example` with one more sample, is a float or bool tensor with the batch
    along dimension 0 (module state restored after)."""
    x = torch.cat([example, example[:1]])
    with _buffers_restored(module), torch.no_grad(), torch.random.fork_rng():
        ShapeProp(fx.GraphModule(module, graph)).propagate(x)
    out = set()
    for n in graph.nodes:
        meta = n.meta.get("tensor_meta")
        if (isinstance(meta, TensorMetadata) and len(meta.shape) > 0 and meta.shape[0] == x.shape[0]
                and (meta.dtype.is_floating_point or meta.dtype == torch.bool)):
            out.add(n)
    return out


@fx.wrap
def pack_values(*values: torch.Tensor) -> torch.Tensor:
    """Values that cross one cut, as one tensor: each flattened per sample, side by side, in the first
    floating dtype among them (bool masks become 0/1)."""
    dtype = next((v.dtype for v in values if v.is_floating_point()), torch.float32)
    return torch.cat([v.reshape(v.shape[0], -1).to(dtype) for v in values], dim=1)


def per_sample_parts(packed: torch.Tensor, shapes) -> list[torch.Tensor]:
    """A tensor of values flattened per sample side by side (`pack_values`, `usermodel._Packing`) split
    back into them, each of its per-sample shape."""
    parts = torch.split(packed, [math.prod(s) for s in shapes], dim=1)
    return [p.reshape(packed.shape[0], *s) for p, s in zip(parts, shapes, strict=True)]


@fx.wrap
def unpack_values(packed: torch.Tensor, shapes: tuple[tuple[int, ...], ...], bools: tuple[bool, ...]):
    """`pack_values` undone: the values' per-sample shapes, bool ones made bool again."""
    return tuple(p != 0 if b else p for p, b in zip(per_sample_parts(packed, shapes), bools, strict=True))


def _within(n: fx.Node, path: str) -> bool:
    """n calls the module at `path` or one inside it (a ModuleDict layer is never called itself)."""
    return n.op == "call_module" and (n.target == path or str(n.target).startswith(path + "."))


def _inplace(root: nn.Module, node: fx.Node) -> bool:
    if node.op == "call_module":
        return bool(getattr(root.get_submodule(node.target), "inplace", False))
    return node.op == "call_method" and str(node.target).endswith("_") or bool(node.kwargs.get("inplace"))


def _segment(root: nn.Module, graph: fx.Graph, nodes: list[fx.Node], lo: int, hi: int,
             packed: dict[int, tuple[fx.Node, ...]]) -> fx.GraphModule:
    """Nodes[lo:hi] as a module of one input (the value flowing in, or the values `packed` at lo) and one
    output (likewise at hi)."""
    seg = set(nodes[lo:hi])
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    x = g.placeholder("x")
    if lo in packed:
        metas = [v.meta["tensor_meta"] for v in packed[lo]]
        parts = g.call_function(unpack_values, (x, tuple(tuple(m.shape[1:]) for m in metas),
                                                tuple(m.dtype == torch.bool for m in metas)))
        for k, v in enumerate(packed[lo]):
            env[v] = g.call_function(operator.getitem, (parts, k))
    for a in (a for n in nodes[lo:hi] for a in n.all_input_nodes if a not in seg and a.op != "get_attr"):
        env.setdefault(a, x)
    for n in nodes[lo:hi]:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = g.node_copy(a, lambda m: env[m])
        env[n] = g.node_copy(n, lambda m: env[m])
    if hi in packed:
        g.output(g.call_function(pack_values, tuple(env[v] for v in packed[hi])))
        return fx.GraphModule(root, g)
    if hi < len(nodes):  # the one value that crosses the cut (not an unused value such as an LSTM's (h, c))
        out = next((n for n in reversed(nodes[lo:hi]) if any(u not in seg for u in n.users)), nodes[hi - 1])
    else:
        out = next(n for n in graph.nodes if n.op == "output").args[0]
    if isinstance(out, fx.Node):  # a stage that hands on a view breaks the zero-bubble pipeline schedules
        g.output(g.call_function(own_storage, (env[out],)))
    else:
        g.output(env[out] if isinstance(out, fx.Node) else fx.map_arg(out, lambda m: env[m]))
    return fx.GraphModule(root, g)


@fx.wrap
def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied when it is a view of another tensor (torch's zero-bubble schedules refuse a
    stage output that is a view); a tensor that owns its storage passes unchanged."""
    return t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t


def _merge_tied(bounds: list[int], blocks: list[fx.GraphModule]) -> list[int]:
    """Drop the cuts between blocks that share a parameter (and every block between them)."""
    owner: dict[int, int] = {}
    drop: set[int] = set()
    for k, b in enumerate(blocks):
        for p in b.parameters():
            first = owner.setdefault(id(p), k)
            drop.update(range(first + 1, k + 1))  # the cut before block j is bounds[j]
    return [b for j, b in enumerate(bounds) if j not in drop]


def _merge_parameterless(bounds: list[int], blocks: list[fx.GraphModule]) -> tuple[list[int], fx.GraphModule | None]:
    """Drop the cut that leaves a block without trainable parameters on its own (an output's transpose
    after the last layer): it joins the block before it, the first block the one after it.  A pipeline
    stage holding only such a block would have nothing to train, and torch's optimizers refuse an empty
    parameter list.  One block at a time (with the block that joined); the bounds unchanged, and None,
    when every block trains something."""
    for k, b in enumerate(blocks):
        if len(blocks) > 1 and not any(p.requires_grad for p in b.parameters()):
            j = k if k > 0 else 1  # the cut before block j is bounds[j]
            return bounds[:j] + bounds[j + 1:], b
    return bounds, None


def split_module(module: nn.Module, example: torch.Tensor, name: str) -> Split:
    """Blocks of `module` for one input tensor `example` (see the module docstring): between the children
    of its most repeated container (`repeated_runs`), else between its top-level children.  A container
    none of whose cuts between its layers holds (DenseNet's dense blocks: every cut inside is crossed by
    the list of earlier outputs, so only the cuts before and after the block hold) gives way to the next
    one, up to `MOST_CANDIDATES`; when none can be cut between its layers, the containers are tried again
    with several values packed across a cut, and then the top-level children; of those, the split with
    the most blocks is kept."""
    children = [n for n, _ in module.named_children()]
    first, best = _containers(module, example, name, pack=False)
    if first is None:
        return _split_at(module, example, name, set(children))
    if not best[1].between_layers:  # values packed across the cuts (a mask beside the hidden state)
        _, packed = _containers(module, example, name, pack=True)
        best = packed if packed[1].between_layers else best
    why = first[1].why_whole or CROSSED
    if best[1].between_layers or len(children) < 2:
        if best[0] == first[0]:  # also every split of one block: a later one replaces first only with more
            return best[1]
        return Split(blocks=best[1].blocks, between_layers=best[1].between_layers, notes=best[1].notes + (
            f"{name}: cut between the children of {best[0]}, not between the layers of {first[0]} ({why})",))
    # No container's layers could be cut (nn.TransformerEncoder's forward is not traceable, a skip
    # connection jumps over them ...): the top-level children may still be (embedding, encoder, head).
    top = _split_at(module, example, name, set(children))
    if max(len(top.blocks), len(best[1].blocks)) == 1:
        return first[1]
    if len(top.blocks) >= len(best[1].blocks):
        return Split(blocks=top.blocks, notes=top.notes + (
            f"{name}: cut between its top-level children only, not between the layers of {first[0]} ({why})",))
    return Split(blocks=best[1].blocks, notes=best[1].notes + (
        f"{name}: cut before and after the layers of {best[0]} only, not between them ({why})",))


def _containers(module: nn.Module, example: torch.Tensor, name: str, pack: bool
                ) -> tuple[tuple[str, Split] | None, tuple[str, Split] | None]:
    """(the most repeated container and its split, the container whose split is kept): the first whose
    split cuts between its layers, else the one with the most blocks."""
    best: tuple[str, Split] | None = None
    first: tuple[str, Split] | None = None
    for path, run in repeated_runs(module)[:MOST_CANDIDATES]:
        split = _split_at(module, example, name, set(run), pack)
        first = first or (path, split)
        if best is None or (split.between_layers > 0, len(split.blocks)) > (best[1].between_layers > 0,
                                                                            len(best[1].blocks)):
            best = (path, split)
        if split.between_layers:
            break
    return first, best


def _split_at(module: nn.Module, example: torch.Tensor, name: str, leaves: set[str], pack: bool = False) -> Split:
    """`module` cut before each call of the modules `leaves` (kept whole) and after the last one; with
    `pack`, also where several values that pack into one tensor cross (`_valid_cuts`)."""
    whole = Split(blocks=((name, module),))
    try:
        graph = _Tracer(leaves).trace(module, concrete_args=_defaults(module))
    except Exception as e:  # any Python fx cannot follow (data-dependent control flow, *args)
        hf = type(module).__module__.startswith("transformers.")
        return _fallback(whole, name, f"torch.fx cannot trace its forward ({type(e).__name__}: {_short(e)})",
                         FIX + ("; a Hugging Face model is cut into its layers by --model hf:NAME?layers=N&hidden=N "
                                "(README, Models)" if hf else ""))
    _drop_guards(graph)
    if sum(n.op == "placeholder" for n in graph.nodes) != 1:
        return _fallback(whole, name, "its forward takes more than one input")
    batched = functools.cache(lambda: _batched_values(module, graph, example) if pack else set())
    nodes, anchored, valid, inner, packed = _valid_cuts(module, graph, leaves, batched)
    if not valid:
        why = CROSSED if anchored else "no repeated child blocks or children to cut between"
        return _fallback(whole, name, why)
    bounds = [0] + valid + [len(nodes)]
    tied, idle = False, []
    for _ in range(len(bounds)):  # merging can make new shared parameters adjacent: repeat until stable
        segs = [_segment(module, graph, nodes, a, b, packed) for a, b in zip(bounds, bounds[1:])]
        merged = _merge_tied(bounds, segs)
        tied = tied or merged != bounds
        if merged == bounds:
            merged, joined = _merge_parameterless(bounds, segs)
            idle += [_ops(joined)] if joined is not None else []
        if merged == bounds:
            break
        bounds = merged
    notes = []
    if len(segs) == 1:
        if idle and not tied:
            return _fallback(whole, name, "only one of its parts holds trainable parameters")
        return _fallback(whole, name, "parameters shared by its first and last parts (tied weights) would be "
                                      "cut apart by every split", "to pipeline it, untie them (give the output "
                                      "projection its own weight)")
    if tied:
        notes.append(f"{name}: blocks sharing parameters (tied weights) were kept on one stage")
    if any(b in packed for b in bounds):
        most = max(len(packed.get(b, ())) for b in bounds)
        notes.append(f"{name}: {sum(b in packed for b in bounds)} cuts hand on up to {most} values packed into one "
                     "tensor (a mask or a second stream beside the hidden state)")
    if idle:
        notes.append(f"{name}: {'; '.join(idle)}: no trainable parameters, so joined to the neighbouring block (a "
                     "pipeline stage of that alone would have nothing to train)")
    problem = _check_chain(module, segs, example)
    if problem:
        return _fallback(whole, name, problem)
    return Split(blocks=tuple((_block_name(seg, k), seg) for k, seg in enumerate(segs)), notes=tuple(notes),
                 between_layers=sum(b in inner for b in bounds))


def _drop_guards(graph: fx.Graph) -> None:
    """Remove the arguments fixed at their defaults: fx keeps them as placeholders checked by guards."""
    def guard(n: fx.Node) -> bool:  # n only feeds checks (`x == default`, then an assert)
        if n.op == "call_function" and "assert" in getattr(n.target, "__name__", ""):
            return True
        return n.op == "call_function" and bool(n.users) and all(guard(u) for u in n.users)

    for ph in [n for n in graph.nodes if n.op == "placeholder"][1:]:
        if all(guard(u) for u in ph.users):
            doomed = [n for n in graph.nodes if n is ph or _feeds_only(n, ph, guard)]
            for n in reversed(doomed):
                graph.erase_node(n)


def _feeds_only(n: fx.Node, ph: fx.Node, guard) -> bool:
    return guard(n) and all(a is ph or _feeds_only(a, ph, guard) for a in n.all_input_nodes)


def _defaults(module: nn.Module) -> dict[str, object]:
    """Arguments after the first that have defaults (masks, flags): fixed at their defaults."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _block_name(seg: fx.GraphModule, k: int) -> str:
    calls = [n.target for n in seg.graph.nodes if n.op == "call_module"]
    label = calls[0].replace(".", "_") if len(calls) == 1 else f"part{k}"
    return f"{k}_{label}"


def _ops(seg: fx.GraphModule, most: int = 3) -> str:
    """The operations of a block, for a message: 'the part (transpose)'."""
    ops = [n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
           for n in seg.graph.nodes if n.op in ("call_function", "call_method", "call_module")
           and n.target is not own_storage]
    return f"the part ({', '.join(ops[:most])}{', ...' if len(ops) > most else ''})"


def _check_chain(module: nn.Module, segs: list[fx.GraphModule], example: torch.Tensor) -> str | None:
    """None when the chain computes what the module does, else why not.  Both run in training mode
    from one random state (dropout draws alike); buffers (BatchNorm statistics) are restored after."""
    held = {id(p) for seg in segs for p in seg.parameters()}
    lost = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in held]
    if lost:  # used by a call fx keeps opaque: the chain would compute with them but never train them
        return f"its split blocks would not train {len(lost)} of its parameters ({lost[0]}, ...)"
    with _buffers_restored(module):
        return _compare(module, segs, example)


@contextlib.contextmanager
def _buffers_restored(module: nn.Module):
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def _compare(module: nn.Module, segs: list[fx.GraphModule], example: torch.Tensor) -> str | None:
    with torch.no_grad(), torch.random.fork_rng():
        try:
            torch.manual_seed(0)
            ref = module(example)
            torch.manual_seed(0)
            h = example
            for k, seg in enumerate(segs):
                h = seg(h)
                if k < len(segs) - 1 and not isinstance(h, torch.Tensor):
                    return f"block {k} returns {type(h).__name__}, not one tensor"
        except Exception as e:
            return f"its split blocks fail on the example batch ({type(e).__name__}: {_short(e)})"
    same = torch.utils._pytree.tree_flatten(ref)[0], torch.utils._pytree.tree_flatten(h)[0]
    if len(same[0]) != len(same[1]) or not all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(*same) if isinstance(a, torch.Tensor)):
        return "its split blocks compute something other than its forward (state or in-place work across blocks)"
    return None


FIX = ("to pipeline it, give it a forward that is a chain of child modules each taking and returning one tensor "
       "(an nn.Sequential, or a ModuleList of layers looped over), or return a hetsim Workload with your own blocks")


def _fallback(whole: Split, name: str, why: str, fix: str = FIX) -> Split:
    return Split(blocks=whole.blocks, why_whole=why, notes=(
        f"{name} runs as one block (data parallel and ZeRO plans only, no pipeline): {why}; {fix}",))


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:160]


def merge_tied_blocks(blocks: list[tuple[str, nn.Module]], name: str) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """Blocks that share a parameter (tied weights), with every block between them, become one
    nn.Sequential block: a pipeline stage then holds the tied parameter once."""
    owner: dict[int, int] = {}
    joined = list(range(len(blocks)))  # joined[k]: the first block of k's group
    for k, (_, b) in enumerate(blocks):
        for p in b.parameters():
            first = owner.setdefault(id(p), k)
            for j in range(first + 1, k + 1):
                joined[j] = joined[first]
    if joined == list(range(len(blocks))):
        return blocks, []
    out: list[tuple[str, nn.Module]] = []
    groups: dict[int, list[int]] = {}
    for k, g in enumerate(joined):
        groups.setdefault(g, []).append(k)
    for _, ks in sorted(groups.items()):
        if len(ks) == 1:
            out.append(blocks[ks[0]])
        else:
            seq = nn.Sequential()
            for k in ks:
                seq.add_module(blocks[k][0], blocks[k][1])
            out.append((f"{blocks[ks[0]][0]}-{blocks[ks[-1]][0]}", seq))
    tied = [f"{blocks[gs[0]][0]}..{blocks[gs[-1]][0]}" for gs in groups.values() if len(gs) > 1]
    note = (f"{name}: blocks {', '.join(tied)} share parameters (tied weights) and stay on one stage, "
            f"leaving {len(out)} blocks to cut between" + ("" if len(out) > 1 else
                                                        " (no pipeline plans; untie them, e.g. hf:...?tie=0)"))
    return out, [note]
