"""Gradients: each attention / interpolation op against a dense reference, the whole model against
torch autograd on HF's model (same weights, f32), and the attention description on the default path.

The model's scalar is a fixed random weighting of the logits at the real (non-padding) positions,
so every parameter (vision tower, mergers, deepstack, decoder, LM head) gets a gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_processor_batch, user_prompt
from flax import nnx

from pallas_kernels.attention import api as attention_api
from pallas_kernels.attention import reference as attention_ref
from pallas_kernels.attention.mask import AttentionMask
from pallas_kernels.pos_embed import api as pos_api
from pallas_kernels.pos_embed import reference as pos_ref
from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.params import ours_to_hf_name
from qwen3vl_jax.model import MODEL_INPUTS, canonical_params

CASE = dict(
    prompts=[user_prompt("image", "video", "What is shown?"), user_prompt("Short.")],
    images=[(64, 96)],
    videos=[(4, 64, 64, 2.0)],
)


def _close(ours, ref, what, rtol=2e-4):
    """|ours - ref| <= rtol * max|ref| (+ a tiny floor): gradients of different magnitudes per tensor."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: {ours.shape} != {ref.shape}"
    assert np.all(np.isfinite(ours)), f"{what}: non-finite gradient"
    scale = float(np.abs(ref).max())
    err = float(np.abs(ours - ref).max())
    assert err <= rtol * scale + 1e-9, f"{what}: max|diff| {err:.3g} vs max|ref| {scale:.3g}"
    return err / max(scale, 1e-30)


# ---------------------------------------------------------------------- op level


