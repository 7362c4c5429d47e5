"""Workloads of any model: gpt/bert/vit presets, a user's plain modules as workloads (their blocks,
batches, losses and outputs), hf: and timm: specs, and the rules a user's model must follow (no live
runs: forward and backward in this process).  Where the cut-point finder splits a module:
test_cutpoints.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetsim.errors import ConfigError, UnknownNameError
from hetsim.workloads import load_workload, workload_from_spec
from hetsim.workloads.transformer import IGNORE, gpt_workload

pytestmark = pytest.mark.usefixtures("user_assets")  # tests/assets importable as user_models


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


@pytest.mark.parametrize("fn, rule", [
    ("bad_shapes", "need 2 samples"),
    ("bad_loss", "one number"),
    ("broken", "fails to build"),
    ("sparse_bag", r"module '0' \(EmbeddingBag\) was built with sparse=True.*sparse=False"),
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


def test_zero_stages_that_use_fully_shard_refuse_a_torchscript_child():
    """fully_shard cannot wrap a TorchScript module (it registers state-dict hooks ScriptModules lack):
    found when user_models:scripted_stem's ZeRO-2/3 calibration runs failed; now infeasible with the fix."""
    import strategies
    from hetsim.errors import InfeasiblePlanError
    from hetsim.testing.contract import structural_cost
    from strategies.zero import ZeROPlan

    cost = structural_cost("user_models:scripted_stem")
    assert [b.script_params for b in cost.base_profile.blocks] == [2, 0, 0, 0, 0]
    zero = strategies.get("zero")
    for stage in (2, 3):
        with pytest.raises(InfeasiblePlanError, match="TorchScript module.*2 parameters.*plain nn.Module"):
            zero.validate(ZeROPlan(devices=(0, 1), local_batch=(4, 4), zero_stage=stage), cost)
    zero.validate(ZeROPlan(devices=(0, 1), local_batch=(4, 4), zero_stage=1), cost)


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


