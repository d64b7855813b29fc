"""`return_attentions`: the attention probabilities of chosen layers, against HF's eager attention
(`output_attentions=True`) and, for the vision tower's blocks and the spec itself, dense references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, hf_processor_batch, user_prompt

from pallas_kernels.attention import reference
from pallas_kernels.attention.mask import AttentionMask
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.vision import vision_metadata, vision_rotary_cos_sin, vision_rotary_inv_freq
from qwen3vl_jax.layers import apply_rotary

CASES = {
    "image": dict(prompts=[user_prompt("image", "Describe this image.")], images=[(64, 96)]),
    "video": dict(prompts=[user_prompt("video", "What happens?")], videos=[(4, 64, 64, 2.0)]),
    "left_padding": dict(prompts=[user_prompt("image", "A long question about the picture here?"),
                                  user_prompt("Short.")], images=[(64, 64)]),
}


def _dense_probs(q, k, allowed):
    """float64 softmax of q.k / sqrt(D) over the allowed keys; q `[B, L, H, D]`, k `[B, S, G, D]`."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    rep = q.shape[2] // k.shape[2]
    k = np.repeat(k, rep, axis=2)
    s = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1])
    s = np.where(allowed[:, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = p.sum(-1, keepdims=True)
    return np.where(total > 0, p / np.where(total > 0, total, 1), 0)


@pytest.mark.parametrize("length, kv_len, block", [(37, 37, 16), (1, 29, 16), (24, 40, 8)])
def test_spec_weights_equal_a_dense_softmax(length, kv_len, block):
    """Causal, cache-like (keys beyond the queries) and single-row calls; several key blocks."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, length, 4, 8)).astype(np.float32)
    k = rng.normal(size=(2, kv_len, 2, 8)).astype(np.float32)
    offset = kv_len - length
    mask = AttentionMask.causal(np.array([0, 5]), np.array([kv_len, kv_len]), length, offset)
    ours = reference.attention_weights(jnp.asarray(q), jnp.asarray(k), mask.kv_start, mask.kv_end,
                                       block_q=block, block_k=block)
    ref = _dense_probs(q, k, np.asarray(mask.dense(kv_len)))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-6, rtol=1e-5)
    # The probabilities are the ones the spec applies: weights @ v is the spec's output.
    v = rng.normal(size=k.shape).astype(np.float32)
    out = reference.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask.kv_start, mask.kv_end,
                              block_q=block, block_k=block)
    mixed = np.einsum("bhls,bshd->blhd", np.asarray(ours), np.repeat(v, 2, axis=2))
    np.testing.assert_allclose(np.asarray(out), mixed, atol=1e-5, rtol=1e-5)


@pytest.fixture
def hf_eager(hf_model):
    """The session's HF model under eager attention (the one that returns probabilities), restored after."""
    before = hf_model.config._attn_implementation
    hf_model.set_attn_implementation("eager")
    yield hf_model
    hf_model.set_attn_implementation(before)


@pytest.mark.needs_torch
@pytest.mark.parametrize("case", list(CASES))
def test_text_attentions_equal_hf_eager(case, hf_processor, hf_eager, jax_model):
    import torch

    batch = hf_processor_batch(hf_processor, CASES[case])
    batch = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    with torch.no_grad():
        ref = hf_eager(**batch, output_attentions=True)
    layers = tuple(range(jax_model.config.text.num_hidden_layers))
    logits, attentions = jax_model(**{k: v.numpy() for k, v in batch.items()}, return_attentions=layers)
    plain = jax_model(**{k: v.numpy() for k, v in batch.items()})
    real = batch["attention_mask"].numpy().astype(bool)
    assert sorted(attentions) == list(layers)
    assert_close(np.asarray(logits)[real], np.asarray(plain)[real], "f32_module", "logits with the option")
    for layer in layers:
        ours, theirs = np.asarray(attentions[layer]), ref.attentions[layer].numpy()
        assert ours.shape == theirs.shape, f"layer {layer}"
        # rows of padding tokens: HF's are arbitrary, ours zero
        rows = real[:, None, :, None]
        assert_close(np.where(rows, ours, 0), np.where(rows, theirs, 0), "f32_module", f"{case} layer {layer}")
        rows = np.broadcast_to(real[:, None], ours.shape[:3])
        assert not ours[~rows].any()
        np.testing.assert_allclose(ours.sum(-1)[rows], 1, atol=1e-5)


def test_vision_block_attentions_equal_a_dense_reference(jax_model):
    """Two items (an image and a 2-frame video) packed in one call: attention stays inside frames."""
    cfg = jax_model.config.vision
    grid = np.array([[1, 4, 6], [2, 4, 4]])
    pixels = np.random.default_rng(1).normal(size=(int(grid.prod(1).sum()), cfg.patch_dim)).astype(np.float32)
    out = jax_model.encode_vision(pixels, grid, return_hidden_states=True, return_attentions=(1, 3))
    merged, deepstack = jax_model.encode_vision(pixels, grid)
    assert_close(out.merged, merged, "f32_tower", "merged with the option")  # another program: rounding
    assert sorted(out.attentions) == [1, 3]
    meta = vision_metadata(grid, cfg)
    cos, sin = vision_rotary_cos_sin(jnp.asarray(meta.rotary_ids), jnp.asarray(vision_rotary_inv_freq(cfg)))
    seg = meta.segment_ids
    allowed = (seg[:, None] == seg[None, :])[None]
    for block_index in (1, 3):
        block = jax_model.visual.blocks[block_index]
        x = block.norm1(out.hidden_states[block_index - 1])
        qkv = block.attn.qkv(x).reshape(x.shape[0], 3, cfg.num_heads, -1)
        q = apply_rotary(qkv[:, 0], cos[:, None], sin[:, None])
        k = apply_rotary(qkv[:, 1], cos[:, None], sin[:, None])
        ref = _dense_probs(np.asarray(q)[None], np.asarray(k)[None], allowed)[0]
        assert_close(out.attentions[block_index], ref, "f32_module", f"block {block_index}")


def test_scanned_layers_return_the_same_attentions(tiny_dir, jax_model):
    from qwen3vl_jax import Qwen3VL

    scanned = Qwen3VL.from_pretrained(tiny_dir, scan_layers=True)
    ids = np.arange(3, 40)[None] % 200
    logits, attentions = scanned(ids, return_attentions=1)
    ref_logits, ref_attentions = jax_model(ids, return_attentions=[1])
    assert list(attentions) == [1]
    assert_close(attentions[1], ref_attentions[1], "f32_module", "layer 1")
    assert_close(logits, ref_logits, "f32_logits", "logits")


@pytest.mark.parametrize("bad, message", [
    (3, r"return_attentions: 3 is not a layer index in \[0, 3\) \(the model has 3 layers\)"),
    ((0, -1), r"-1 is not a layer index"),
    ("0", r"'0' is not a layer index"),
    (1.5, r"must be a layer index or a sequence"),
])
def test_bad_layers_are_named(bad, message, jax_model):
    with pytest.raises(ValueError, match=message):
        jax_model(np.arange(3, 10)[None], return_attentions=bad)
    with pytest.raises(ValueError, match="block index"):
        jax_model.encode_vision(np.zeros((16, jax_model.config.vision.patch_dim), np.float32), [[1, 4, 4]],
                                return_attentions=9)


def test_attention_grids_put_each_token_on_its_cell():
    from qwen3vl_jax.attention_maps import attention_grids, to_pixels

    # an image of merged grid (1, 2, 3) (rows 0..5) then a video (2, 1, 2) (rows 6..9); the row holds
    # text, the image, then the video with its row 7 pruned (never referenced)
    visual_index = np.array([-1, 0, 1, 2, 3, 4, 5, -1, 6, 8, 9, -1])
    weights = np.arange(12) / 100.0
    image, video = attention_grids(weights, visual_index, [[1, 4, 6]], [[2, 2, 4]], 2)
    np.testing.assert_array_equal(image, [[[0.01, 0.02, 0.03], [0.04, 0.05, 0.06]]])
    np.testing.assert_array_equal(video[0], [[0.08, np.nan]])
    np.testing.assert_array_equal(video[1], [[0.09, 0.10]])
    pixels = to_pixels(image, cell=2, frames_per_step=2)
    assert pixels.shape == (2, 4, 6) and pixels[1, 3, 5] == 0.06 and pixels[0, 0, 1] == 0.01
    with pytest.raises(ValueError, match="names encoder row 10"):
        attention_grids(weights, np.where(visual_index == 9, 10, visual_index), [[1, 4, 6]], [[2, 2, 4]], 2)