def _attention_cases():
    rng = np.random.default_rng(0)
    size, heads, kv_heads, dim = 37, 4, 2, 32
    q = jnp.asarray(rng.standard_normal((2, size, heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, size, kv_heads, dim)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat([0, 1, 2, -1], [9, 15, 10, 3]).astype(np.int32))
    segments = AttentionMask.segments(jnp.stack([seg, seg]))
    causal = AttentionMask.causal(jnp.array([0, 11]), jnp.array([size, size]), size)
    decode = AttentionMask.causal(jnp.array([0, 5]), jnp.array([30, 30]), 1, offset=29)
    return {
        "causal_left_padding": (q, k, v, causal),
        "segments_with_padding": (q, k, v, segments),
        "decode_window": (q[:, :1], k, v, decode),
    }


@pytest.mark.parametrize("blocks", [(8, 16), (16, 8), (8, 8)])
@pytest.mark.parametrize("case", ["causal_left_padding", "segments_with_padding"])
def test_flash_backward_over_many_blocks(case, blocks):
    """The spec's own backward (recomputed per visited block pair from the saved log-sum-exp, dK and
    dV accumulated across query blocks) against autodiff of the dense oracle, with blocks small
    enough that every row spans several key blocks, some pairs are skipped and some rows are empty."""
    q, k, v, mask = _attention_cases()[case]
    probe = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
    block_q, block_k = blocks

    def ours(q, k, v):
        out = attention_ref.attention(q, k, v, mask.kv_start, mask.kv_end, block_q=block_q, block_k=block_k)
        return jnp.sum(out * probe)

    def oracle(q, k, v):
        return jnp.sum(attention_ref.masked_attention(q, k, v, mask.dense(k.shape[1])) * probe)

    np.testing.assert_allclose(ours(q, k, v), oracle(q, k, v), rtol=1e-5)
    got = jax.grad(ours, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(oracle, argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        _close(a, b, f"{case} blocks {blocks} d{name}", rtol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("case", ["causal_left_padding", "segments_with_padding", "decode_window"])
def test_attention_gradients_match_dense(case, implementation):
    q, k, v, mask = _attention_cases()[case]
    probe = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    dense = mask.dense(k.shape[1])

    def ours(q, k, v):
        return jnp.sum(attention_api.attention(q, k, v, mask, implementation=implementation) * probe)

    def oracle(q, k, v):
        return jnp.sum(attention_ref.masked_attention(q, k, v, dense) * probe)

    got = jax.grad(ours, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(oracle, argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        _close(a, b, f"{case} {implementation} d{name}", rtol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_pos_embed_gradient_matches_dense(implementation):
    rng = np.random.default_rng(2)
    side, dim = 8, 32
    table = jnp.asarray(rng.standard_normal((side * side, dim)), jnp.float32)
    indices, weights = pos_ref.interpolation_taps(np.array([[1, 6, 10], [2, 4, 4]]), side, 2)
    probe = jnp.asarray(rng.standard_normal((indices.shape[0], dim)), jnp.float32)
    # Dense oracle: the interpolation as a [P, side*side] matrix times the table.
    matrix = np.zeros((indices.shape[0], side * side), np.float64)
    np.add.at(matrix, (np.arange(indices.shape[0])[:, None], indices), weights)
    want = matrix.T @ np.asarray(probe, np.float64)

    def ours(table):
        out = pos_api.interpolate_pos_embed(table, jnp.asarray(indices), jnp.asarray(weights),
                                            implementation=implementation)
        return jnp.sum(out * probe)

    _close(jax.grad(ours)(table), want, f"pos_embed {implementation}", rtol=1e-6)


# ---------------------------------------------------------------------- the whole model against torch autograd


@pytest.fixture(scope="module")
def batch(hf_processor):
    return {k: v for k, v in hf_processor_batch(hf_processor, CASE).items() if k in MODEL_INPUTS}


def _probe(batch, vocab):
    real = batch["attention_mask"].numpy().astype(bool)
    probe = np.random.default_rng(3).standard_normal((*real.shape, vocab)).astype(np.float32)
    return probe * real[..., None]  # HF's logits at padding positions are arbitrary: leave them out


@pytest.fixture(scope="module")
def torch_grads(batch, hf_model):
    import torch

    probe = torch.from_numpy(_probe(batch, hf_model.config.text_config.vocab_size))
    hf_model.zero_grad(set_to_none=True)
    (hf_model(**batch).logits * probe).sum().backward()
    grads = {name: p.grad.detach().numpy().copy() for name, p in hf_model.named_parameters() if p.grad is not None}
    hf_model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.needs_torch
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_model_gradients_equal_torch_autograd(implementation, tiny_dir, batch, torch_grads):
    model = Qwen3VL.from_pretrained(tiny_dir, attention_implementation=implementation)
    inputs = {k: v.numpy() for k, v in batch.items()}
    probe = jnp.asarray(_probe(batch, model.config.text.vocab_size))
    grads = nnx.grad(lambda m: jnp.sum(m(**inputs) * probe))(model)
    ours = canonical_params(grads)
    assert len(ours) == len(torch_grads), (len(ours), len(torch_grads))
    worst = 0.0
    for path, value in ours.items():
        name, transform = ours_to_hf_name(path)
        worst = max(worst, _close(transform.to_hf(np.asarray(value), model.config), torch_grads[name],
                                  f"{implementation} {path}"))
    print(f"\n[gradients] {implementation}: {len(ours)} tensors, worst |diff| / max|ref| {worst:.2e}")


@pytest.mark.needs_torch
@pytest.mark.slow  # (the fast tier keeps the whole model's gradients against torch autograd)
def test_prepared_inputs_give_the_vision_tower_gradients(tiny_dir, batch, jax_model):
    """`prepare_inputs(encode=False)` outside, `forward` inside the transformation: the same gradients
    as differentiating `model(...)` (the vision tower is encoded inside the differentiated function)."""
    inputs = {k: v.numpy() for k, v in batch.items()}
    probe = jnp.asarray(_probe(batch, jax_model.config.text.vocab_size))
    prepared = jax_model.prepare_inputs(**inputs, encode=False)
    assert prepared.features is None and prepared.pixel_values is not None
    direct = canonical_params(nnx.grad(lambda m: jnp.sum(m(**inputs) * probe))(jax_model))
    staged = canonical_params(nnx.grad(lambda m: jnp.sum(m.forward(prepared) * probe))(jax_model))
    for path in direct:  # two compilations of the same function: rounding only
        _close(staged[path], direct[path], path, rtol=1e-5)
    assert float(np.abs(staged["visual.patch_embed.proj.kernel"]).max()) > 0


# ---------------------------------------------------------------------- the attention description


def _arrays_in(jaxpr):
    """Every value's shape and dtype in a jaxpr, sub-jaxprs (scan, cond, jit, custom_vjp) included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _arrays_in(inner)


def test_no_dense_mask_on_the_default_path(jax_model):
    """The model's forward (the default "auto" path: the jnp spec on a CPU) never holds an `[.., L, L]`
    array: no dense mask, no full score matrix. L = 37 is no block size."""
    ids = np.random.default_rng(4).integers(10, 400, (2, 37))
    mask = np.ones((2, 37), bool)
    mask[1, :6] = False  # left padding
    inputs = jax_model.prepare_inputs(ids, mask)
    graphdef, state = nnx.split(jax_model)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s).forward(inputs))(state)
    square = [a for a in _arrays_in(jaxpr.jaxpr) if getattr(a, "shape", ())[-2:] == (37, 37)]
    assert not square, f"dense [.., L, L] values on the default path: {square[:5]}"
    # The oracle (a dense mask) would be caught by the same walk.
    dense = jax.make_jaxpr(lambda q: attention_ref.masked_attention(q, q, q, jnp.ones((2, 37, 37), bool)))(
        jnp.zeros((2, 37, 2, 16)))
    assert any(getattr(a, "shape", ())[-2:] == (37, 37) for a in _arrays_in(dense.jaxpr))
