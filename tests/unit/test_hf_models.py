"""`hf:NAME`: Hugging Face models by checkpoint preset or by any model type transformers knows, built
offline from their configurations.  The split into embedding, layers and head must compute what the
model itself computes (checked here against the model's own logits and gradients); a model whose
layout does not hold runs as one block; bad names and sizes are one error with the fix."""

from __future__ import annotations

import pytest
import torch

from hetsim.errors import ConfigError, UnknownNameError
from hetsim.workloads import load_workload, workload_from_spec

transformers = pytest.importorskip("transformers")

from hetsim.workloads import hf  # noqa: E402 - after the skip: it needs transformers

SMALL = "layers=2&hidden=64&heads=4&intermediate=128&vocab=256&seq=16"


def _reference(spec: str) -> torch.nn.Module:
    """The transformers model of `spec` itself, built as hetsim builds it (seed 0)."""
    name, over = hf.parse_hf(spec)
    mtype, task, model_name = hf._task(transformers, name, spec)
    cfg = hf._config(transformers, name, mtype, over, spec)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(cfg)


@pytest.mark.parametrize("spec, n_blocks", [
    (f"hf:llama?{SMALL}", 4),
    (f"hf:mistral?{SMALL}&kv_heads=2", 4),
    (f"hf:qwen3?{SMALL}", 4),
    (f"hf:phi?{SMALL}", 4),
    (f"hf:gpt2?{SMALL}&tie=0", 4),
    (f"hf:bert?{SMALL}&tie=0", 4),
])
def test_split_models_compute_the_models_own_loss_and_gradients(spec, n_blocks):
    wl = load_workload(spec)
    assert len(wl.block_names()) == n_blocks and wl.block_names()[0] == "embed" and wl.block_names()[-1] == "head"
    assert workload_from_spec(wl.spec).block_names() == wl.block_names()  # a worker rebuilds it from the spec
    x, y = wl.make_batch(3, 1)
    ref = _reference(spec).eval()  # eval: no dropout, so the two forwards can agree exactly
    want = wl.loss_sum(ref(input_ids=x).logits, y)
    want.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    h = x
    task = hf._task(transformers, hf.parse_hf(spec)[0], spec)[1]
    for _, blk in hf._blocks(ref, hf._layout(ref, task), task):  # the split of that very model
        h = blk(h)
    got = wl.loss_sum(h, y)
    got.backward()
    assert torch.allclose(got, want, atol=1e-5)
    for n, p in ref.named_parameters():  # a parameter the model's loss does not reach (untied BERT's cls.predictions.bias) gets none either way
        assert (p.grad is None) == (grads[n] is None) and (p.grad is None or torch.allclose(p.grad, grads[n], atol=1e-5)), n
    # and the workload's own build (seed 0, as the reference) computes the same loss
    assert torch.allclose(wl.loss_sum(wl.model().eval()(x), y), want, atol=1e-5)


@pytest.mark.parametrize("spec, task", [(f"hf:opt?{SMALL}", "causal"), (f"hf:t5?{SMALL}", "seq2seq"),
                                        (f"hf:distilbert?{SMALL}", "masked")])
def test_models_of_another_layout_run_whole_and_train(spec, task):
    wl = load_workload(spec)
    assert wl.block_names() == ["model"]
    assert any("runs as one block" in n and "no pipeline" in n for n in wl.notes)
    x, y = wl.make_batch(2, 0)
    model = wl.model()
    loss = wl.loss_sum(model(x), y)
    loss.backward()
    assert loss.item() > 0 and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert hf._task(transformers, hf.parse_hf(spec)[0], spec)[1] == task


def test_a_layout_that_does_not_compute_the_model_is_not_used(monkeypatch):
    """The layout is only trusted once it reproduces a two-layer model: a split that drops the final norm
    (as a model with an extra step between layers and head would) leaves the model whole."""
    real = hf._blocks

    def without_final_norm(m, layout, task):
        blocks = real(m, layout, task)
        if layout == "llama":
            blocks[-1] = ("head", m.lm_head)
        return blocks

    monkeypatch.setattr(hf, "_blocks", without_final_norm)
    wl = load_workload(f"hf:llama?{SMALL}")
    assert wl.block_names() == ["model"]


def test_tied_embeddings_keep_embedding_and_head_on_one_block():
    wl = load_workload(f"hf:gpt2?{SMALL}")
    assert len(wl.block_names()) == 1 and any("tied weights" in n and "tie=0" in n for n in wl.notes)


def test_presets_have_their_checkpoints_sizes_and_types_their_defaults():
    assert "334." in load_workload("hf:bert-large-uncased").about  # 334.8M with the masked-LM head
    gpt2 = load_workload("hf:GPT2?seq=64")  # names are not case sensitive
    assert gpt2.spec == "hf:gpt2?seq=64" and "GPT2LMHeadModel" in gpt2.about
    assert "6738.4M parameters" in load_workload("hf:llama").about  # LlamaConfig's defaults: Llama-2-7B


@pytest.mark.parametrize("spec, match", [
    ("hf:gpt7", r"unknown Hugging Face model 'gpt7'.*did you mean.*'gpt2'.*model types"),
    ("hf:meta-llama/Llama-2-7b-hf", r"no model hub.*hf:llama\?layers=32"),
    ("hf:gpt2?kv_heads=2", r"GPT2Config\) has no 'kv_heads'.*leave kv_heads= out"),
    ("hf:llama?hidden=60&heads=7", r"7 heads do not divide a hidden size of 60"),
    ("hf:llama?heads=4&kv_heads=3", r"3 key/value heads do not divide 4 attention heads.*kv_heads="),
    ("hf:gpt2?layers=two", r"KEY=N"),
])
def test_bad_names_and_sizes_are_one_error_with_the_fix(spec, match):
    with pytest.raises((ConfigError, UnknownNameError), match=match):
        load_workload(spec)
