"""`causal_lm_loss` against HF's `Qwen3VLForConditionalGeneration(..., labels=...).loss` on the same
weights (f32; images + video + left padding, multi-turn), and the memory claim for bf16."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_close
from flax import nnx
from test_training_labels import CONVERSATIONS, conversation_batch

from qwen3vl_jax import Qwen3VL, Qwen3VLProcessor
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.training import IGNORE_INDEX, assistant_labels, causal_lm_loss
from qwen3vl_jax.training import loss as loss_lib


@pytest.fixture(scope="module")
def batch(tiny_dir):
    processor = Qwen3VLProcessor.from_pretrained(tiny_dir)
    out = conversation_batch(processor, CONVERSATIONS, "left")
    out["labels"] = assistant_labels(out["input_ids"], out["attention_mask"], processor, CONVERSATIONS)
    return out


def hf_loss(hf_model, batch) -> float:
    inputs = {k: torch.from_numpy(np.asarray(batch[k])) for k in MODEL_INPUTS if k in batch}
    with torch.no_grad():
        return float(hf_model(**inputs, labels=torch.from_numpy(batch["labels"])).loss)


def test_loss_equals_hf(batch, hf_model, jax_model):
    ref = hf_loss(hf_model, batch)
    ours = float(causal_lm_loss(jax_model, batch))
    assert_close(ours, ref, "f32_logits", "loss")
    # The chunking is memory, not numerics: one-token chunks and a single chunk agree.
    assert float(causal_lm_loss(jax_model, batch, chunk_size=1)) == pytest.approx(ours, rel=1e-6)
    assert float(causal_lm_loss(jax_model, batch, chunk_size=10_000)) == pytest.approx(ours, rel=1e-6)


def test_loss_counts_only_supervised_tokens(batch, hf_model, jax_model):
    """Dropping the first answer's labels changes the mean the way HF's does (and differs from before)."""
    labels = batch["labels"].copy()
    first = np.flatnonzero(labels[0] != IGNORE_INDEX)[:5]
    labels[0, first] = IGNORE_INDEX
    edited = {**batch, "labels": labels}
    ref = hf_loss(hf_model, edited)
    assert abs(ref - hf_loss(hf_model, batch)) > 1e-3
    assert_close(float(causal_lm_loss(jax_model, edited)), ref, "f32_logits", "loss with fewer labels")
    empty = {**batch, "labels": np.full_like(labels, IGNORE_INDEX)}
    assert float(causal_lm_loss(jax_model, empty)) == 0.0  # HF: NaN


def test_bad_labels_are_an_error(batch, jax_model):
    with pytest.raises(ValueError, match="no 'labels'"):
        causal_lm_loss(jax_model, {k: v for k, v in batch.items() if k != "labels"})
    with pytest.raises(ValueError, match="labels shape"):
        causal_lm_loss(jax_model, {**batch, "labels": batch["labels"][:, 1:]})


def _arrays(jaxpr):
    """Every (shape, dtype) produced anywhere in a jaxpr, sub-jaxprs (scan, remat, pjit) included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(var.aval.shape), var.aval.dtype
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _arrays(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _arrays(sub)


def test_bf16_loss_has_no_full_f32_logits(tiny_dir, batch, hf_model):
    """In bf16 the largest float32 array over the vocabulary is one chunk's logits, forward and
    backward; the value stays near HF's float32 loss."""
    model = Qwen3VL.from_pretrained(tiny_dir, dtype=jnp.bfloat16)
    vocab = model.config.text.vocab_size
    tokens = batch["input_ids"].size
    chunk = 16
    assert tokens > 4 * chunk
    inputs = model.prepare_inputs(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
    labels = jnp.asarray(batch["labels"], jnp.int32)
    graphdef, state = nnx.split(model)
    fn = functools.partial(loss_lib._loss_from_inputs, graphdef, chunk_size=chunk)

    def widest_f32_logits(jaxpr):
        sizes = [int(np.prod(shape)) for shape, dtype in _arrays(jaxpr)
                 if shape and shape[-1] == vocab and dtype == jnp.float32]
        return max(sizes)

    forward = jax.make_jaxpr(fn)(state, inputs, labels).jaxpr
    assert widest_f32_logits(forward) == chunk * vocab
    backward = jax.make_jaxpr(jax.grad(lambda s: fn(s, inputs, labels)))(state).jaxpr
    assert widest_f32_logits(backward) == chunk * vocab

    ours = float(fn(state, inputs, labels))
    ref = hf_loss(hf_model, batch)
    print(f"bf16 loss {ours:.5f} vs HF f32 {ref:.5f}")
    assert ours == pytest.approx(ref, rel=0.02)


def test_gradient_through_the_language_model_equals_torch(batch, hf_model, jax_model):
    """d loss / d (decoder, LM head) against torch autograd, the visual features held as inputs:
    the chunked, rematerialized cross-entropy differentiates like HF's. (Gradients into the vision
    tower wait for a differentiable varlen attention.)"""
    from qwen3vl_jax.params import ours_to_hf_name
    from qwen3vl_jax.params import flat_paths

    hf_model.zero_grad()
    inputs = {k: torch.from_numpy(np.asarray(batch[k])) for k in MODEL_INPUTS if k in batch}
    hf_model(**inputs, labels=torch.from_numpy(batch["labels"])).loss.backward()
    reference = dict(hf_model.named_parameters())

    prepared = jax_model.prepare_inputs(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
    labels = jnp.asarray(batch["labels"], jnp.int32)
    graphdef, state = nnx.split(jax_model)
    loss = functools.partial(loss_lib._loss_from_inputs, graphdef, chunk_size=16)
    grads = jax.grad(lambda s: loss(s, prepared, labels))(state)
    checked = 0
    for path, grad in flat_paths(grads):
        if path.startswith("visual."):
            continue
        name, transform = ours_to_hf_name(path)
        ref = reference[name].grad.numpy()
        assert np.abs(ref).max() > 0, name
        ours = transform.to_hf(np.asarray(grad), jax_model.config)
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=path)
        checked += 1
    assert checked == 3 + 11 * jax_model.config.text.num_hidden_layers
    hf_model.zero_grad()
